"""C = A · Bᵀ over two operand storages whose reduction dimension is contiguous (`product_nt`), and
the backends that compute it: what every GEMM of a quantized layer reduces to (dense.py).

The backend is chosen by the operand forms the two storages declare, never by their format. A
storage offers each form through a method that returns None where it has none
(`Storage.block_scaled_operand`, `fp8_tensorwise_operand`, `bf16_operand`); `BACKENDS` lists the
fast backends in order, each naming the form it multiplies and the devices it runs on, and the
first whose form both storages offer, whose device test passes and which takes the shapes runs.
Today that gives, on CUDA: Float8 × Float8 on the FP8 tensor cores (`torch._scaled_mm`); every
other pair of Float8, MXFP8 and NVFP4 storages (hybrid children included) on the bf16 tensor cores
over operands dequantized to bf16, which holds their values, with the tensor scales applied to the
fp32 result; on Blackwell, MXFP8 and NVFP4 pairs first on the native block-scaled GEMM. Any other
pair, and every pair on the CPU, runs the emulated reference: each operand's direction dequantized
to fp32 and the product taken in fp32. The reference runs on any device and is what every fast
backend is checked against.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from ..core.kernels import is_fake, lookup
from ..core.tensor import QuantizedTensor


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
# Each takes the two operands' forms in a list it may empty (a bf16 form is as large as its operand
# and is freed before the epilogue), the bias, the output dtype and whether the caller allows the
# tensor cores' fast (reduced-precision) accumulation; None where it cannot take them.
def _fp8_pair_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `_scaled_mm` takes FP8 codes A [M, K] and B [N, K] (both with K contiguous): one K,
    every dimension a multiple of 16, and not both E5M2 (no E5M2 × E5M2 tensor-core GEMM)."""
    (m, k), (n, k_b) = a.shape, b.shape
    if k != k_b or m % 16 or n % 16 or k % 16 or not (a.is_contiguous() and b.is_contiguous()):
        return False
    return not (a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2)


def _float8_scaled_mm(forms: list, bias: torch.Tensor | None, out_dtype: torch.dtype, fast_accumulation: bool) -> torch.Tensor | None:
    """FP8 × FP8 with one scale per tensor (`Storage.fp8_tensorwise_operand`) on the FP8 tensor
    cores: A row-major, B column-major (the transpose of an operand whose reduction dimension is
    contiguous), one fp32 scale each; the bias add and the output cast happen in the GEMM's
    epilogue. With `fast_accumulation` the partial sums stay in the tensor cores' accumulator over
    all of K (docs/numerics.md, FP8 GEMMs), else they are promoted to fp32 chunk by chunk. None
    where `_scaled_mm` cannot take the shapes."""
    a, b = forms
    if not _fp8_pair_fits(a.data, b.data):
        return None
    fused_bias = bias is not None and out_dtype in (torch.bfloat16, torch.float16) and bias.dtype == out_dtype
    product = torch._scaled_mm(
        a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, bias=bias if fused_bias else None, out_dtype=out_dtype,
        use_fast_accum=fast_accumulation,
    )
    if bias is not None and not fused_bias:
        product = (product.float() + bias.float()).to(out_dtype) if out_dtype != torch.float32 else product + bias.float()
    return product


