"""The three GEMMs of an expert stack's grouped linear (layers/grouped_linear.py): one product per
group of rows, each on its expert's operands, over the dense GEMMs (`dense.py`) and so the backend
each pair of operand forms picks. The groups run one after another; a backend that multiplies every
group in one launch takes its place here.

    fprop  Y_g  = X_g · W_eᵀ       dgrad  dX_g = dY_g · W_e       wgrad  dW_e = dY_gᵀ · X_g
"""

from __future__ import annotations

import torch

from . import dense


def fprop(out: torch.Tensor, groups, operands, *, fast_accumulation: bool = False) -> None:
    """out[rows of g] = X_g · W_eᵀ for each group `g` = (expert, start, end) and its operands (X_g, W_e)."""
    for (_, start, end), (x, weight) in zip(groups, operands):
        out[start:end] = dense.fprop(x, weight, None, out.dtype, fast_accumulation=fast_accumulation)


def dgrad(out: torch.Tensor, groups, operands) -> None:
    """out[rows of g] = dY_g · W_e for each group and its operands (dY_g, W_e)."""
    for (_, start, end), (grad, weight) in zip(groups, operands):
        out[start:end] = dense.dgrad(grad, weight, out.dtype)


def wgrad(out: torch.Tensor, groups, operands) -> None:
    """out[e] = dY_gᵀ · X_g ([out_features, in_features]) for each group."""
    for (expert, _, _), (grad, x) in zip(groups, operands):
        out[expert] = dense.wgrad(grad, x, out.dtype)
