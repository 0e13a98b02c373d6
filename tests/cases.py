"""Parameter grids and small helpers shared by the numerics test modules."""

import pytest
import torch

import oracle
import qtensor

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


def assert_default_dequantize(q, x, deq):
    """q.dequantize() with no arguments: the oracle's fp32 values rounded to x's dtype, in x's shape."""
    default = q.dequantize()
    assert default.dtype == x.dtype and default.shape == x.shape
    oracle.assert_same_bits(default, oracle.round_to_dtype(deq, x.dtype).reshape(x.shape), "dequantize() in the input dtype")


def assert_holds_only(q, direction):
    """A tensor quantized in one direction has no other, and asking for it is a ValueError."""
    missing = "columnwise" if direction == "rowwise" else "rowwise"
    assert getattr(q, missing) is None and getattr(q, direction) is not None
    with pytest.raises(ValueError):
        q.dequantize(torch.float32, missing)

# One quantizer per format and notable option, for the format-independent tests (dispatch, buffers).
FORMATS = {
    "float8": lambda: qtensor.Float8Quantizer(),
    "float8_delayed": lambda: qtensor.Float8Quantizer(scaling="delayed"),
    "mxfp8": lambda: qtensor.MXFP8Quantizer(),
    "nvfp4": lambda: qtensor.NVFP4Quantizer(),
    "nvfp4_rht": lambda: qtensor.NVFP4Quantizer(rht=True),
    "nvfp4_2d": lambda: qtensor.NVFP4Quantizer(block_2d=True),
    "identity": lambda: qtensor.IdentityQuantizer(),
    "hybrid": lambda: qtensor.HybridQuantizer(qtensor.MXFP8Quantizer(), qtensor.NVFP4Quantizer(rht=True)),
}