def _float8_block_scaled_mm(forms: list, bias: torch.Tensor | None, out_dtype: torch.dtype, fast_accumulation: bool) -> torch.Tensor | None:
    """FP8 × FP8 with fp32 scales per row or block (`Storage.fp8_block_operand`) on the FP8 tensor
    cores, the scales applied inside the GEMM: row-wise × row-wise (`torch._scaled_mm`'s row-wise
    scaling), and the 1x128 × 128x128, 128x128 × 1x128 and 1x128 × 1x128 pairs of Hopper's block
    scaling (cuBLAS 12.9+, sm_90). Any other pair (128x128 × 128x128, or a row-wise operand beside a
    block one), K not a multiple of 128 for blocks, or rows not multiples of 16, gives None: the
    reference runs it."""
    a, b = forms
    if not _fp8_pair_fits(a.data, b.data):
        return None
    if not _hopper_block_scaling(a.data.device):
        return None  # tested on Hopper only; cuBLAS takes these scalings on sm_90 with CUDA 12.9 and later
    product_dtype = torch.float32 if bias is not None else out_dtype
    if a.block_cols is None and b.block_cols is None:
        product = torch._scaled_mm(
            a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv.reshape(1, -1), out_dtype=product_dtype,
            use_fast_accum=fast_accumulation,
        )
    elif a.block_cols == b.block_cols == 128 and (a.block_rows, b.block_rows) != (128, 128) and a.data.shape[1] % 128 == 0:
        # Traced by torch.compile (or run on fake tensors for it), through a custom op: torch 2.11's
        # fake implementation of the block-scaled GEMM rejects the scales' shapes it is given (its
        # expected shape divides K by 128 in floating point), and the real GEMM needs no tracing into.
        gemm = hopper_block_scaled_mm if torch.compiler.is_compiling() or is_fake(a.data) else _hopper_block_scaled_mm
        product = gemm(a.data, a.scale_inv, a.block_rows, b.data, b.scale_inv, b.block_rows, product_dtype, fast_accumulation)
    else:
        return None
    return _finish(product, bias, out_dtype) if bias is not None else product


def _hopper_block_scaled_mm(
    a: torch.Tensor, a_scale_inv: torch.Tensor, a_block_rows: int, b: torch.Tensor, b_scale_inv: torch.Tensor, b_block_rows: int,
    out_dtype: torch.dtype, fast_accumulation: bool,
) -> torch.Tensor:
    """A · Bᵀ of two [rows, K] FP8 code tensors on Hopper's FP8 tensor cores, each with its stored
    block scales (`scale_inv`): 1x128 (`block_rows` 1) or 128x128 (128) blocks along K, put into the
    layouts cuBLAS reads here (`_hopper_block_scales`)."""
    return torch.nn.functional.scaled_mm(
        a.contiguous(), b.contiguous().t(), _hopper_block_scales(a_scale_inv, a_block_rows), _BLOCK_SCALING[a_block_rows](),
        _hopper_block_scales(b_scale_inv, b_block_rows), _BLOCK_SCALING[b_block_rows](),
        output_dtype=out_dtype, use_fast_accum=fast_accumulation,
    )


hopper_block_scaled_mm = torch.library.custom_op("qtensor::hopper_block_scaled_mm", mutates_args=())(_hopper_block_scaled_mm)


@hopper_block_scaled_mm.register_fake
def _(a, a_scale_inv, a_block_rows, b, b_scale_inv, b_block_rows, out_dtype, fast_accumulation):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _hopper_block_scaling(device: torch.device) -> bool:
    """sm_90 with a CUDA 12.9 or later build: where torch's scaled GEMMs take the row-wise scaling
    with an fp32 output and the 1x128 / 128x128 block scalings (torch raises elsewhere)."""
    return _capability(device.index) == (9, 0) and _cuda_version() >= (12, 9)


def _cuda_version() -> tuple[int, ...]:
    """The CUDA version torch was built with, (0, 0) for none."""
    return tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])


# Hopper's block scalings by the operand's block rows (its blocks are 128 wide along K).
_BLOCK_SCALING = {
    1: lambda: torch.nn.functional.ScalingType.BlockWise1x128,
    128: lambda: torch.nn.functional.ScalingType.BlockWise128x128,
}


def _hopper_block_scales(scales: torch.Tensor, block_rows: int) -> torch.Tensor:
    """An operand's block scales in the layout cuBLAS reads on Hopper: 1x128 scales [R, K/128] with
    the rows contiguous (column-major); 128x128 scales with K/128 padded to a multiple of 4 (zeros)
    and given as the transposed view [L4, R/128] of the row-major [R/128, L4]."""
    if block_rows == 1:
        return scales.t().contiguous().t()
    padding = -scales.shape[1] % 4
    if padding:
        scales = torch.nn.functional.pad(scales, (0, padding))
    return scales.t()


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


def _dequantized_bf16_mm(forms: list, bias: torch.Tensor | None, out_dtype: torch.dtype, fast_accumulation: bool) -> torch.Tensor | None:
    """Operands whose values bf16 holds exactly (`Storage.bf16_operand`), each dequantized to bf16
    for this GEMM only, on the bf16 tensor cores: the products are exact in fp32 and summed in
    fp32 (always: `fast_accumulation` is not used); the operands' tensor scales multiply the fp32
    result."""
    (a16, a_scale), (b16, b_scale) = forms
    forms.clear()  # the caller's only reference: `del` below then frees the bf16 operands
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
    return scaled_epilogue(product, a_scale, b_scale, bias, out_dtype)


