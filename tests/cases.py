"""Parameter grids and small helpers shared by the numerics test modules."""

import torch

import oracle

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# input kind (see conftest.inputs) -> shape; partial blocks in both directions
KIND_SHAPES = {"varied": (64, 96), "special": (37, 45), "extremes": (48, 40), "all_tiny": (16, 33), "zeros": (5, 7)}
DIRECTIONS = ("rowwise", "columnwise")


def dtype_id(dtype):
    return str(dtype).replace("torch.", "") if dtype is not None else "None"


def as_2d(x):
    """A torch tensor as the fp32 numpy 2-D view the oracle takes."""
    return oracle.as_f32(x).reshape(-1, x.shape[-1])
