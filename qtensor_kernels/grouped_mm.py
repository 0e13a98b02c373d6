"""Grouped GEMMs of FP8 codes with a factor per row (the grouped operands of formats/float8_groups.py)
on the FP8 tensor cores, for an expert stack's grouped linear (qtensor/layers/grouped_linear.py).
They compute what `torch._scaled_grouped_mm` computes, C = (A · Bᵀ) times each row's factor of A
and of B, in fp32, rounded once, and run where qtensor asks for the split accumulator (partial
sums promoted to fp32 after each BLOCK_K of the reduction; docs/numerics.md, FP8 GEMMs): on an
H100 at the Qwen3-like shapes torch's split-accumulator grouped GEMMs ran at 0.37-0.50x a bf16
grouped GEMM, these at 0.89-1.24x (benchmarks/bench_grouped_mm.py, docs/experts.md).

- `float8_rows(a, a_scale, b, b_scale, ends, ...)`: C[rows of group e] = A[rows of e] · B_eᵀ
  (fprop, dgrad), A [M, K], B [E, N, K]. `ends` (on the device) are the groups' cumulative row
  ends; each program finds its group and rows from them, so the host sends nothing and waits for
  nothing.
- `float8_columns(a, a_scale, b, b_scale, ends, ...)`: C_e = A[:, run e] · B[:, run e]ᵀ (wgrad),
  A [N, R] and B [K, R] columnwise copies, each group's run of columns whole 16s (the casts'
  padding, zero codes after a group's rows); a group with an empty run gets zeros.
- `bf16_rows`, `bf16_columns`: the same two products of bf16 values (the exact q·s values of NVFP4
  copies) times each group's tensor scales in the fp32 epilogue, computed there from the groups'
  global amaxes, which torch's bf16 grouped GEMM, writing only bf16, cannot apply before its rounding.
"""

import torch
import triton
import triton.language as tl

from .gemm import _tensor_scale
from .launch import launch


@triton.jit
def _epilogue(acc, a_scale_ptr, a_index, a_ok, b_scale_ptr, b_index, b_ok, group, GROUP_SCALES: tl.constexpr,
              A_AMAX_MAX: tl.constexpr, B_AMAX_MAX: tl.constexpr):
    """The fp32 product times the rows' factors of A and of B, in that order (GROUP_SCALES 0). With
    GROUP_SCALES 1 (A's), 2 (B's) or 3 (both) times the group's tensor scales instead, each computed
    here from its buffer [G] as `TensorScale.value` computes it (a scale_inv, or with *_AMAX_MAX
    NVFP4's 1/S_enc of the global amax), the two multiplied first, as the dense epilogue does
    (qtensor_kernels/gemm.py). With 4, the product as it is."""
    if GROUP_SCALES == 4:
        return acc
    if GROUP_SCALES == 1:
        return acc * _tensor_scale(a_scale_ptr + group, A_AMAX_MAX)
    if GROUP_SCALES == 2:
        return acc * _tensor_scale(b_scale_ptr + group, B_AMAX_MAX)
    if GROUP_SCALES == 3:
        return acc * (_tensor_scale(a_scale_ptr + group, A_AMAX_MAX) * _tensor_scale(b_scale_ptr + group, B_AMAX_MAX))
    a_scale = tl.load(a_scale_ptr + a_index, mask=a_ok, other=0.0)
    b_scale = tl.load(b_scale_ptr + b_index, mask=b_ok, other=0.0)
    return acc * a_scale[:, None] * b_scale[None, :]


