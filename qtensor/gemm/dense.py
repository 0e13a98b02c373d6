"""The three GEMMs of a linear layer (docs/design.md, The three GEMMs), on quantized or plain operands.

    fprop  Y  = X · Wᵀ      X rowwise,  W rowwise
    dgrad  dX = dY · W      dY rowwise, W columnwise
    wgrad  dW = dYᵀ · X     dY columnwise, X columnwise

Each is C [m, n] = A · Bᵀ over two operand storages whose reduction dimension is contiguous
(`backends.product_nt`): X and W rowwise for fprop; dY rowwise and W columnwise for dgrad; dY and X
columnwise for wgrad (a columnwise storage holds the transposed matrix, reduction dimension last).
"""

from __future__ import annotations

import torch

from .backends import product_nt


def fprop(x: torch.Tensor, weight: torch.Tensor, bias=None, out_dtype=torch.float32, *, fast_accumulation: bool = False) -> torch.Tensor:
    """Y [M, N] = X [M, K] · W [N, K]ᵀ (+ bias), in `out_dtype`; `fast_accumulation` allows the FP8
    tensor cores' fast accumulation (the reference and the other backends are unaffected)."""
    return product_nt(x, "rowwise", weight, "rowwise", bias, out_dtype, fast_accumulation)


def dgrad(grad_output: torch.Tensor, weight: torch.Tensor, out_dtype=torch.float32, *, fast_accumulation: bool = False) -> torch.Tensor:
    """dX [M, K] = dY [M, N] · W [N, K], in `out_dtype` (`fast_accumulation` as in fprop)."""
    return product_nt(grad_output, "rowwise", weight, "columnwise", None, out_dtype, fast_accumulation)


def wgrad(grad_output: torch.Tensor, x: torch.Tensor, out_dtype=torch.float32, *, fast_accumulation: bool = False) -> torch.Tensor:
    """dW [N, K] = dY [M, N]ᵀ · X [M, K], in `out_dtype` (`fast_accumulation` as in fprop)."""
    return product_nt(grad_output, "columnwise", x, "columnwise", None, out_dtype, fast_accumulation)
