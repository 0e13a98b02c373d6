"""The Triton kernels as torch custom ops (`torch.library.custom_op`, namespace `qtensor`), each with
a fake implementation that gives its outputs' shapes and dtypes, so that under `torch.compile` the
compiled graph calls the kernels directly instead of tracing the pure-torch reference.

`WRAPPERS` maps a kernel-table name (qtensor/core/kernels.py) to a function with the eager kernel's
signature and return convention, built on the op: callers do not change. A custom op cannot return
None, so an absent direction travels as an empty tensor and comes back as None.

Covered: the casts and dequantizes of every format (Float8 with current and delayed scaling, MXFP8,
NVFP4, the hybrid), the amaxes, delayed scaling's scale and history update (an op that writes the
history in place, which the compiler functionalizes), and the GEMM epilogue.

A fake never repeats a kernel's arithmetic: a cast's outputs are shaped as the format's storage
layout declares them (the kernels allocate from the same declaration), and no output's shape
depends on a kernel's tile.
"""

from typing import Optional

import torch

from qtensor.formats.float8 import Float8Storage
from qtensor.formats.mxfp8 import MXFP8Storage
from qtensor.formats.nvfp4 import NVFP4Storage

from . import float8, gemm, hybrid, mxfp8, nvfp4

_NONE = (0,)
# The buffers of a direction that a cast kernel writes (NVFP4's global amax comes from elsewhere).
_CAST_BUFFERS = ("data", "scale_inv")


def _none(device, dtype=torch.uint8):
    return torch.empty(_NONE, dtype=dtype, device=device)


def _or_none(tensor):
    return None if tensor.shape == _NONE else tensor


def _pairs(outputs):
    """(row data, row scales, col data, col scales) → ((row pair) or None, (col pair) or None)."""
    row, col = outputs[:2], outputs[2:]
    return (None if _or_none(row[0]) is None else tuple(row)), (None if _or_none(col[0]) is None else tuple(col))


def _flat(pair, storage_class, direction, device, **options):
    """A direction's (data, scale_inv) as outputs of a custom op: the pair, or for an absent
    direction (0,)-shaped stand-ins of the dtypes the storage's layout declares."""
    if pair is not None:
        return tuple(pair)
    specs = {spec.name: spec for spec in storage_class.layout(direction, 0, 0, **options)}
    return tuple(_none(device, specs[name].dtype) for name in _CAST_BUFFERS)


def _fake_direction(storage_class, direction, present, x, **options):
    """The fake outputs of one direction of a cast of the 2-D `x` (see _flat)."""
    m, n = x.shape
    pair = storage_class.empty_buffers(_CAST_BUFFERS, direction, m, n, x.device, **options) if present else None
    return _flat(pair, storage_class, direction, x.device, **options)


# ---- amaxes -------------------------------------------------------------------------------------
@torch.library.custom_op("qtensor::finite_amax", mutates_args=())
def finite_amax_op(x: torch.Tensor) -> torch.Tensor:
    return float8.finite_amax(x).clone()


@finite_amax_op.register_fake
def _(x):
    return x.new_empty((), dtype=torch.float32)


# Always MAX_AMAX_PARTIALS partials (the programs past the end of `x` write 0): their count is
# then no function of the kernel's tile.
@torch.library.custom_op("qtensor::amax_partials", mutates_args=())
def amax_partials_op(x: torch.Tensor) -> torch.Tensor:
    return float8.amax_partials(x, programs=float8.MAX_AMAX_PARTIALS)


@amax_partials_op.register_fake
def _(x):
    return x.new_empty((float8.MAX_AMAX_PARTIALS,), dtype=torch.float32)


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


def _float8_fakes(x, fp8_dtype, rowwise, columnwise):
    """Fake (rowwise data or stand-in, columnwise data or stand-in, scale_inv) of a Float8 cast."""
    m, n = x.shape
    buffer = lambda direction, name: Float8Storage.empty_buffers((name,), direction, m, n, x.device, fp8_dtype=fp8_dtype)[0]
    row = buffer("rowwise", "data") if rowwise else _none(x.device, fp8_dtype)
    col = buffer("columnwise", "data") if columnwise else _none(x.device, fp8_dtype)
    return row, col, buffer("rowwise", "scale_inv")


@float8_cast_op.register_fake
def _(x, fp8_dtype, rowwise, columnwise, amax, amax_epsilon, force_pow_2_scales):
    return _float8_fakes(x, fp8_dtype, rowwise, columnwise)


