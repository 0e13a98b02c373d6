"""Triton kernel of FP8 with block scales, bit-identical to the pure-torch reference in
qtensor/formats/float8_block.py (docs/numerics.md, Float8 with block scales).

`cast(x, fp8_dtype, block_rows, block_cols, ...)`: one read of each tile of `x` writes both copies.
- **Blocks** (1x128, 128x128): each 128x128 tile holds whole blocks of both copies, and the kernel
  finds their amaxes in the tile:
  - 1x128: each row's 128 values for the rowwise copy, each column's 128 for the columnwise one;
  - 128x128: the whole tile for both.
- **Row-wise** (`block_cols=None`): a scale spans a whole row or column, so two small kernels run
  first: one read of `x` gives each row's and column's amax per 128x128 tile, and a second kernel
  takes each row's and column's scale from those (a sharded tensor reduces its column amaxes over
  its ranks in between). The cast kernel then multiplies and rounds.

The columnwise codes are stored transposed, `[N, M]`, the layout the FP8 GEMMs read.
"""

import torch
import triton
import triton.language as tl

from qtensor.formats.float8_block import Float8BlockStorage
from .float8 import _codes, _finite_magnitude, _like, _scale_from_amax
from .launch import launch

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
VECTOR, TILE, GIVEN = 0, 1, 2  # the kernel's modes: 1x128 blocks, 128x128 tiles, scales given per row and column
WARPS = {VECTOR: 8, TILE: 8, GIVEN: 8}  # the cast kernel's warps per 128x128 tile, by mode (benchmarks/sweep_cast.py)


