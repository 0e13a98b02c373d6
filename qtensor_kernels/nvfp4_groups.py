"""Triton kernels of NVFP4's grouped casts (qtensor/formats/nvfp4_groups.py): the routed rows of every
group of a grouped GEMM, or every expert of a stack, cast at once, each group with its own tensor
scale, its own stochastic-rounding keys and its own runs of 16 for the columnwise copy, so each
group gets the bytes of its own cast (nvfp4.py's kernels, one launch per group).

The programs walk the groups' runs of 16 rows, each group's rows run on to a multiple of 16 (no
tile spans two groups): program (i, j) finds its group from the device-side group ends (nothing
read on the host), loads its rows of `x` (zeros past the group's end) and casts them with
nvfp4.py's `_cast_tile`, its rowwise codes to the rows it read and its columnwise codes to run i
of the columnwise copy, whose stored rows are the groups' runs one after another.

- `amaxes(x, ends, ...)`: each group's finite amax, and with `transformed` that of its transformed
  columnwise copy, [2, G] (atomic maxima over the group's tiles).
- `cast(x, ends, ...)`: both copies, bit for bit the reference's per-group casts.
"""

import torch
import triton
import triton.language as tl

from qtensor.formats.nvfp4 import NVFP4Storage

from . import nvfp4
from .launch import launch


@triton.jit
def _tile_of_group(ends_ptr, G, G_POW2: tl.constexpr):
    """(group, its first row, its rows, this program's run of 16 within it) of program_id(0); the
    group is G past the last group's runs."""
    tile = tl.program_id(0)
    ids = tl.arange(0, G_POW2)
    ends = tl.load(ends_ptr + ids, mask=ids < G, other=0).to(tl.int64)
    starts = tl.load(ends_ptr + ids - 1, mask=(ids > 0) & (ids < G), other=0).to(tl.int64)
    tiles = tl.where(ids < G, (ends - starts + 15) // 16, 0)
    through = tl.cumsum(tiles, 0)
    group = tl.sum((through <= tile).to(tl.int32), 0)
    this = ids == group
    first_tile = tl.sum(tl.where(this, through - tiles, 0), 0)
    start = tl.sum(tl.where(this, starts, 0), 0)
    length = tl.sum(tl.where(this, ends - starts, 0), 0)
    return group, start, length, tile - first_tile


@triton.jit
def _load_group_tile(x_ptr, N, stride_m, start, length, tile, BLOCK_N: tl.constexpr, VEC: tl.constexpr):
    """(rows within the group, rows of x, which are the group's, columns, the fp32 tile [16, BLOCK_N]):
    zeros past the group's end, as its own cast pads."""
    in_group = tile * 16 + tl.arange(0, 16)
    row_ok = in_group < length
    rows = start + in_group
    cols = tl.max_contiguous(tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N), VEC)
    x = tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < N), other=0.0)
    return in_group, rows, row_ok, cols, x.to(tl.float32)


@triton.jit
def _amaxes_kernel(x_ptr, N, stride_m, ends_ptr, G, amax_ptr, TRANSFORMED: tl.constexpr, G_POW2: tl.constexpr, BLOCK_N: tl.constexpr, VEC: tl.constexpr):
    group, start, length, tile = _tile_of_group(ends_ptr, G, G_POW2)
    if group >= G:
        return
    _, _, _, _, x = _load_group_tile(x_ptr, N, stride_m, start, length, tile, BLOCK_N, VEC)
    magnitude = tl.abs(x)
    tl.atomic_max(amax_ptr + group, tl.max(tl.max(tl.where(magnitude < float("inf"), magnitude, 0.0), axis=0), axis=0))
    if TRANSFORMED:
        transformed = tl.abs(nvfp4._hadamard_columns(x, BLOCK_N))
        tl.atomic_max(amax_ptr + G + group, tl.max(tl.max(tl.where(transformed < float("inf"), transformed, 0.0), axis=0), axis=0))