def scaled_epilogue(product, a_scale, b_scale, bias, out_dtype) -> torch.Tensor:
    """The fp32 `product` times the operands' TensorScales (either may be None, not both), plus
    `bias`, rounded once to `out_dtype`."""
    kernel = lookup("gemm.scale_output" if bias is None else "gemm.scale_bias_output", product)
    if kernel is not None:  # the tensor scales are computed inside the epilogue: no extra launches
        return kernel(product, a_scale, b_scale, bias, out_dtype)
    return _scale_and_finish(product, _scale_value(a_scale, b_scale), bias, out_dtype)


def _scale_value(a_scale, b_scale) -> torch.Tensor:
    """The factor of two operands' TensorScales (either may be None, not both), as a 0-d fp32 tensor."""
    if a_scale is None:
        return b_scale.value()
    return a_scale.value() if b_scale is None else a_scale.value() * b_scale.value()


def _scale_and_finish(product, scale, bias, out_dtype) -> torch.Tensor:
    """The epilogue of operands with tensor scales: fp32 product times the scale, then `_finish`."""
    return _finish(product * scale, bias, out_dtype)


def _bf16_gemm_capable(device: torch.device) -> bool:
    return device.type == "cuda" and _capability(device.index) >= (8, 0)


def _fp8_gemm_capable(device: torch.device) -> bool:
    return device.type == "cuda" and _capability(device.index) >= (8, 9)


def _block_scaled_gemm_capable(device: torch.device) -> bool:
    """Blackwell (sm_100 and later): GEMMs with their block scales in the tensor cores."""
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


def _block_scaling(operand):
    """cuBLAS's scaling type of a block-scaled operand: blocks of 32 with E8M0 scales or of 16 with
    E4M3 scales; None for any other."""
    F = torch.nn.functional
    return {
        (32, torch.float8_e8m0fnu): F.ScalingType.BlockWise1x32,
        (16, torch.float8_e4m3fn): F.ScalingType.BlockWise1x16,
    }.get((operand.block_size, operand.scales.dtype))


def _block_scaled_mm(forms: list, bias: torch.Tensor | None, out_dtype: torch.dtype, fast_accumulation: bool) -> torch.Tensor | None:
    """Two operands of one block scaling (`Storage.block_scaled_operand`) on Blackwell's
    block-scaled tensor cores; their tensor scales multiply the fp32 result, as on the bf16 path.
    None where the shapes do not fit: K a multiple of 32, rows of 16."""
    a, b = forms
    scaling = _block_scaling(a)
    if scaling is None or scaling != _block_scaling(b) or a.length % 32 or b.length % 32 or a.data.shape[0] % 16 or b.data.shape[0] % 16:
        return None
    F = torch.nn.functional
    swizzled = lambda operand: swizzle_scales(operand.scales.view(torch.uint8)).view(operand.scales.dtype)
    scaled = a.tensor_scale is not None or b.tensor_scale is not None
    product = F.scaled_mm(
        a.data, b.data.t(), swizzled(a), scaling, swizzled(b), scaling,
        swizzle_a=F.SwizzleType.SWIZZLE_32_4_4, swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
        output_dtype=torch.float32 if scaled or bias is not None else out_dtype,
    )
    if scaled:
        return _scale_and_finish(product, _scale_value(a.tensor_scale, b.tensor_scale), bias, out_dtype)
    return _finish(product, bias, out_dtype) if bias is not None else product


# ---- choosing a backend ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Backend:
    """A fast GEMM. `operand` names the Storage method that gives the form it multiplies, which both
    storages must offer; `capable` tests the device; `gemm` computes the product (see the fast
    backends above) and may use reduced-precision accumulation only where it is allowed to.
    `exclusive`: a pair whose storages both offer the form runs here or on the reference, never on
    a later backend (its form is asked for even where the device fails the test, so it must be
    cheap: `Storage.fp8_tensorwise_operand`)."""

    name: str
    operand: str
    capable: Callable[[torch.device], bool]
    gemm: Callable[[list, torch.Tensor | None, torch.dtype, bool], torch.Tensor | None]
    exclusive: bool = False


