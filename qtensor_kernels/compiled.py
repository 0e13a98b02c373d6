"""The Triton kernels as torch custom ops (`torch.library.custom_op`, namespace `qtensor`), each with
a fake implementation that gives its outputs' shapes and dtypes, so that under `torch.compile` the
compiled graph calls the kernels directly instead of tracing the pure-torch reference.

`WRAPPERS` maps a kernel-table name (qtensor/kernels.py) to a function with the eager kernel's
signature and return convention, built on the op: callers do not change. A custom op cannot return
None, so an absent direction travels as an empty tensor and comes back as None.

Covered: the casts and dequantizes of every format (Float8 with current and delayed scaling, MXFP8,
NVFP4, the hybrid), the amaxes, delayed scaling's scale and history update (an op that writes the
history in place, which the compiler functionalizes), and the GEMM epilogue.
"""

from typing import Optional

import torch
import triton

from . import float8, gemm, hybrid, mxfp8, nvfp4

_NONE = (0,)


def _none(device, dtype=torch.uint8):
    return torch.empty(_NONE, dtype=dtype, device=device)


def _or_none(tensor):
    return None if tensor.shape == _NONE else tensor


def _pairs(outputs):
    """(row data, row scales, col data, col scales) → ((row pair) or None, (col pair) or None)."""
    row, col = outputs[:2], outputs[2:]
    return (None if _or_none(row[0]) is None else tuple(row)), (None if _or_none(col[0]) is None else tuple(col))


def _flat(pair, device, dtypes):
    return tuple(pair) if pair is not None else tuple(_none(device, d) for d in dtypes)


# ---- amaxes -------------------------------------------------------------------------------------
@torch.library.custom_op("qtensor::finite_amax", mutates_args=())
def finite_amax_op(x: torch.Tensor) -> torch.Tensor:
    return float8.finite_amax(x).clone()


@finite_amax_op.register_fake
def _(x):
    return x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("qtensor::amax_partials", mutates_args=())
def amax_partials_op(x: torch.Tensor) -> torch.Tensor:
    return float8.amax_partials(x)


@amax_partials_op.register_fake
def _(x):
    programs = min(1024, triton.next_power_of_2(max(triton.cdiv(x.numel(), 2 * float8._AMAX_BLOCK), 1)))
    return x.new_empty((programs,), dtype=torch.float32)


@torch.library.custom_op("qtensor::nvfp4_amaxes", mutates_args=())
def nvfp4_amaxes_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    plain, transformed = nvfp4.amaxes(x)
    return plain.clone(), transformed.clone()


@nvfp4_amaxes_op.register_fake
def _(x):
    return x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.float32)