@triton.jit
def _cast_kernel(
    x_ptr, N, stride_m, ends_ptr, G, row_amax_ptr, col_amax_ptr, keys_ptr,
    row_data_ptr, row_scale_ptr, row_values_ptr, col_data_ptr, col_scale_ptr, col_values_ptr, col_length,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, BLOCK_2D: tl.constexpr, RHT: tl.constexpr, STOCHASTIC: tl.constexpr,
    ROW_INT32: tl.constexpr, COL_INT32: tl.constexpr, WIDE: tl.constexpr, G_POW2: tl.constexpr, BLOCK_N: tl.constexpr, VEC: tl.constexpr,
    ROW_VALUES: tl.constexpr, COL_VALUES: tl.constexpr, TILES: tl.constexpr,
):
    group, start, length, tile = _tile_of_group(ends_ptr, G, G_POW2)
    if group >= G:
        return
    in_group, rows, row_ok, cols, x = _load_group_tile(x_ptr, N, stride_m, start, length, tile, BLOCK_N, VEC)
    # The group's own columnwise copy: its rows padded to runs of 16 with the transform, else its rows.
    stored = (length + 15) // 16 * 16 if RHT else length
    nvfp4._cast_tile(
        x, in_group, rows, row_ok, cols, row_amax_ptr + group, col_amax_ptr + group, keys_ptr + group * 4, tile * 8,
        ((stored + 1) // 2).to(tl.int32), row_data_ptr, row_scale_ptr, row_values_ptr, col_data_ptr, col_scale_ptr, col_values_ptr, N, col_length,
        ROWWISE, COLUMNWISE, BLOCK_2D, RHT, STOCHASTIC, ROW_INT32, COL_INT32, WIDE, BLOCK_N, ROW_VALUES, COL_VALUES, TILES,
    )


def _runs(lengths) -> int:
    """The groups' runs of 16 rows."""
    return sum(-(-n // 16) for n in lengths)


def amaxes(x: torch.Tensor, ends: torch.Tensor, lengths: tuple[int, ...], transformed: bool) -> torch.Tensor:
    """[2, G] fp32: each group's finite amax, then (with `transformed`, else zeros) that of its
    transformed columnwise copy."""
    N = x.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.zeros((2, len(lengths)), dtype=torch.float32, device=x.device)
    block_n, vec, warps = nvfp4._tile_columns(x, nvfp4._AMAXES_TILE)
    runs = _runs(lengths)
    if runs and N:
        launch(
            _amaxes_kernel, (runs, triton.cdiv(N, block_n)), x, N, x.stride(0), ends, len(lengths), out,
            TRANSFORMED=transformed, G_POW2=triton.next_power_of_2(len(lengths)), BLOCK_N=block_n, VEC=vec, num_warps=warps, enable_fp_fusion=False,
        )
    return out


def cast(x, ends, lengths, row_amax, col_amax, keys, rowwise, columnwise, block_2d, rht, values=(False, False), tile=None, tiles=False):
    """((rowwise data, scales[, values]) or None, (columnwise data, scales[, values]) or None) of the
    routed rows `x` [M, N] (M the groups' rows) in `lengths` (their `ends` on the device), each
    group at its global amax (`row_amax`, `col_amax` [G]) and, given `keys` [G, 4], with its own
    keys: the rowwise copy as NVFP4Storage lays out [M, N], the columnwise copy as it lays out the
    groups' rows each run on to a multiple of 16 ([16 · runs, N]); where `values` asks (rowwise,
    columnwise) a copy also comes with its bf16 values q · float(s), [M, N] or [N, 16 · runs]
    (bf16_operand's, written by the cast instead of a dequantize pass after it). With `tiles` (16x16
    tiles, every group whole tiles) both copies hold one scale per tile."""
    M, N = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    runs = _runs(lengths)
    col_length = 16 * runs
    row = NVFP4Storage.empty_buffers(("data", "scale_inv"), "rowwise", M, N, x.device, rht=rht, tile_scales=tiles) if rowwise else None
    col = NVFP4Storage.empty_buffers(("data", "scale_inv"), "columnwise", col_length, N, x.device, rht=rht, tile_scales=tiles) if columnwise else None
    row_values = torch.empty((M, N), dtype=torch.bfloat16, device=x.device) if rowwise and values[0] else None
    col_values = torch.empty((N, col_length), dtype=torch.bfloat16, device=x.device) if columnwise and values[1] else None
    if runs and N:
        warps, row_bytes = tile or nvfp4._CAST_TILE["nearest" if keys is None else "stochastic"]
        if all(values):
            # Writing both copies' values, with 2 columns a thread Triton 3.6 compiled the 1x16 cast's
            # codes wrong on an H100 (fp32 and bf16 inputs); with 4 they are right (tests/test_nvfp4_groups.py).
            row_bytes = max(row_bytes, 4 * x.element_size())
        block_n, vec, warps = nvfp4._tile_columns(x, (warps, row_bytes))
        some = row or col  # stands in for the absent direction, whose pointers the kernel never uses
        some = (some[0], some[1].view(torch.uint8))
        longest = max(lengths)
        launch(
            _cast_kernel, (runs, triton.cdiv(N, block_n)),
            x, N, x.stride(0), ends, len(lengths), row_amax, col_amax, keys if keys is not None else row_amax,
            *(nvfp4._kernel_view(row, N) if row else some), row_values if row_values is not None else some[0],
            *(nvfp4._kernel_view(col, col_length) if col else some), col_values if col_values is not None else some[0], col_length,
            ROWWISE=rowwise, COLUMNWISE=columnwise, BLOCK_2D=block_2d, RHT=rht, STOCHASTIC=keys is not None,
            ROW_INT32=N % 8 == 0, COL_INT32=col_length % 8 == 0, WIDE=nvfp4._wide_pairs(longest, N, -(-longest // 16) * 16),
            G_POW2=triton.next_power_of_2(len(lengths)), BLOCK_N=block_n, VEC=vec, ROW_VALUES=row_values is not None, COL_VALUES=col_values is not None, TILES=tiles,
            num_warps=warps, enable_fp_fusion=False,
        )
    with_values = lambda copy, made: None if copy is None else (*copy, made) if made is not None else copy
    return with_values(row, row_values), with_values(col, col_values)


# Registered into qtensor's kernel table (qtensor_kernels/__init__.py).
KERNELS = {"nvfp4_groups.amaxes": amaxes, "nvfp4_groups.cast": cast}