# In order: the first that takes a pair runs it. The forms are disjoint today (Float8 offers the
# tensorwise one, MXFP8 and NVFP4 the block-scaled one, all three the bf16 one), so the order only
# says that the bf16 tensor cores come last.
BACKENDS: tuple[Backend, ...] = (
    Backend("block_scaled_mm", "block_scaled_operand", _block_scaled_gemm_capable, _block_scaled_mm),
    # FP8 × FP8 with tensor scales runs on the FP8 tensor cores or on the reference, never on a third path.
    Backend("float8_scaled_mm", "fp8_tensorwise_operand", _fp8_gemm_capable, _float8_scaled_mm, exclusive=True),
    # FP8 × FP8 with block scales: the FP8 tensor cores where cuBLAS takes the pair, else the reference.
    Backend("float8_block_scaled_mm", "fp8_block_operand", _fp8_gemm_capable, _float8_block_scaled_mm, exclusive=True),
    Backend("dequantized_bf16_mm", "bf16_operand", _bf16_gemm_capable, _dequantized_bf16_mm),
)


def _forms(method: str, a, b) -> list | None:
    """[A's form, B's form] by the Storage method `method`, or None where either storage has none
    (B is not asked when A has none)."""
    a_form = getattr(a, method)()
    if a_form is None:
        return None
    b_form = getattr(b, method)()
    return None if b_form is None else [a_form, b_form]


def _fast_product(a, b, device: torch.device, bias, out_dtype, fast_accumulation) -> tuple[str, torch.Tensor] | None:
    """(backend name, C) by the first backend of BACKENDS that takes storages `a` and `b`, or None."""
    if a.reduction_transform() != b.reduction_transform():
        return None  # the stored values lie in different domains: only the reference undoes a transform
    for backend in BACKENDS:
        capable = backend.capable(device)
        if not (capable or backend.exclusive):
            continue  # a form may cost a pass over its operand: asked for only where it can be used
        forms = _forms(backend.operand, a, b)
        if forms is None:
            continue
        product = backend.gemm(forms, bias, out_dtype, fast_accumulation) if capable else None
        if product is not None:
            return backend.name, product
        if backend.exclusive:
            return None
    return None


_backend_counts: dict[str, int] = {}
_backend_counts_lock = threading.Lock()


def backend_counts(reset: bool = False) -> dict[str, int]:
    """A diagnostic counter, process-wide: how many GEMMs each backend ran ("reference" or a
    BACKENDS entry's name) since the last reset, over all threads. For tests and profiling; nothing
    reads it to choose anything. Under torch.compile a GEMM counts when it is traced, not when the
    compiled graph runs."""
    with _backend_counts_lock:
        counts = dict(_backend_counts)
        if reset:
            _backend_counts.clear()
    return counts


def _count(name: str) -> None:
    if torch.compiler.is_compiling():  # traced by dynamo, which cannot trace a lock
        _backend_counts[name] = _backend_counts.get(name, 0) + 1
        return
    with _backend_counts_lock:
        _backend_counts[name] = _backend_counts.get(name, 0) + 1


def product_nt(a: torch.Tensor, a_direction: str, b: torch.Tensor, b_direction: str, bias, out_dtype, fast_accumulation=False) -> torch.Tensor:
    """C = A · Bᵀ, A and B each one direction of an operand whose reduction dimension is contiguous."""
    if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor):
        # The device from A's storage (a wrapper's .device / .is_meta would go through __torch_function__).
        a_storage = a.storage_for(a_direction)
        device = a_storage.device
        b_storage = b.storage_for(b_direction)
        fast = None if device.type == "meta" else _fast_product(
            a_storage.oriented(a_direction), b_storage.oriented(b_direction), device, bias, out_dtype, fast_accumulation
        )
        if fast is not None:
            name, product = fast
            _count(name)
            return product
    _count("reference")
    return _finish(_fp32_matmul(_k_last(a, a_direction), _k_last(b, b_direction).t()), bias, out_dtype)


def _k_last(tensor: torch.Tensor, direction: str) -> torch.Tensor:
    """fp32 values of an operand's direction, laid out with its reduction dimension last."""
    values = operand(tensor, direction)
    return values if direction == "rowwise" else values.t()