# ---- Float8 (current scaling) -------------------------------------------------------------------
@torch.library.custom_op("qtensor::float8_cast", mutates_args=())
def float8_cast_op(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool, amax: torch.Tensor, amax_epsilon: float, force_pow_2_scales: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    row, col, scale_inv, _ = float8.cast(x, fp8_dtype, rowwise, columnwise, amax=amax, amax_epsilon=amax_epsilon, force_pow_2_scales=force_pow_2_scales)
    return (row if row is not None else _none(x.device, fp8_dtype)), (col if col is not None else _none(x.device, fp8_dtype)), scale_inv


@float8_cast_op.register_fake
def _(x, fp8_dtype, rowwise, columnwise, amax, amax_epsilon, force_pow_2_scales):
    m, n = x.shape
    row = x.new_empty((m, n) if rowwise else _NONE, dtype=fp8_dtype)
    col = x.new_empty((n, m) if columnwise else _NONE, dtype=fp8_dtype)
    return row, col, x.new_empty((), dtype=torch.float32)


# ---- Float8 (delayed scaling): the scale from the history, the cast at it, the history update ----
@torch.library.custom_op("qtensor::float8_cast_at_scale", mutates_args=())
def float8_cast_at_scale_op(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool, scale: torch.Tensor, amax_out: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    row, col, scale_inv, partials = float8.cast(x, fp8_dtype, rowwise, columnwise, scale=scale, amax_out=amax_out)
    none = lambda: _none(x.device, fp8_dtype)
    return (row if row is not None else none()), (col if col is not None else none()), scale_inv, (
        partials if partials is not None else _none(x.device, torch.float32)
    )


@float8_cast_at_scale_op.register_fake
def _(x, fp8_dtype, rowwise, columnwise, scale, amax_out):
    m, n = x.shape
    row = x.new_empty((m, n) if rowwise else _NONE, dtype=fp8_dtype)
    col = x.new_empty((n, m) if columnwise else _NONE, dtype=fp8_dtype)
    block_m, block_n, _ = float8._CAST_TILE[4 if m % 4 == 0 else 1]
    parts = max(triton.cdiv(m, block_m), 1) * max(triton.cdiv(n, block_n), 1)
    return row, col, x.new_empty((), dtype=torch.float32), x.new_empty((parts,) if amax_out else _NONE, dtype=torch.float32)


@torch.library.custom_op("qtensor::float8_delayed_scale", mutates_args=())
def float8_delayed_scale_op(
    history: torch.Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, force_pow_2_scales: bool, margin: int, most_recent: bool
) -> torch.Tensor:
    return float8.delayed_scale(history, fp8_dtype, amax_epsilon, force_pow_2_scales, margin, most_recent)


@float8_delayed_scale_op.register_fake
def _(history, fp8_dtype, amax_epsilon, force_pow_2_scales, margin, most_recent):
    return history.new_empty((), dtype=torch.float32)


@torch.library.custom_op("qtensor::float8_record_amax", mutates_args=("history",))
def float8_record_amax_op(history: torch.Tensor, partials: torch.Tensor) -> None:
    float8.record_amax(history, partials)


@float8_record_amax_op.register_fake
def _(history, partials):
    return None


def _float8_cast(x, fp8_dtype, rowwise, columnwise, *, scale=None, amax=None, amax_epsilon=0.0, force_pow_2_scales=False, amax_out=False):
    if scale is not None:
        row, col, scale_inv, partials = float8_cast_at_scale_op(x, fp8_dtype, rowwise, columnwise, scale, amax_out)
        return (row if rowwise else None), (col if columnwise else None), scale_inv, (partials if amax_out else None)
    if amax_out:
        raise ValueError("qtensor: the Float8 cast reports its amax only when cast at a given scale (delayed scaling).")
    row, col, scale_inv = float8_cast_op(x, fp8_dtype, rowwise, columnwise, amax, float(amax_epsilon), force_pow_2_scales)
    return (row if rowwise else None), (col if columnwise else None), scale_inv, None


def _float8_delayed_scale(history, fp8_dtype, *, amax_epsilon, force_pow_2_scales, margin, most_recent):
    return float8_delayed_scale_op(history, fp8_dtype, float(amax_epsilon), force_pow_2_scales, margin, most_recent)


@torch.library.custom_op("qtensor::float8_dequantize", mutates_args=())
def float8_dequantize_op(data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return float8.dequantize(data, scale_inv, out_dtype)


@float8_dequantize_op.register_fake
def _(data, scale_inv, out_dtype):
    return data.new_empty(data.shape, dtype=out_dtype)


# ---- MXFP8 --------------------------------------------------------------------------------------
@torch.library.custom_op("qtensor::mxfp8_cast", mutates_args=())
def mxfp8_cast_op(
    x: torch.Tensor, fp8_dtype: torch.dtype, scale_rounding: str, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    row, col = mxfp8.cast(x, fp8_dtype, scale_rounding, rowwise, columnwise)
    return _flat(row, x.device, (fp8_dtype, torch.uint8)) + _flat(col, x.device, (fp8_dtype, torch.uint8))


@mxfp8_cast_op.register_fake
def _(x, fp8_dtype, scale_rounding, rowwise, columnwise):
    m, n = x.shape
    row = (x.new_empty((m, n), dtype=fp8_dtype), x.new_empty((m, triton.cdiv(n, 32)), dtype=torch.uint8)) if rowwise else None
    col = (x.new_empty((m, n), dtype=fp8_dtype), x.new_empty((triton.cdiv(m, 32), n), dtype=torch.uint8)) if columnwise else None
    return _flat(row, x.device, (fp8_dtype, torch.uint8)) + _flat(col, x.device, (fp8_dtype, torch.uint8))


@torch.library.custom_op("qtensor::mxfp8_dequantize", mutates_args=())
def mxfp8_dequantize_op(data: torch.Tensor, codes: torch.Tensor, along_rows: bool, out_dtype: torch.dtype) -> torch.Tensor:
    return mxfp8.dequantize(data, codes, along_rows, out_dtype)


@mxfp8_dequantize_op.register_fake
def _(data, codes, along_rows, out_dtype):
    return data.new_empty(data.shape, dtype=out_dtype)


# ---- NVFP4 and the hybrid -----------------------------------------------------------------------
_NV = (torch.uint8, torch.float8_e4m3fn)


def _nv_shapes(x, rowwise, columnwise, rht):
    m, n = x.shape
    length = -(-m // 16) * 16 if rht else m
    row = (x.new_empty((m, -(-n // 2)), dtype=torch.uint8), x.new_empty((m, -(-n // 16)), dtype=torch.float8_e4m3fn)) if rowwise else None
    col = (x.new_empty((n, -(-length // 2)), dtype=torch.uint8), x.new_empty((n, -(-m // 16)), dtype=torch.float8_e4m3fn)) if columnwise else None
    return row, col


@torch.library.custom_op("qtensor::nvfp4_cast", mutates_args=())
def nvfp4_cast_op(
    x: torch.Tensor, global_amax: torch.Tensor, column_amax: torch.Tensor, keys: Optional[torch.Tensor],
    rowwise: bool, columnwise: bool, block_2d: bool, rht: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    row, col = nvfp4.cast(x, global_amax, column_amax, keys, rowwise, columnwise, block_2d, rht)
    return _flat(row, x.device, _NV) + _flat(col, x.device, _NV)


@nvfp4_cast_op.register_fake
def _(x, global_amax, column_amax, keys, rowwise, columnwise, block_2d, rht):
    row, col = _nv_shapes(x, rowwise, columnwise, rht)
    return _flat(row, x.device, _NV) + _flat(col, x.device, _NV)


@torch.library.custom_op("qtensor::nvfp4_dequantize", mutates_args=())
def nvfp4_dequantize_op(data: torch.Tensor, scale_inv: torch.Tensor, length: int, out_dtype: torch.dtype, global_amax: Optional[torch.Tensor]) -> torch.Tensor:
    return nvfp4.dequantize(data, scale_inv, length, out_dtype, global_amax)


@nvfp4_dequantize_op.register_fake
def _(data, scale_inv, length, out_dtype, global_amax):
    return data.new_empty((data.shape[0], length), dtype=out_dtype)


@torch.library.custom_op("qtensor::hybrid_cast", mutates_args=())
def hybrid_cast_op(
    x: torch.Tensor, fp8_dtype: torch.dtype, scale_rounding: str, column_amax: torch.Tensor, keys: Optional[torch.Tensor], block_2d: bool, rht: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    row, col = hybrid.cast(x, fp8_dtype, scale_rounding, column_amax, keys, block_2d, rht)
    return tuple(row) + tuple(col)


@hybrid_cast_op.register_fake
def _(x, fp8_dtype, scale_rounding, column_amax, keys, block_2d, rht):
    m, n = x.shape
    _, col = _nv_shapes(x, False, True, rht)
    return (x.new_empty((m, n), dtype=fp8_dtype), x.new_empty((m, triton.cdiv(n, 32)), dtype=torch.uint8)) + col


# ---- the GEMM epilogue --------------------------------------------------------------------------
@torch.library.custom_op("qtensor::scale_output", mutates_args=())
def scale_output_op(
    product: torch.Tensor, a_scale: torch.Tensor, a_amax_max: float, b_scale: Optional[torch.Tensor], b_amax_max: float,
    bias: Optional[torch.Tensor], out_dtype: torch.dtype,
) -> torch.Tensor:
    from qtensor.storage import TensorScale

    b = None if b_scale is None else TensorScale(b_scale, b_amax_max or None)
    return gemm.scale_output(product, TensorScale(a_scale, a_amax_max or None), b, bias, out_dtype)


@scale_output_op.register_fake
def _(product, a_scale, a_amax_max, b_scale, b_amax_max, bias, out_dtype):
    return product.new_empty(product.shape, dtype=out_dtype)


def _scale_output(product, a_scale, b_scale, bias, out_dtype):
    if a_scale is None:
        a_scale, b_scale = b_scale, None
    return scale_output_op(
        product, a_scale.tensor, a_scale.amax_max or 0.0, None if b_scale is None else b_scale.tensor,
        0.0 if b_scale is None else (b_scale.amax_max or 0.0), bias, out_dtype,
    )


WRAPPERS = {
    "finite_amax": finite_amax_op,
    "float8.amax_partials": amax_partials_op,
    "float8.cast": _float8_cast,
    "float8.delayed_scale": _float8_delayed_scale,
    "float8.record_amax": float8_record_amax_op,
    "float8.dequantize": float8_dequantize_op,
    "mxfp8.cast": lambda x, fp8_dtype, scale_rounding, rowwise, columnwise: _pairs(mxfp8_cast_op(x, fp8_dtype, scale_rounding, rowwise, columnwise)),
    "mxfp8.dequantize": mxfp8_dequantize_op,
    "nvfp4.cast": lambda x, global_amax, column_amax, keys, rowwise, columnwise, block_2d, rht: _pairs(
        nvfp4_cast_op(x, global_amax, column_amax, keys, rowwise, columnwise, block_2d, rht)
    ),
    "nvfp4.amaxes": nvfp4_amaxes_op,
    "nvfp4.dequantize": lambda data, scale_inv, length, out_dtype, global_amax=None: nvfp4_dequantize_op(data, scale_inv, length, out_dtype, global_amax),
    "hybrid.cast": lambda x, fp8_dtype, scale_rounding, column_amax, keys, block_2d, rht: _pairs(
        hybrid_cast_op(x, fp8_dtype, scale_rounding, column_amax, keys, block_2d, rht)
    ),
    "gemm.scale_output": _scale_output,
}
