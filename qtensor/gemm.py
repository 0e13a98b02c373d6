"""The three GEMMs of a linear layer (DESIGN.md §1), on quantized or plain operands.

    fprop  Y  = X · Wᵀ      X rowwise,  W rowwise
    dgrad  dX = dY · W      dY rowwise, W columnwise
    wgrad  dW = dYᵀ · X     dY columnwise, X columnwise

Each GEMM is written as C [m, n] = A · Bᵀ over two operand storages whose reduction dimension is
contiguous: X and W rowwise for fprop; dY rowwise and W columnwise for dgrad; dY and X columnwise
for wgrad (a columnwise storage holds the transposed matrix, reduction dimension last).

The backend is chosen per pair of operand storages in one table, `BACKENDS`: Float8 × Float8 on
CUDA runs on the FP8 tensor cores (`torch._scaled_mm`); MXFP8 × MXFP8 on the bf16 tensor cores over
operands dequantized to bf16, which holds their values. Any other pair, and every pair on the CPU,
runs the emulated reference: each operand's direction dequantized to fp32 and the product taken
in fp32. The reference runs on any device and is what every fast backend is checked against.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch

from .tensor import QuantizedTensor


def operand(tensor: torch.Tensor, direction: str) -> torch.Tensor:
    """fp32 2-D values of one direction of a quantized operand, or of a plain one."""
    if isinstance(tensor, QuantizedTensor):
        return tensor.dequantize(torch.float32, direction).reshape(-1, tensor.shape[-1])
    return tensor.float().reshape(-1, tensor.shape[-1])


@contextlib.contextmanager
def _ieee_fp32():
    """Full fp32 products even where the caller allowed TF32 (set_float32_matmul_precision); the
    process-wide setting is touched only when it is not already "highest"."""
    previous = torch.get_float32_matmul_precision()
    if previous == "highest":
        yield
        return
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


def _finish(product: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The reference epilogue: fp32 bias add, one rounding to `out_dtype`."""
    if bias is not None:
        product = product + bias.float()
    return product.to(out_dtype)