@triton.jit
def _rows_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, ends_ptr, E, M, N, K, stride_am, stride_be, stride_bn, stride_om,
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IMPRECISE: tl.constexpr,
    GROUP_SCALES: tl.constexpr, A_AMAX_MAX: tl.constexpr, B_AMAX_MAX: tl.constexpr,
):
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile, column_tile = tl.program_id(0) // tiles_n, tl.program_id(0) % tiles_n
    group_ids = tl.arange(0, E_POW2)
    ends = tl.load(ends_ptr + group_ids, mask=group_ids < E, other=0).to(tl.int64)
    starts = tl.load(ends_ptr + group_ids - 1, mask=(group_ids > 0) & (group_ids < E), other=0).to(tl.int64)
    tiles = tl.where(group_ids < E, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    tiles_through = tl.cumsum(tiles, 0)
    group = tl.sum((tiles_through <= tile).to(tl.int32), 0)
    if group >= E:  # the rows past the last group's, if any: zeros
        tail = tl.max(ends, 0) + (tile - tl.sum(tiles, 0)) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + tail[:, None] * stride_om + offs_n[None, :], zeros, mask=(tail[:, None] < M) & (offs_n[None, :] < N))
        return
    this = group_ids == group
    first_tile = tl.sum(tl.where(this, tiles_through - tiles, 0), 0)
    row_end = tl.sum(tl.where(this, ends, 0), 0)
    offs_m = tl.sum(tl.where(this, starts, 0), 0) + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < row_end, offs_n < N
    b_rows = b_ptr + group.to(tl.int64) * stride_be + offs_n[:, None].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0)
        b = tl.load(b_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k[None, :] < K), other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=IMPRECISE)
    out = _epilogue(acc, a_scale_ptr, offs_m, m_ok, b_scale_ptr, group.to(tl.int64) * N + offs_n, n_ok, group, GROUP_SCALES, A_AMAX_MAX, B_AMAX_MAX)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _columns_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, ends_ptr, N, K, stride_an, stride_ar, stride_bk, stride_br,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, IMPRECISE: tl.constexpr,
    GROUP_SCALES: tl.constexpr, A_AMAX_MAX: tl.constexpr, B_AMAX_MAX: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    tiles_n, tiles_k = tl.cdiv(N, BLOCK_N), tl.cdiv(K, BLOCK_K)
    per_group = tiles_n * tiles_k
    group, tile = tl.program_id(0) // per_group, tl.program_id(0) % per_group
    offs_n = (tile // tiles_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = (tile % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok, k_ok = offs_n < N, offs_k < K
    run_end = tl.load(ends_ptr + group).to(tl.int64)
    run_start = tl.load(ends_ptr + group - 1, mask=group > 0, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # Runs of whole 16s (the callers' padding): where the runs are contiguous, 16-byte vectors along
    # them, which masks at a run's end would otherwise break into single bytes.
    run_start = tl.multiple_of(run_start, 16)
    a_rows = a_ptr + offs_n.to(tl.int64)[:, None] * stride_an + run_start * stride_ar
    b_rows = b_ptr + offs_k.to(tl.int64)[:, None] * stride_bk + run_start * stride_br
    length = tl.multiple_of((run_end - run_start).to(tl.int32), 16)
    for r0 in range(0, length, BLOCK_R):  # an int32 count from 0, which the pipeliner takes
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < length
        a = tl.load(a_rows + offs_r[None, :] * stride_ar, mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_rows + offs_r[None, :] * stride_br, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=IMPRECISE)
    out = _epilogue(acc, a_scale_ptr, group.to(tl.int64) * N + offs_n, n_ok, b_scale_ptr, group.to(tl.int64) * K + offs_k, k_ok, group, GROUP_SCALES, A_AMAX_MAX, B_AMAX_MAX)
    if ROUND_BF16:  # rounded to bf16, stored wider (a weight gradient in its parameter's dtype): no pass to convert it
        out = out.to(tl.bfloat16)
    tl.store(out_ptr + group.to(tl.int64) * N * K + offs_n[:, None] * K + offs_k[None, :], out.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


# (BLOCK_M or BLOCK_N, BLOCK_N or BLOCK_K, BLOCK_K or BLOCK_R, warps, stages): FP8 by fast
# accumulation, and bf16 by product, the fastest of benchmarks/bench_grouped_mm.py --sweep (--bf16)
# on an H100 at the Qwen3-like shapes.
TILES = {False: (256, 128, 128, 8, 3), True: (128, 256, 128, 8, 3), "bf16 rows": (128, 256, 64, 8, 3), "bf16 columns": (256, 128, 64, 8, 3)}


def _scales(a_scale, b_scale, some: torch.Tensor):
    """(pointer of A's, of B's, GROUP_SCALES, A_AMAX_MAX, B_AMAX_MAX) of two per-group TensorScales
    (each [G] and its amax_max, or None; neither: the product as it is, `some` the pointers)."""
    mode = (a_scale is not None) + 2 * (b_scale is not None) or 4
    return ((a_scale.tensor if a_scale else some), (b_scale.tensor if b_scale else some), mode,
            (a_scale.amax_max or 0.0) if a_scale else 0.0, (b_scale.amax_max or 0.0) if b_scale else 0.0)


def _rows(a, a_scale, b, b_scale, ends, out_dtype, imprecise, group_scales, tile):
    """C [M, N] = rows of group e of A [M, K] times B_eᵀ, B [E, N, K] with K contiguous (any strides
    along E and N), then the epilogue's factors (`group_scales`: (GROUP_SCALES, A_AMAX_MAX, B_AMAX_MAX));
    rows past the last group's zero."""
    (m, k), (experts, n, _) = a.shape, b.shape
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    block_m, block_n, block_k, warps, stages = tile
    mode, a_max, b_max = group_scales
    if m and n:
        # Tiles of every group's rows (at most one partial tile a group), then of the rows after the last group.
        grid = ((triton.cdiv(m, block_m) + experts + 1) * triton.cdiv(n, block_n),)
        launch(
            _rows_kernel, grid, a, a_scale, b, b_scale, out, ends, experts, m, n, k, a.stride(0), b.stride(0), b.stride(1), out.stride(0),
            E_POW2=triton.next_power_of_2(experts), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            IMPRECISE=imprecise, GROUP_SCALES=mode, A_AMAX_MAX=a_max, B_AMAX_MAX=b_max, num_warps=warps, num_stages=stages,
        )
    return out


def _columns(a, a_scale, b, b_scale, ends, out_dtype, imprecise, group_scales, tile, stored_dtype=None):
    """C [E, N, K], C_e = A[:, run e] · B[:, run e]ᵀ for A [N, R] and B [K, R] (any strides), then the
    epilogue's factors, rounded to `out_dtype` and stored as `stored_dtype` (default: the same);
    a group with an empty run gets zeros."""
    n, k, experts = a.shape[0], b.shape[0], ends.shape[0]
    # The kernel steps along a run by int32 offsets times the stride: an operand strided along its
    # runs (an MXFP8 columnwise copy read in place) must hold fewer than 2**31 elements.
    a, b = (t if t.stride(1) == 1 or t.numel() < 2**31 else t.contiguous() for t in (a, b))
    stored_dtype = stored_dtype or out_dtype
    if out_dtype not in (stored_dtype, torch.bfloat16):
        raise ValueError(f"grouped_mm: a product rounded to {out_dtype} is stored in its own dtype, not {stored_dtype}.")
    out = torch.empty((experts, n, k), dtype=stored_dtype, device=a.device)
    block_n, block_k, block_r, warps, stages = tile
    mode, a_max, b_max = group_scales
    if experts and n and k:
        grid = (experts * triton.cdiv(n, block_n) * triton.cdiv(k, block_k),)
        launch(
            _columns_kernel, grid, a, a_scale, b, b_scale, out, ends, n, k, *a.stride(), *b.stride(),
            BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=block_r, IMPRECISE=imprecise, GROUP_SCALES=mode, A_AMAX_MAX=a_max, B_AMAX_MAX=b_max,
            ROUND_BF16=out_dtype != stored_dtype, num_warps=warps, num_stages=stages,
        )
    return out


_ROW_FACTORS = (0, 0.0, 0.0)


def float8_rows(a_data, a_scale, b_data, b_scale, ends, out_dtype, fast_accumulation, tile=None):
    """C [M, N]: rows of group e of A [M, K] (FP8 codes, a factor per row) times B_eᵀ (B [E, N, K],
    factors [E, N]), summed on the FP8 tensor cores (promoted to fp32 after each BLOCK_K of the
    reduction unless `fast_accumulation`), times both rows' factors, rounded once to `out_dtype`."""
    tile = tile or TILES[fast_accumulation]
    return _rows(a_data, a_scale, b_data, b_scale, ends, out_dtype, None if fast_accumulation else tile[2], _ROW_FACTORS, tile)


def float8_columns(a_data, a_scale, b_data, b_scale, ends, out_dtype, fast_accumulation, tile=None, stored_dtype=None):
    """C [E, N, K], C_e = A[:, run e] · B[:, run e]ᵀ for A [N, R] and B [K, R] (FP8 codes; factors
    per group and row, [E, N] and [E, K]), rounded to `out_dtype`, stored as `stored_dtype` (default:
    the same); a group with an empty run gets zeros."""
    tile = tile or TILES[fast_accumulation]
    return _columns(a_data, a_scale, b_data, b_scale, ends, out_dtype, None if fast_accumulation else tile[2], _ROW_FACTORS, tile, stored_dtype)


def bf16_rows(a, b, a_scale, b_scale, ends, out_dtype, tile=None):
    """C [M, N]: rows of group e of A [M, K] times B_eᵀ (B [E, N, K], K contiguous), bf16 values
    summed in fp32 on the bf16 tensor cores, times group e's tensor scales (`a_scale`, `b_scale`:
    per-group TensorScales, either None), rounded once to `out_dtype`."""
    a_ptr, b_ptr, *modes = _scales(a_scale, b_scale, a)
    return _rows(a, a_ptr, b, b_ptr, ends, out_dtype, None, modes, tile or TILES["bf16 rows"])


def bf16_columns(a, b, a_scale, b_scale, ends, out_dtype, tile=None, stored_dtype=None):
    """C [E, N, K], C_e = A[:, run e] · B[:, run e]ᵀ of bf16 values (A [N, R], B [K, R], any strides,
    runs of whole 16s), summed in fp32, times group e's tensor scales (either or both None),
    rounded once to `out_dtype`, stored as `stored_dtype` (default: the same); an empty run gives
    zeros."""
    a_ptr, b_ptr, *modes = _scales(a_scale, b_scale, a)
    return _columns(a, a_ptr, b, b_ptr, ends, out_dtype, None, modes, tile or TILES["bf16 columns"], stored_dtype)


# Registered into qtensor's kernel table (qtensor_kernels/__init__.py).
KERNELS = {
    "grouped_mm.float8_rows": float8_rows, "grouped_mm.float8_columns": float8_columns,
    "grouped_mm.bf16_rows": bf16_rows, "grouped_mm.bf16_columns": bf16_columns,
}