@triton.jit
def _cast_kernel(
    x_ptr, row_ptr, row_scale_inv_ptr, col_ptr, col_scale_inv_ptr, row_scale_ptr, col_scale_ptr,
    M, N, stride_m, epsilon,
    FP8_MAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr, MODE: tl.constexpr,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside_m, inside_n = offs_m < M, offs_n < N
    mask = inside_m[:, None] & inside_n[None, :]
    # Partial blocks behave as zero-padded (docs/numerics.md, Float8 with block scales).
    x = tl.load(x_ptr + offs_m[:, None] * stride_m + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if MODE == 0:  # 1x128: a scale per row of the tile (rowwise), per column (columnwise)
        magnitude = _finite_magnitude(x)
        if ROWWISE:
            scale = _scale_from_amax(tl.max(magnitude, axis=1), epsilon, FP8_MAX, 1.0, POW2)
            tl.store(row_ptr + offs_m[:, None] * N + offs_n[None, :], _codes(x, scale[:, None], FP8_MAX, E5M2), mask=mask)
            tl.store(row_scale_inv_ptr + offs_m * tl.cdiv(N, BLOCK_N) + pid_n, tl.div_rn(_like(1.0, scale), scale), mask=inside_m)
        if COLUMNWISE:
            scale = _scale_from_amax(tl.max(magnitude, axis=0), epsilon, FP8_MAX, 1.0, POW2)
            codes = _codes(x, scale[None, :], FP8_MAX, E5M2)
            tl.store(col_ptr + offs_n[:, None] * M + offs_m[None, :], tl.trans(codes), mask=tl.trans(mask))
            tl.store(col_scale_inv_ptr + offs_n * tl.cdiv(M, BLOCK_M) + pid_m, tl.div_rn(_like(1.0, scale), scale), mask=inside_n)
    elif MODE == 1:  # 128x128: one scale for the tile, the same codes in both copies
        scale = _scale_from_amax(tl.max(tl.max(_finite_magnitude(x), axis=1), axis=0), epsilon, FP8_MAX, 1.0, POW2)
        codes = _codes(x, scale, FP8_MAX, E5M2)
        scale_inv = tl.div_rn(_like(1.0, scale), scale)
        if ROWWISE:
            tl.store(row_ptr + offs_m[:, None] * N + offs_n[None, :], codes, mask=mask)
            tl.store(row_scale_inv_ptr + pid_m * tl.cdiv(N, BLOCK_N) + pid_n, scale_inv)
        if COLUMNWISE:
            tl.store(col_ptr + offs_n[:, None] * M + offs_m[None, :], tl.trans(codes), mask=tl.trans(mask))
            tl.store(col_scale_inv_ptr + pid_n * tl.cdiv(M, BLOCK_M) + pid_m, scale_inv)
    else:  # row-wise: the scales of each row and column, given
        if ROWWISE:
            scale = tl.load(row_scale_ptr + offs_m, mask=inside_m, other=1.0)
            tl.store(row_ptr + offs_m[:, None] * N + offs_n[None, :], _codes(x, scale[:, None], FP8_MAX, E5M2), mask=mask)
        if COLUMNWISE:
            scale = tl.load(col_scale_ptr + offs_n, mask=inside_n, other=1.0)
            codes = _codes(x, scale[None, :], FP8_MAX, E5M2)
            tl.store(col_ptr + offs_n[:, None] * M + offs_m[None, :], tl.trans(codes), mask=tl.trans(mask))


@triton.jit
def _amax_kernel(x_ptr, row_part_ptr, col_part_ptr, M, N, stride_m, ROWS: tl.constexpr, COLUMNS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Each tile's finite amax of each of its rows (row_part [M, tiles along N]) and of each of its
    columns (col_part [tiles along M, N])."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside_m, inside_n = offs_m < M, offs_n < N
    x = tl.load(x_ptr + offs_m[:, None] * stride_m + offs_n[None, :], mask=inside_m[:, None] & inside_n[None, :], other=0.0)
    magnitude = _finite_magnitude(x.to(tl.float32))
    if ROWS:
        tl.store(row_part_ptr + offs_m * tl.num_programs(1) + pid_n, tl.max(magnitude, axis=1), mask=inside_m)
    if COLUMNS:
        tl.store(col_part_ptr + pid_m * N + offs_n, tl.max(magnitude, axis=0), mask=inside_n)


@triton.jit
def _scales_kernel(part_ptr, scale_ptr, scale_inv_ptr, L, PARTS, stride_l, stride_p, epsilon,
                   FP8_MAX: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr):
    """The scale (and its fp32 inverse) of each of L rows or columns, from its PARTS partial amaxes
    (`part_ptr[l * stride_l + p * stride_p]`): formats.float8_block.block_scales of their max."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < L
    amax = tl.zeros([BLOCK], dtype=tl.float32)  # finite magnitudes: max from 0 (no parts: amax 0, scale 1)
    for p in range(0, PARTS):
        amax = tl.maximum(amax, tl.load(part_ptr + offs * stride_l + p * stride_p, mask=inside, other=0.0))
    scale = _scale_from_amax(amax, epsilon, FP8_MAX, 1.0, POW2)
    tl.store(scale_ptr + offs, scale, mask=inside)
    tl.store(scale_inv_ptr + offs, tl.div_rn(_like(1.0, scale), scale), mask=inside)


def _amax_partials(x: torch.Tensor, rows: bool, columns: bool):
    """(each row's finite amax in each 128-column tile [M, tiles] or None, each column's in each
    128-row tile [tiles, N] or None) of the 2-D `x`, from one read."""
    M, N = x.shape
    grid = (triton.cdiv(M, 128), triton.cdiv(N, 128))
    row_part = torch.empty((M, grid[1]), dtype=torch.float32, device=x.device) if rows else None
    col_part = torch.empty((grid[0], N), dtype=torch.float32, device=x.device) if columns else None
    some = row_part if rows else col_part
    if M and N:
        launch(_amax_kernel, grid, x, row_part if rows else some, col_part if columns else some, M, N, x.stride(0),
               ROWS=rows, COLUMNS=columns, BLOCK_M=128, BLOCK_N=128, num_warps=8)
    return row_part, col_part


def _scales(part: torch.Tensor, along_rows: bool, scale_inv: torch.Tensor, fp8_dtype, pow2_scales, amax_epsilon):
    """The fp32 scales of the rows (`along_rows`: `part` is [M, tiles]) or columns (`part` is
    [tiles, N]) whose partial amaxes `part` holds; their inverses are written into `scale_inv`."""
    length = part.shape[0] if along_rows else part.shape[1]
    stride_l, stride_p = (part.stride(0), part.stride(1)) if along_rows else (part.stride(1), part.stride(0))
    scale = torch.empty(length, dtype=torch.float32, device=part.device)
    if length:
        launch(_scales_kernel, (triton.cdiv(length, 1024),), part, scale, scale_inv, length,
               part.shape[1] if along_rows else part.shape[0], stride_l, stride_p, float(amax_epsilon),
               FP8_MAX=_FP8_MAX[fp8_dtype], POW2=pow2_scales, BLOCK=1024, num_warps=4)
    return scale


def cast(x, fp8_dtype, block_rows, block_cols, pow2_scales, amax_epsilon, rowwise, columnwise, reduce_column_amax=None):
    """((data, scale_inv) of the rowwise copy or None, the same of the columnwise copy or None), as
    Float8BlockStorage.layout declares them, from one read of each tile of the 2-D `x`.
    `reduce_column_amax`: applied to a row-wise columnwise copy's column amaxes (a shard's reduction
    over its ranks) before its scales are taken."""
    M, N = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    options = dict(fp8_dtype=fp8_dtype, block_rows=block_rows, block_cols=block_cols)
    row = Float8BlockStorage.empty_buffers(("data", "scale_inv"), "rowwise", M, N, x.device, **options) if rowwise else None
    col = Float8BlockStorage.empty_buffers(("data", "scale_inv"), "columnwise", M, N, x.device, **options) if columnwise else None
    row_scale = col_scale = None
    if block_cols is None:  # row-wise: the scales first, from whole rows' and columns' amaxes
        mode = GIVEN
        row_part, col_part = _amax_partials(x, rowwise, columnwise)
        if rowwise:
            row_scale = _scales(row_part, True, row[1], fp8_dtype, pow2_scales, amax_epsilon)
        if columnwise:
            if reduce_column_amax is not None:
                col_part = reduce_column_amax(col_part.amax(dim=0)).reshape(1, N)
            col_scale = _scales(col_part, False, col[1], fp8_dtype, pow2_scales, amax_epsilon)
    else:
        mode = VECTOR if block_rows == 1 else TILE
    if M and N:
        some = (row or col)
        launch(
            _cast_kernel, (triton.cdiv(M, 128), triton.cdiv(N, 128)),
            x, *(b if i else b.view(torch.uint8) for i, b in enumerate(row or some)),
            *(b if i else b.view(torch.uint8) for i, b in enumerate(col or some)),
            row_scale if row_scale is not None else some[1], col_scale if col_scale is not None else some[1],
            M, N, x.stride(0), float(amax_epsilon),
            FP8_MAX=_FP8_MAX[fp8_dtype], E5M2=fp8_dtype == torch.float8_e5m2, POW2=pow2_scales, MODE=mode,
            ROWWISE=rowwise, COLUMNWISE=columnwise, BLOCK_M=128, BLOCK_N=128, num_warps=WARPS[mode],
        )
    return row, col
