"""The three GEMMs of a linear layer (DESIGN.md §1), on quantized or plain operands.

    fprop  Y  = X · Wᵀ      X rowwise,  W rowwise
    dgrad  dX = dY · W      dY rowwise, W columnwise
    wgrad  dW = dYᵀ · X     dY columnwise, X columnwise

Each GEMM is written as C [m, n] = A · Bᵀ over two operand storages whose reduction dimension is
contiguous: X and W rowwise for fprop; dY rowwise and W columnwise for dgrad; dY and X columnwise
for wgrad (a columnwise storage holds the transposed matrix, reduction dimension last).

The backend is chosen per pair of operand storages in one table, `BACKENDS`. On CUDA: Float8 ×
Float8 runs on the FP8 tensor cores (`torch._scaled_mm`); every other pair of Float8, MXFP8 and
NVFP4 storages (hybrid children included) on the bf16 tensor cores over operands dequantized to
bf16, which holds their values, with the tensor scales applied to the fp32 result; on Blackwell,
MXFP8 and NVFP4 pairs go first to the native block-scaled GEMM. Any other pair, and every pair on
the CPU, runs the emulated reference: each operand's direction dequantized to fp32 and the product
taken in fp32. The reference runs on any device and is what every fast backend is checked against.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch

from .kernels import lookup
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


def _dequantized_bf16_mm(a, b, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    """Operands whose values bf16 holds exactly, on the bf16 tensor cores (`Storage.bf16_operand`):
    MXFP8 (an E4M3 or E5M2 code times a power of two, exact unless below bf16's normal range,
    2**-126), NVFP4 (an E2M1 code times its E4M3 block scale) and Float8 (the codes), each
    dequantized to bf16 for this GEMM only. The products are exact in fp32 and summed in fp32; the
    tensor scales of NVFP4 and Float8 multiply the fp32 result. None where the two operands do not
    meet in one domain (one NVFP4 copy carries the Hadamard transform and the other does not)."""
    if _transformed(a) != _transformed(b):
        return None
    (a16, a_scale), (b16, b_scale) = a.bf16_operand(), b.bf16_operand()
    if a16.shape[1] != b16.shape[1]:
        return None
    plain_bf16 = a_scale is None and b_scale is None and bias is None and out_dtype == torch.bfloat16
    with _fp32_reductions():
        if plain_bf16:  # rounded once, by the GEMM itself
            return torch.mm(a16, b16.t())
        product = torch.mm(a16, b16.t(), out_dtype=torch.float32)
    del a16, b16  # the bf16 operands live for the GEMM only
    if a_scale is None and b_scale is None:
        return _finish(product, bias, out_dtype)
    kernel = lookup("gemm.scale_output", product)
    if kernel is not None:  # the tensor scales are computed inside the epilogue: no extra launches
        return kernel(product, a_scale, b_scale, bias, out_dtype)
    scale = b_scale.value() if a_scale is None else (a_scale.value() if b_scale is None else a_scale.value() * b_scale.value())
    return _scale_and_finish(product, scale, bias, out_dtype)


def _scale_and_finish(product, scale, bias, out_dtype) -> torch.Tensor:
    """The epilogue of operands with tensor scales: fp32 product times the scale, then `_finish`."""
    return _finish(product * scale, bias, out_dtype)


def _transformed(storage) -> bool:
    """True for an NVFP4 columnwise copy held in the Hadamard-transformed domain."""
    return storage.direction == "columnwise" and getattr(storage, "rht", False)


def _bf16_gemm_capable(device: torch.device) -> bool:
    return device.type == "cuda" and _capability(device.index) >= (8, 0)


def _fp8_gemm_capable(device: torch.device) -> bool:
    return device.type == "cuda" and _capability(device.index) >= (8, 9)


def _block_scaled_gemm_capable(device: torch.device) -> bool:
    """Blackwell (sm_100 and later): MXFP8 and NVFP4 GEMMs with their block scales in the tensor cores."""
    return device.type == "cuda" and _capability(device.index) >= (10, 0)


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


# ---- Blackwell: native block-scaled GEMMs ---------------------------------------------------------
# Planned for sm_100 and gated by capability; it cannot run on the Hopper machines qtensor is
# tested on, where these pairs take the bf16 tensor cores. cuBLAS reads the block scales in its
# 128x4 tiled layout (`swizzle_scales`, tested on the CPU against the layout's index formula) and
# both operands with the reduction dimension contiguous, A row-major and B column-major.
def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Block scales [R, C] (one per row and block of the reduction dimension) in cuBLAS's tiled
    layout: zero-padded to [128·ceil(R/128), 4·ceil(C/4)] and cut into 128x4 tiles, stored tile
    after tile (row-major over tiles); inside a tile, the scale of row 32·i + j, column c sits at
    16·j + 4·i + c. Returned flat."""
    rows, cols = scales.shape
    padded = scales.new_zeros((-(-rows // 128) * 128, -(-cols // 4) * 4))
    padded[:rows, :cols] = scales
    tiles = padded.reshape(padded.shape[0] // 128, 4, 32, padded.shape[1] // 4, 4)  # [row tile, i, j, col tile, c]
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1)  # [row tile, col tile, j, i, c]


def _native_block_operand(storage):
    """(data [R, K] or packed [R, K/2] row-major, swizzled scales, recipe, tensor scale or None) of an
    MXFP8 or NVFP4 storage, reduction dimension contiguous; None where the shapes do not fit."""
    F = torch.nn.functional
    if storage.format_name == "mxfp8":
        data, scales = storage.data, storage.scale_inv
        if storage.direction == "columnwise":  # MXFP8 keeps [rows, cols] in both directions
            data, scales = data.t().contiguous(), scales.t().contiguous()
        if data.shape[1] % 32:
            return None
        return data, swizzle_scales(scales).view(torch.float8_e8m0fnu), F.ScalingType.BlockWise1x32, None
    if _transformed(storage) or storage.stored_length() % 32:
        return None
    data = storage.data.view(torch.float4_e2m1fn_x2)
    scales = swizzle_scales(storage.scale_inv.view(torch.uint8)).view(torch.float8_e4m3fn)
    return data, scales, F.ScalingType.BlockWise1x16, storage.tensor_scale_inv()


def _block_scaled_mm(a, b, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    """MXFP8 × MXFP8 or NVFP4 × NVFP4 on Blackwell's block-scaled tensor cores; NVFP4's tensor
    scales multiply the fp32 result, as on the bf16 path. None where the shapes do not fit."""
    a_op, b_op = _native_block_operand(a), _native_block_operand(b)
    if a_op is None or b_op is None or a_op[2] != b_op[2] or a_op[0].shape[0] % 16 or b_op[0].shape[0] % 16:
        return None
    scaled = a_op[3] is not None
    product = torch.nn.functional.scaled_mm(
        a_op[0], b_op[0].t(), a_op[1], a_op[2], b_op[1], b_op[2],
        swizzle_a=torch.nn.functional.SwizzleType.SWIZZLE_32_4_4, swizzle_b=torch.nn.functional.SwizzleType.SWIZZLE_32_4_4,
        output_dtype=torch.float32 if scaled or bias is not None else out_dtype,
    )
    if scaled:
        return _scale_and_finish(product, a_op[3] * b_op[3], bias, out_dtype)
    return _finish(product, bias, out_dtype) if bias is not None else product


# (format of A's storage, format of B's storage) → the backends to try, in order, each with its
# device test; the first that takes the operands runs. Float8 × Float8 runs on the FP8 tensor cores;
# every pair of the three formats, hybrid children included (MXFP8 forward × NVFP4 backward), on
# the bf16 tensor cores; MXFP8 and NVFP4 pairs first on Blackwell's block-scaled ones.
_BF16_EXACT_FORMATS = ("float8", "mxfp8", "nvfp4")
Backend = tuple[Callable[[torch.device], bool], Callable]
BACKENDS: dict[tuple[str, str], tuple[Backend, ...]] = {
    (a, b): ((_bf16_gemm_capable, _dequantized_bf16_mm),) for a in _BF16_EXACT_FORMATS for b in _BF16_EXACT_FORMATS
}
BACKENDS[("float8", "float8")] = ((_fp8_gemm_capable, _float8_scaled_mm),)
for _format in ("mxfp8", "nvfp4"):
    BACKENDS[(_format, _format)] = ((_block_scaled_gemm_capable, _block_scaled_mm),) + BACKENDS[(_format, _format)]

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
        for capable, backend in BACKENDS.get((a_storage.format_name, b_storage.format_name), ()):
            product = backend(a_storage, b_storage, bias, out_dtype) if capable(a.device) else None
            if product is not None:
                name = backend.__name__.lstrip("_")
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
