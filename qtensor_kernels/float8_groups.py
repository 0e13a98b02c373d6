"""Triton kernels of the grouped Float8 casts (qtensor/formats/float8_groups.py), bit-identical to
their pure-torch references there:

- `column_amax(x, starts, lengths, rows)`: [G, K] finite amax of each column over each
  group of rows of `x` [R, K] (group g: rows starts[g] ... starts[g] + lengths[g] - 1; 0 for an
  empty group), and with `rows` each row's finite amax too, from the same read.
- `scales(amax, fp8_max, amax_epsilon, pow2)`: Float8's current scale of each amax, fp8_max /
  max(amax, amax_epsilon) (1 for 0, FLT_MAX on overflow, rounded down to a power of two with
  `pow2`), and its inverse, each division correctly rounded (numerics.exact_quotient): one launch
  where the reference takes a dozen small ones.
- `cast(x, scale, starts, lengths, padded_rows, fp8_dtype, row_out, col_out, col_bases, col_stride,
  row_scale)`: each group's rows cast at its per-column scales `scale[g, k]` (a tensor scale: one
  column broadcast), written transposed into `col_out` (group g's codes of column k at
  `col_out[k * col_stride + col_bases[g] + i]` for its row i, running on to a multiple of 16 rows,
  the grouped GEMM's alignment, with zero codes) and rowwise into `row_out` [R, K], at `row_scale`
  [R] (one scale per row) where it is given. Both copies from one read of `x`.

The cast: one program per (block of rows of one group's padded run, block of columns), the runs'
blocks one after another, each program finding its group from the lengths on the device.
"""

import torch
import triton
import triton.language as tl

from .float8 import _FP8_MAX, _codes, _finite_magnitude
from .launch import launch

_AMAX_TILE = (64, 64)  # rows per step, columns per program
_CAST_TILE = (64, 64)  # rows, columns per program (rows a multiple of 16: the padded copies)
ALIGN = 16
_FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _column_amax_kernel(
    x_ptr, starts_ptr, lengths_ptr, out_ptr, row_parts_ptr, K, stride_r, ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    group = tl.program_id(0)
    start, length = tl.load(starts_ptr + group), tl.load(lengths_ptr + group)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    top = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for first in range(0, length, BLOCK_R):
        local = first + tl.arange(0, BLOCK_R)
        rows = start + local.to(tl.int64)
        mask = (local[:, None] < length) & (cols[None, :] < K)
        magnitude = _finite_magnitude(tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32))
        top = tl.maximum(top, magnitude)
        if ROWS:  # this block of columns' part of each row's amax
            tl.store(row_parts_ptr + rows * tl.num_programs(1) + tl.program_id(1), tl.max(magnitude, axis=1), mask=local < length)
    tl.store(out_ptr + group.to(tl.int64) * K + cols, tl.max(top, axis=0), mask=cols < K)


