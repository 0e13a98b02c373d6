"""Triton kernel of FP8 with block scales, bit-identical to the pure-torch reference in
qtensor/formats/float8_block.py (docs/numerics.md, Float8 with block scales).

`cast(x, fp8_dtype, block_rows, block_cols, ...)`: one read of each tile of `x` writes both copies.
- **Blocks** (1x128, 128x128): each 128x128 tile holds whole blocks of both copies, and the kernel
  finds their amaxes in the tile:
  - 1x128: each row's 128 values for the rowwise copy, each column's 128 for the columnwise one;
  - 128x128: the whole tile for both.
- **Row-wise** (`block_cols=None`): a scale spans a whole row or column, so a first kernel reads
  `x` for every row's and column's amax (a sharded tensor then reduces its column amaxes over its
  ranks), and the cast kernel takes the scales from those.

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
# The cast kernel's warps per 128x128 tile by the input's bytes per element: the fastest of
# benchmarks/sweep_cast.py --float8-block on an H100. fp32 takes 8: at 4 warps Triton 3.6 miscompiles
# the columnwise-only fp32 cast on sm_90 (a quarter of the rows' codes garbage), which
# tests/test_cuda_kernels.py checks against the reference.
WARPS = {2: 4, 4: 8}
AMAX_TILES = 4  # the amax kernel's 128x128 tiles down one column strip per program


@triton.jit
def _rowwise_codes(x, magnitude, rows, offs_n, mask, M, N, tiles_n, pid_n, row_ptr, row_scale_inv_ptr, row_amax_ptr,
                   epsilon, FP8_MAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr, MODE: tl.constexpr):
    """One set of rows' rowwise codes and scales at the rows' own scales: 1x128 blocks (each row's
    128 values in this tile) or row-wise (each row's given amax)."""
    if MODE == 0:
        scale = _scale_from_amax(tl.max(magnitude, axis=1), epsilon, FP8_MAX, 1.0, POW2)
        tl.store(row_scale_inv_ptr + rows * tiles_n + pid_n, tl.div_rn(_like(1.0, scale), scale), mask=rows < M)
    else:
        scale = _scale_from_amax(tl.load(row_amax_ptr + rows, mask=rows < M, other=0.0), epsilon, FP8_MAX, 1.0, POW2)
        if pid_n == 0:
            tl.store(row_scale_inv_ptr + rows, tl.div_rn(_like(1.0, scale), scale), mask=rows < M)
    tl.store(row_ptr + rows[:, None] * N + offs_n[None, :], _codes(x, scale[:, None], FP8_MAX, E5M2), mask=mask)


@triton.jit
def _cast_kernel(
    x_ptr, row_ptr, row_scale_inv_ptr, col_ptr, col_scale_inv_ptr, row_amax_ptr, col_amax_ptr,
    M, N, stride_m, epsilon,
    FP8_MAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr, MODE: tl.constexpr,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, ROWS_PER_WORD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile, read once and held in registers. With ROWS_PER_WORD 4 (M a
    multiple of 4) its rows are read as 4 interleaved sets, so that each columnwise store writes 4
    consecutive codes of a column as one word (as the per-tensor Float8 kernel does); with 1, as one
    set, a byte per code."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside_n = offs_n < N
    groups = pid_m.to(tl.int64) * (BLOCK_M // ROWS_PER_WORD) + tl.arange(0, BLOCK_M // ROWS_PER_WORD)
    rows = groups * ROWS_PER_WORD  # the first set's rows; set j holds rows + j
    # Partial blocks behave as zero-padded (docs/numerics.md, Float8 with block scales).
    mask = (rows[:, None] < M) & inside_n[None, :]
    first = x_ptr + rows[:, None] * stride_m + offs_n[None, :]
    x0 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    m0 = _finite_magnitude(x0)
    magnitude = m0
    if ROWS_PER_WORD == 4:
        x1 = tl.load(first + stride_m, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(first + 2 * stride_m, mask=mask, other=0.0).to(tl.float32)
        x3 = tl.load(first + 3 * stride_m, mask=mask, other=0.0).to(tl.float32)
        m1, m2, m3 = _finite_magnitude(x1), _finite_magnitude(x2), _finite_magnitude(x3)
        magnitude = tl.maximum(tl.maximum(m0, m1), tl.maximum(m2, m3))

    # The columnwise scales: each column's 128 values in this tile (1x128), the tile's amax
    # (128x128: one scale, the same codes in both copies) or each column's given amax (row-wise).
    if MODE == 2:
        column_amax = tl.load(col_amax_ptr + offs_n, mask=inside_n, other=0.0)
    else:
        column_amax = tl.max(magnitude, axis=0)
    if MODE == 1:
        column_amax = tl.zeros((BLOCK_N,), dtype=tl.float32) + tl.max(column_amax, axis=0)
    column_scale = _scale_from_amax(column_amax, epsilon, FP8_MAX, 1.0, POW2)
    column_scale_inv = tl.div_rn(_like(1.0, column_scale), column_scale)
    if MODE == 0 and COLUMNWISE:
        tl.store(col_scale_inv_ptr + offs_n * tiles_m + pid_m, column_scale_inv, mask=inside_n)
    if MODE == 1:
        tile_scale_inv = tl.max(column_scale_inv, axis=0)  # all equal
        if ROWWISE:
            tl.store(row_scale_inv_ptr + pid_m * tiles_n + pid_n, tile_scale_inv)
        if COLUMNWISE:
            tl.store(col_scale_inv_ptr + pid_n * tiles_m + pid_m, tile_scale_inv)
    if MODE == 2 and COLUMNWISE and pid_m == 0:
        tl.store(col_scale_inv_ptr + offs_n, column_scale_inv, mask=inside_n)

    if ROWWISE and MODE != 1:  # the rows' own scales
        ops = (offs_n, mask, M, N, tiles_n, pid_n, row_ptr, row_scale_inv_ptr, row_amax_ptr, epsilon, FP8_MAX, E5M2, POW2, MODE)
        _rowwise_codes(x0, m0, rows, *ops)
        if ROWS_PER_WORD == 4:
            _rowwise_codes(x1, m1, rows + 1, *ops)
            _rowwise_codes(x2, m2, rows + 2, *ops)
            _rowwise_codes(x3, m3, rows + 3, *ops)
    if COLUMNWISE or (MODE == 1 and ROWWISE):  # the codes at the column scales (128x128: the tile's)
        ops = (offs_n, mask, N, row_ptr, column_scale, FP8_MAX, E5M2, MODE == 1 and ROWWISE)
        words = _column_codes(x0, rows, *ops)
        if ROWS_PER_WORD == 4:
            words = words.to(tl.int32)
            words = words | (_column_codes(x1, rows + 1, *ops).to(tl.int32) << 8)
            words = words | (_column_codes(x2, rows + 2, *ops).to(tl.int32) << 16)
            words = words | (_column_codes(x3, rows + 3, *ops).to(tl.int32) << 24)
        if COLUMNWISE:
            word_ptr = col_ptr.to(tl.pointer_type(words.dtype))
            tl.store(word_ptr + offs_n[:, None] * (M // ROWS_PER_WORD) + groups[None, :], tl.trans(words), mask=tl.trans(mask))


@triton.jit
def _column_codes(x, rows, offs_n, mask, N, row_ptr, column_scale, FP8_MAX: tl.constexpr, E5M2: tl.constexpr,
                  STORE_ROWWISE: tl.constexpr):
    """One set of rows' codes at the column scales, stored as the rowwise copy too for 128x128 blocks."""
    codes = _codes(x, column_scale[None, :], FP8_MAX, E5M2)
    if STORE_ROWWISE:
        tl.store(row_ptr + rows[:, None] * N + offs_n[None, :], codes, mask=mask)
    return codes


@triton.jit
def _amax_kernel(x_ptr, row_amax_ptr, col_amax_ptr, M, N, stride_m, ROWS: tl.constexpr, COLUMNS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr):
    """The finite amax of each row and of each column, from one read: each program reads TILES tiles
    down one column strip, folds its column maxes in registers and each tile's row maxes into the
    zero-filled outputs by atomic max (exact in any order), then its column maxes the same way."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside_n = offs_n < N
    column = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for t in tl.static_range(TILES):
        offs_m = (pid_m.to(tl.int64) * TILES + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        inside_m = offs_m < M
        x = tl.load(x_ptr + offs_m[:, None] * stride_m + offs_n[None, :], mask=inside_m[:, None] & inside_n[None, :], other=0.0)
        magnitude = _finite_magnitude(x.to(tl.float32))
        if ROWS:
            tl.atomic_max(row_amax_ptr + offs_m, tl.max(magnitude, axis=1), mask=inside_m, sem="relaxed")
        column = tl.maximum(column, tl.max(magnitude, axis=0))
    if COLUMNS:
        tl.atomic_max(col_amax_ptr + offs_n, column, mask=inside_n, sem="relaxed")


def _row_and_column_amaxes(x: torch.Tensor, rows: bool, columns: bool):
    """(each row's finite amax [M] or None, each column's [N] or None) of the 2-D `x`: the amaxes
    of whole rows and whole columns formats.float8_block.block_amax takes for row-wise scales."""
    M, N = x.shape
    amaxes = torch.zeros(M * rows + N * columns, dtype=torch.float32, device=x.device)
    row_amax, col_amax = amaxes[: M * rows], amaxes[M * rows:]
    if M and N:
        launch(_amax_kernel, (triton.cdiv(M, 128 * AMAX_TILES), triton.cdiv(N, 128)), x, row_amax if rows else amaxes,
               col_amax if columns else amaxes, M, N, x.stride(0), ROWS=rows, COLUMNS=columns, BLOCK_M=128, BLOCK_N=128,
               TILES=AMAX_TILES, num_warps=8)
    return (row_amax if rows else None), (col_amax if columns else None)


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
    row_amax = col_amax = None
    if block_cols is None:  # row-wise: the amaxes of whole rows and columns first
        mode = GIVEN
        row_amax, col_amax = _row_and_column_amaxes(x, rowwise, columnwise)
        if columnwise and reduce_column_amax is not None:
            col_amax = reduce_column_amax(col_amax)
    else:
        mode = VECTOR if block_rows == 1 else TILE
    if not (M and N):  # no kernel: an empty row or column of a row-wise copy has scale 1
        for copy in (row, col):
            if copy is not None:
                copy[1].fill_(1.0)
        return row, col
    some = row or col
    rows_per_word = 4 if M % 4 == 0 else 1
    launch(
        _cast_kernel, (triton.cdiv(M, 128), triton.cdiv(N, 128)),
        x, *(b if i else b.view(torch.uint8) for i, b in enumerate(row or some)),
        *(b if i else b.view(torch.uint8) for i, b in enumerate(col or some)),
        row_amax if row_amax is not None else some[1], col_amax if col_amax is not None else some[1],
        M, N, x.stride(0), float(amax_epsilon),
        FP8_MAX=_FP8_MAX[fp8_dtype], E5M2=fp8_dtype == torch.float8_e5m2, POW2=pow2_scales, MODE=mode,
        ROWWISE=rowwise, COLUMNWISE=columnwise, ROWS_PER_WORD=rows_per_word, BLOCK_M=128, BLOCK_N=128,
        num_warps=WARPS[x.element_size()],
    )
    return row, col


# Registered into qtensor's kernel table (qtensor_kernels/__init__.py).
KERNELS = {"float8_block.cast": cast}