# ---- Float8 (delayed scaling): the scale from the history, the cast at it, the history update ----
# With `amax_out`, the amax of what it cast (0-d): the kernel's partial amaxes, one per tile, reduced
# here, so that no output's shape depends on the tile.
@torch.library.custom_op("qtensor::float8_cast_at_scale", mutates_args=())
def float8_cast_at_scale_op(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool, scale: torch.Tensor, amax_out: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    row, col, scale_inv, partials = float8.cast(x, fp8_dtype, rowwise, columnwise, scale=scale, amax_out=amax_out)
    none = lambda: _none(x.device, fp8_dtype)
    return (row if row is not None else none()), (col if col is not None else none()), scale_inv, (
        partials.amax() if partials is not None else _none(x.device, torch.float32)
    )


@float8_cast_at_scale_op.register_fake
def _(x, fp8_dtype, rowwise, columnwise, scale, amax_out):
    return *_float8_fakes(x, fp8_dtype, rowwise, columnwise), x.new_empty(() if amax_out else _NONE, dtype=torch.float32)


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
    flat = lambda pair, direction: _flat(pair, MXFP8Storage, direction, x.device, fp8_dtype=fp8_dtype)
    return flat(row, "rowwise") + flat(col, "columnwise")


@mxfp8_cast_op.register_fake
def _(x, fp8_dtype, scale_rounding, rowwise, columnwise):
    fake = lambda direction, present: _fake_direction(MXFP8Storage, direction, present, x, fp8_dtype=fp8_dtype)
    return fake("rowwise", rowwise) + fake("columnwise", columnwise)


@torch.library.custom_op("qtensor::mxfp8_dequantize", mutates_args=())
def mxfp8_dequantize_op(data: torch.Tensor, codes: torch.Tensor, along_rows: bool, out_dtype: torch.dtype) -> torch.Tensor:
    return mxfp8.dequantize(data, codes, along_rows, out_dtype)


@mxfp8_dequantize_op.register_fake
def _(data, codes, along_rows, out_dtype):
    return data.new_empty(data.shape, dtype=out_dtype)


# ---- NVFP4 and the hybrid -----------------------------------------------------------------------
@torch.library.custom_op("qtensor::nvfp4_cast", mutates_args=())
def nvfp4_cast_op(
    x: torch.Tensor, global_amax: torch.Tensor, column_amax: torch.Tensor, keys: Optional[torch.Tensor],
    rowwise: bool, columnwise: bool, block_2d: bool, rht: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    row, col = nvfp4.cast(x, global_amax, column_amax, keys, rowwise, columnwise, block_2d, rht)
    flat = lambda pair, direction: _flat(pair, NVFP4Storage, direction, x.device, rht=rht, tile_scales=block_2d)
    return flat(row, "rowwise") + flat(col, "columnwise")


@nvfp4_cast_op.register_fake
def _(x, global_amax, column_amax, keys, rowwise, columnwise, block_2d, rht):
    fake = lambda direction, present: _fake_direction(NVFP4Storage, direction, present, x, rht=rht, tile_scales=block_2d)
    return fake("rowwise", rowwise) + fake("columnwise", columnwise)


@torch.library.custom_op("qtensor::nvfp4_dequantize", mutates_args=())
def nvfp4_dequantize_op(
    data: torch.Tensor, scale_inv: torch.Tensor, length: int, out_dtype: torch.dtype, global_amax: Optional[torch.Tensor], scale_rows: int
) -> torch.Tensor:
    return nvfp4.dequantize(data, scale_inv, length, out_dtype, global_amax, scale_rows=scale_rows)


@nvfp4_dequantize_op.register_fake
def _(data, scale_inv, length, out_dtype, global_amax, scale_rows):
    return data.new_empty((data.shape[0], length), dtype=out_dtype)


@torch.library.custom_op("qtensor::hybrid_cast", mutates_args=())
def hybrid_cast_op(
    x: torch.Tensor, fp8_dtype: torch.dtype, scale_rounding: str, column_amax: torch.Tensor, keys: Optional[torch.Tensor], block_2d: bool, rht: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    row, col = hybrid.cast(x, fp8_dtype, scale_rounding, column_amax, keys, block_2d, rht)
    return tuple(row) + tuple(col)


@hybrid_cast_op.register_fake
def _(x, fp8_dtype, scale_rounding, column_amax, keys, block_2d, rht):
    return _fake_direction(MXFP8Storage, "rowwise", True, x, fp8_dtype=fp8_dtype) + _fake_direction(NVFP4Storage, "columnwise", True, x, rht=rht, tile_scales=block_2d)


# ---- the GEMM epilogue --------------------------------------------------------------------------
@torch.library.custom_op("qtensor::scale_output", mutates_args=())
def scale_output_op(
    product: torch.Tensor, a_scale: torch.Tensor, a_amax_max: float, b_scale: Optional[torch.Tensor], b_amax_max: float,
    bias: Optional[torch.Tensor], out_dtype: torch.dtype,
) -> torch.Tensor:
    from qtensor.core.storage import TensorScale

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
    "nvfp4.dequantize": lambda data, scale_inv, length, out_dtype, global_amax=None, scale_rows=1: nvfp4_dequantize_op(
        data, scale_inv, length, out_dtype, global_amax, scale_rows
    ),
    "hybrid.cast": lambda x, fp8_dtype, scale_rounding, column_amax, keys, block_2d, rht: _pairs(
        hybrid_cast_op(x, fp8_dtype, scale_rounding, column_amax, keys, block_2d, rht)
    ),
    "gemm.scale_output": _scale_output,
    "gemm.scale_bias_output": _scale_output,
}