def column_amax(x: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, rows: bool = False):
    """[G, K] fp32: the finite amax of each column of `x` [R, K] over each group's rows; with `rows`,
    also [R] the finite amax of each row (from the same read)."""
    groups, k = lengths.shape[0], x.shape[1]
    out = torch.empty((groups, k), dtype=torch.float32, device=x.device)
    block_r, block_k = _AMAX_TILE
    parts = torch.zeros((x.shape[0], triton.cdiv(k, block_k)), dtype=torch.float32, device=x.device) if rows else None
    if groups and k:
        launch(_column_amax_kernel, (groups, triton.cdiv(k, block_k)), x, starts, lengths, out, parts if rows else out, k, x.stride(0),
               ROWS=rows, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    return (out, parts.amax(dim=1)) if rows else out


@triton.jit
def _cast_kernel(
    x_ptr, scale_ptr, row_scale_ptr, starts_ptr, lengths_ptr, bases_ptr, row_ptr, col_ptr, G, K, stride_r, scale_stride_g, scale_stride_k,
    col_stride, FP8_MAX: tl.constexpr, E5M2: tl.constexpr, ROWWISE: tl.constexpr, ROW_SCALES: tl.constexpr, COLUMNWISE: tl.constexpr,
    ALIGN: tl.constexpr, G_POW2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Program (tile, column block): the tiles of BLOCK_R rows of every group's padded run, one
    # after another; each program finds its group from the lengths on the device (the host sends
    # a bound on the tiles, not the groups' sizes).
    tile = tl.program_id(0)
    ids = tl.arange(0, G_POW2)
    all_lengths = tl.load(lengths_ptr + ids, mask=ids < G, other=0)
    tiles = tl.where(ids < G, ((all_lengths + ALIGN - 1) // ALIGN * ALIGN + BLOCK_R - 1) // BLOCK_R, 0)
    tiles_through = tl.cumsum(tiles, 0)
    group = tl.sum((tiles_through <= tile).to(tl.int32), 0)
    if group >= G:
        return
    this = ids == group
    first = (tile - tl.sum(tl.where(this, tiles_through - tiles, 0), 0)) * BLOCK_R
    start, length = tl.load(starts_ptr + group), tl.sum(tl.where(this, all_lengths, 0), 0)
    padded = (length + ALIGN - 1) // ALIGN * ALIGN
    local = first + tl.arange(0, BLOCK_R)
    rows = start + local.to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = (local[:, None] < length) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + group.to(tl.int64) * scale_stride_g + cols * scale_stride_k, mask=cols < K, other=1.0)
    codes = _codes(x, scale[None, :], FP8_MAX, E5M2)  # 0.0 (code 0) on the padding rows
    if ROWWISE:
        if ROW_SCALES:  # the rowwise copy at each row's own scale
            row_scale = tl.load(row_scale_ptr + rows, mask=local < length, other=1.0)
            row_codes = _codes(x, row_scale[:, None], FP8_MAX, E5M2)
        else:
            row_codes = codes
        tl.store(row_ptr + rows[:, None] * K + cols[None, :], row_codes, mask=inside)
    if COLUMNWISE:
        base = tl.load(bases_ptr + group)
        target = col_ptr + cols[:, None] * col_stride + base + local[None, :].to(tl.int64)
        tl.store(target, tl.trans(codes), mask=(cols[:, None] < K) & (local[None, :] < padded))


def cast(x, scale, starts, lengths, padded_rows: int, fp8_dtype, row_out, col_out, col_bases, col_stride: int, row_scale=None) -> None:
    """Write the grouped codes of `x` [R, K] at `scale` ([G, K], strides any) into `row_out` (at
    `row_scale` [R] instead where given) and/or `col_out` (None: that copy is not written).
    `padded_rows`: the groups' padded runs together, or a bound on them (the host need not know
    the groups' sizes: the programs past the last run return)."""
    groups, k = lengths.shape[0], x.shape[1]
    block_r, block_k = _CAST_TILE
    if not groups or not k or padded_rows == 0 or (row_out is None and col_out is None):
        return
    grid = (triton.cdiv(padded_rows, block_r) + groups, triton.cdiv(k, block_k))
    row = row_out.view(torch.uint8) if row_out is not None else None
    col = col_out.view(torch.uint8) if col_out is not None else None
    launch(
        _cast_kernel, grid,
        x, scale, row_scale if row_scale is not None else scale, starts, lengths, col_bases if col_bases is not None else starts,
        row if row is not None else col, col if col is not None else row, groups, k, x.stride(0), scale.stride(0), scale.stride(1), col_stride,
        FP8_MAX=_FP8_MAX[fp8_dtype], E5M2=fp8_dtype == torch.float8_e5m2, ROWWISE=row is not None, ROW_SCALES=row_scale is not None,
        COLUMNWISE=col is not None, ALIGN=ALIGN, G_POW2=triton.next_power_of_2(groups), BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4,
    )


@triton.jit
def _scales_kernel(amax_ptr, scale_ptr, inverse_ptr, numel, fp8_max, epsilon, POW2: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    amax = tl.maximum(tl.load(amax_ptr + offsets, mask=mask, other=1.0), epsilon, propagate_nan=tl.PropagateNan.ALL)
    scale = tl.div_rn(tl.full((BLOCK,), fp8_max, tl.float32), amax)
    scale = tl.where(scale == float("inf"), _FLT_MAX, scale)
    scale = tl.where(amax == 0.0, 1.0, scale)
    if POW2:  # numerics.round_down_pow2: the mantissa bits cleared
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    tl.store(scale_ptr + offsets, scale, mask=mask)
    tl.store(inverse_ptr + offsets, tl.div_rn(tl.full((BLOCK,), 1.0, tl.float32), scale), mask=mask)


def scales(amax: torch.Tensor, fp8_max: float, amax_epsilon: float, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1/scale) of each fp32 amax (any shape), as numerics.current_scale and exact_quotient."""
    amax = amax.contiguous()
    scale, inverse = torch.empty_like(amax), torch.empty_like(amax)
    if amax.numel():
        block = 1024
        launch(_scales_kernel, (triton.cdiv(amax.numel(), block),), amax, scale, inverse, amax.numel(), float(fp8_max), float(amax_epsilon),
               POW2=pow2, BLOCK=block, num_warps=4)
    return scale, inverse


KERNELS = {"float8_groups.column_amax": column_amax, "float8_groups.cast": cast, "float8_groups.scales": scales}
