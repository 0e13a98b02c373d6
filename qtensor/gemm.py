"""The three GEMMs of a linear layer (DESIGN.md §1), on quantized or plain operands.

    fprop  Y  = X · Wᵀ      X rowwise,  W rowwise
    dgrad  dX = dY · W      dY rowwise, W columnwise
    wgrad  dW = dYᵀ · X     dY columnwise, X columnwise

This module holds the emulated reference: each operand's direction is dequantized to fp32 and the
product is taken in fp32. It runs on any device and is what every fast GEMM is checked against.
"""

import contextlib

import torch

from .tensor import QuantizedTensor


def operand(tensor: torch.Tensor, direction: str) -> torch.Tensor:
    """fp32 2-D values of one direction of a quantized operand, or of a plain one."""
    if isinstance(tensor, QuantizedTensor):
        return tensor.dequantize(torch.float32, direction).reshape(-1, tensor.shape[-1])
    return tensor.float().reshape(-1, tensor.shape[-1])


@contextlib.contextmanager
def _ieee_fp32():
    """Full fp32 products even where the caller allowed TF32 (set_float32_matmul_precision)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _fp32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.is_meta:  # shape propagation through a model built on the meta device
        return a @ b
    # Neither an enclosing autocast nor TF32 may lower the reference product's precision.
    with torch.autocast(a.device.type, enabled=False), _ieee_fp32():
        return a @ b


def fprop(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Y [M, N] = X [M, K] · W [N, K]ᵀ, fp32."""
    return _fp32_matmul(operand(x, "rowwise"), operand(weight, "rowwise").t())


def dgrad(grad_output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dX [M, K] = dY [M, N] · W [N, K], fp32."""
    return _fp32_matmul(operand(grad_output, "rowwise"), operand(weight, "columnwise"))


def wgrad(grad_output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW [N, K] = dY [M, N]ᵀ · X [M, K], fp32."""
    return _fp32_matmul(operand(grad_output, "columnwise").t(), operand(x, "columnwise"))