# ---- fast backends ---------------------------------------------------------------------------------
def _float8_scaled_mm(a, b, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    """Float8 × Float8 on the FP8 tensor cores: A row-major, B column-major (the transpose of a
    storage whose reduction dimension is contiguous), one fp32 scale each; the bias add and the
    output cast happen in the GEMM's epilogue. None where `_scaled_mm` cannot take the shapes."""
    (m, k), (n, k_b) = a.data.shape, b.data.shape
    if k != k_b or m % 16 or n % 16 or k % 16 or not (a.data.is_contiguous() and b.data.is_contiguous()):
        return None
    if a.fp8_dtype == torch.float8_e5m2 and b.fp8_dtype == torch.float8_e5m2:
        return None  # no E5M2 × E5M2 tensor-core GEMM
    fused_bias = bias is not None and out_dtype in (torch.bfloat16, torch.float16) and bias.dtype == out_dtype
    product = torch._scaled_mm(
        a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, bias=bias if fused_bias else None, out_dtype=out_dtype
    )
    if bias is not None and not fused_bias:
        product = (product.float() + bias.float()).to(out_dtype) if out_dtype != torch.float32 else product + bias.float()
    return product


def _bf16_k_last(storage) -> torch.Tensor:
    """The bf16 values of one operand storage, reduction dimension last (a transposed view for a
    columnwise one: `dequantize_as` gives the [rows, cols] orientation in both directions)."""
    values = storage.dequantize_as(torch.bfloat16)
    return values if storage.direction == "rowwise" else values.t()


@contextlib.contextmanager
def _fp32_reductions():
    """cuBLAS sums bf16 products in fp32 even across split-K pieces (it may otherwise reduce those
    in bf16); the process-wide flag is touched only when it allows the reduced precision."""
    matmul = torch.backends.cuda.matmul
    if not matmul.allow_bf16_reduced_precision_reduction:
        yield
        return
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = True


def _dequantized_bf16_mm(a, b, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Operands whose values bf16 holds exactly (MXFP8: an E4M3 or E5M2 code times a power of two,
    exact unless below bf16's normal range, 2**-126) on the bf16 tensor cores: each dequantized to
    bf16 for this GEMM only, the products exact in fp32 and summed in fp32. A bf16 result without
    bias is rounded once by the GEMM itself; otherwise the reference epilogue follows."""
    a16, b16 = _bf16_k_last(a), _bf16_k_last(b)
    with _fp32_reductions():
        if bias is None and out_dtype == torch.bfloat16:
            return torch.mm(a16, b16.t())
        product = torch.mm(a16, b16.t(), out_dtype=torch.float32)
    return _finish(product, bias, out_dtype)


def _bf16_gemm_capable(device: torch.device) -> bool:
    return device.type == "cuda" and _capability(device.index) >= (8, 0)


def _fp8_gemm_capable(device: torch.device) -> bool:
    return device.type == "cuda" and _capability(device.index) >= (8, 9)


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


# (format of A's storage, format of B's storage) → (the device test, the backend).
BACKENDS: dict[tuple[str, str], tuple[Callable[[torch.device], bool], Callable]] = {
    ("float8", "float8"): (_fp8_gemm_capable, _float8_scaled_mm),
    ("mxfp8", "mxfp8"): (_bf16_gemm_capable, _dequantized_bf16_mm),
}

_backend_counts: dict[str, int] = {}


def backend_counts(reset: bool = False) -> dict[str, int]:
    """How many GEMMs each backend ran since the last reset ("reference" or a BACKENDS entry's name)."""
    counts = dict(_backend_counts)
    if reset:
        _backend_counts.clear()
    return counts


def _nt(a: torch.Tensor, a_direction: str, b: torch.Tensor, b_direction: str, bias, out_dtype) -> torch.Tensor:
    """C = A · Bᵀ, A and B each one direction of an operand whose reduction dimension is contiguous."""
    if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor) and not a.is_meta:
        a_storage, b_storage = a.storage_for(a_direction), b.storage_for(b_direction)
        entry = BACKENDS.get((a_storage.format_name, b_storage.format_name))
        if entry is not None and entry[0](a.device):
            product = entry[1](a_storage, b_storage, bias, out_dtype)
            if product is not None:
                name = entry[1].__name__.lstrip("_")
                _backend_counts[name] = _backend_counts.get(name, 0) + 1
                return product
    _backend_counts["reference"] = _backend_counts.get("reference", 0) + 1
    return _finish(_fp32_matmul(_k_last(a, a_direction), _k_last(b, b_direction).t()), bias, out_dtype)


def _k_last(tensor: torch.Tensor, direction: str) -> torch.Tensor:
    """fp32 values of an operand's direction, laid out with its reduction dimension last."""
    values = operand(tensor, direction)
    return values if direction == "rowwise" else values.t()


def fprop(x: torch.Tensor, weight: torch.Tensor, bias=None, out_dtype=torch.float32) -> torch.Tensor:
    """Y [M, N] = X [M, K] · W [N, K]ᵀ (+ bias), in `out_dtype`."""
    return _nt(x, "rowwise", weight, "rowwise", bias, out_dtype)


def dgrad(grad_output: torch.Tensor, weight: torch.Tensor, out_dtype=torch.float32) -> torch.Tensor:
    """dX [M, K] = dY [M, N] · W [N, K], in `out_dtype`."""
    return _nt(grad_output, "rowwise", weight, "columnwise", None, out_dtype)


def wgrad(grad_output: torch.Tensor, x: torch.Tensor, out_dtype=torch.float32) -> torch.Tensor:
    """dW [N, K] = dY [M, N]ᵀ · X [M, K], in `out_dtype`."""
    return _nt(grad_output, "columnwise", x, "columnwise", None, out_dtype)
