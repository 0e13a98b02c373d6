"""Ready factories: `qtensor.quantize_(model, qtensor.recipes.mxfp8())`.

Each call returns a factory that gives every linear layer fresh quantizers of its own (delayed
scaling keeps per-layer state) and leaves other module types alone.
"""

from __future__ import annotations

from typing import Callable

import torch

from .formats.float8 import Float8Quantizer
from .formats.hybrid import HybridQuantizer
from .formats.mxfp8 import MXFP8Quantizer
from .formats.nvfp4 import NVFP4Quantizer
from .quantizer import Quantizer
from .recipe import Role


class ByTensorType:
    """A factory that makes a new quantizer per linear layer and tensor type."""

    def __init__(self, name: str, input: Callable[[], Quantizer], weight: Callable[[], Quantizer], grad_output: Callable[[], Quantizer]):
        self.name = name
        self.makers = {"input": input, "weight": weight, "grad_output": grad_output}

    def __call__(self, role: Role) -> Quantizer | None:
        if role.module_type != "linear":
            return None
        return self.makers[role.tensor_type]()

    def __repr__(self) -> str:
        return f"qtensor.recipes.{self.name}()"


def float8_current() -> ByTensorType:
    """Per-tensor FP8 with current scaling: E4M3 input and weight, E5M2 gradient."""
    return ByTensorType(
        "float8_current",
        input=lambda: Float8Quantizer(torch.float8_e4m3fn),
        weight=lambda: Float8Quantizer(torch.float8_e4m3fn),
        grad_output=lambda: Float8Quantizer(torch.float8_e5m2),
    )


def float8_delayed() -> ByTensorType:
    """Per-tensor FP8 with delayed scaling (amax history): E4M3 input and weight, E5M2 gradient."""
    return ByTensorType(
        "float8_delayed",
        input=lambda: Float8Quantizer(torch.float8_e4m3fn, scaling="delayed"),
        weight=lambda: Float8Quantizer(torch.float8_e4m3fn, scaling="delayed"),
        grad_output=lambda: Float8Quantizer(torch.float8_e5m2, scaling="delayed"),
    )


def mxfp8() -> ByTensorType:
    """MXFP8 (E4M3 elements, E8M0 scale per 32, rceil) for every tensor."""
    return ByTensorType("mxfp8", input=MXFP8Quantizer, weight=MXFP8Quantizer, grad_output=MXFP8Quantizer)


def nvfp4() -> ByTensorType:
    """NVFP4: 16x16 tiles for weights; 1x16 blocks with the Hadamard transform on the wgrad copies of
    inputs and gradients; stochastic rounding for gradients."""
    return ByTensorType(
        "nvfp4",
        input=lambda: NVFP4Quantizer(rht=True),
        weight=lambda: NVFP4Quantizer(block_2d=True),
        grad_output=lambda: NVFP4Quantizer(rht=True, stochastic_rounding=True),
    )


def mxfp8_fwd_nvfp4_bwd() -> ByTensorType:
    """MXFP8 rowwise (forward GEMM) + NVFP4 columnwise (backward GEMMs) for input and weight, NVFP4
    for gradients. The wgrad operands (input columnwise, gradient columnwise) both carry the
    Hadamard transform, so it cancels in dYᵀ·X."""
    return ByTensorType(
        "mxfp8_fwd_nvfp4_bwd",
        input=lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(rht=True)),
        weight=lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer()),
        grad_output=lambda: NVFP4Quantizer(rht=True, stochastic_rounding=True),
    )
