"""Triton kernels of the Float8 format (one fp32 scale per tensor), bit-identical to the pure-torch
reference in qtensor/formats/float8.py and qtensor/numerics.py (docs/numerics.md, Float8):

- `amax_partials(x)`: partial finite amaxes of `x` (their max is max|x| over the finite values),
  written without atomics, so nothing is zeroed first; `finite_amax(x)` reduces them to a 0-d tensor.
- `cast(x, fp8_dtype, rowwise, columnwise, scale=... | amax=..., amax_out=...)`: one pass over `x`
  that writes the rowwise codes `[M, N]` and the transposed columnwise codes `[N, M]` (the layout
  the FP8 GEMMs read) and `1/scale`. The scale is given (delayed scaling) or computed in every
  program from the amax (current scaling); with `amax_out` each program also writes the amax of its
  tile, which delayed scaling records.
- `delayed_scale(history, ...)` and `record_amax(history, partials)`: delayed scaling's scale from
  the amax history, and the history update, each one single-program kernel.
- `dequantize(data, scale_inv, out_dtype)`: codes times the scale, rounded once to `out_dtype`.
- `transpose_into(source, out)`: `out.copy_(source.t())` for 1-byte codes, through shared memory in
  tiles (torch's strided copy reads or writes one byte per thread, about six times slower); the
  columnwise codes an FSDP2 gather rebuilds from the rowwise ones.

Every scale computation divides with IEEE round-to-nearest (`tl.div_rn`), as torch does.
"""

import torch
import triton
import triton.language as tl

from qtensor.formats.float8 import Float8Storage
from .launch import launch

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_NAN_CODE = tl.constexpr(0x7F)  # the one NaN code qtensor writes (numerics.FP8_NAN_CODE)
_FLT_MAX = tl.constexpr(3.4028234663852886e38)

# Cast tiles (BLOCK_M, BLOCK_N, warps) by how many rows one columnwise word packs: the fastest of
# benchmarks/sweep_cast.py on an H200 at 8192x8192 bf16 (73.6% of the copy bandwidth packing 4
# rows, 60.3% packing none; packing 8 rows into 64-bit words reached 66% at best).
_CAST_TILE = {4: (128, 64, 4), 1: (64, 128, 4)}


_AMAX_BLOCK = 4096


@triton.jit
def _amax_partials_kernel(x_ptr, partials_ptr, n, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    """Program p writes max|x| over the finite values of blocks p, p + PROGRAMS, ... (no atomics, so
    nothing has to be zeroed first)."""
    running = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(tl.program_id(0) * BLOCK, n, PROGRAMS * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        magnitude = tl.abs(tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32))
        running = tl.maximum(running, tl.where(magnitude < float("inf"), magnitude, 0.0))  # not Inf, not NaN
    tl.store(partials_ptr + tl.program_id(0), tl.max(running, axis=0))


# Up to 1024 programs: 91.5% of the copy bandwidth on an H200 (512: 79%; benchmarks/sweep_cast.py).
MAX_AMAX_PARTIALS = 1024


def amax_partials(x: torch.Tensor, programs: int | None = None) -> torch.Tensor:
    """Partial finite amaxes of `x`, whose max is its finite amax: `programs` of them (a power of
    two), by default as many as `x` fills, up to MAX_AMAX_PARTIALS; a program past the end of `x`
    writes 0."""
    x = x.contiguous()
    n = x.numel()
    if programs is None:
        programs = min(MAX_AMAX_PARTIALS, triton.next_power_of_2(max(triton.cdiv(n, 2 * _AMAX_BLOCK), 1)))
    partials = torch.empty(programs, dtype=torch.float32, device=x.device)
    launch(_amax_partials_kernel, (programs,), x, partials, n, BLOCK=_AMAX_BLOCK, PROGRAMS=programs, num_warps=8)
    return partials


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    partials = amax_partials(x)
    return partials.max() if partials.numel() > 1 else partials.reshape(())


@triton.jit
def _like(value, finite):
    """`value` as an fp32 tensor shaped like the finite fp32 `finite` (exact: finite * 0 is ±0)."""
    return finite * 0.0 + value


@triton.jit
def _scale_from_amax(amax, epsilon, FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr, POW2: tl.constexpr):
    """numerics.scale_from_amax of clamp_min(amax, epsilon), then round_down_pow2 when POW2."""
    amax = tl.maximum(amax, epsilon)  # an amax is never NaN or infinite
    scale = tl.div_rn(_like(FP8_MAX, amax), amax)
    if MARGIN_FACTOR != 1.0:
        scale = tl.div_rn(scale, _like(MARGIN_FACTOR, amax))
    scale = tl.where(scale == float("inf"), _FLT_MAX, scale)
    scale = tl.where(amax == 0.0, 1.0, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _codes(x, scale, FP8_MAX: tl.constexpr, E5M2: tl.constexpr):
    """FP8 codes (uint8) of fp32 `x` at `scale`: formats.float8.quantize_per_tensor."""
    y = x * scale
    # Saturate (comparisons are false for NaN, which stays NaN; ±Inf products clamp).
    y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))
    if E5M2:
        codes = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
        codes = tl.where(x == float("inf"), 0x7C, tl.where(x == -float("inf"), 0xFC, codes))
        codes = tl.where(y != y, _NAN_CODE, codes)
    else:  # E4M3 has no Inf: an infinite input becomes NaN
        codes = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        codes = tl.where((y != y) | (tl.abs(x) == float("inf")), _NAN_CODE, codes)
    return codes.to(tl.uint8)


@triton.jit
def _finite_magnitude(x):
    magnitude = tl.abs(x)
    return tl.where(magnitude < float("inf"), magnitude, 0.0)  # false for Inf and NaN


@triton.jit
def _cast_kernel(
    x_ptr, scale_ptr, amax_ptr, scale_inv_ptr, amax_out_ptr, row_ptr, col_ptr, M, N, stride_m, epsilon,
    FP8_MAX: tl.constexpr, E5M2: tl.constexpr, ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
    AMAX_PARTS: tl.constexpr, POW2: tl.constexpr, AMAX_OUT: tl.constexpr, ROWS_PER_WORD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    if AMAX_PARTS > 0:  # current scaling: every program derives the scale from the partial amaxes
        scale = _scale_from_amax(tl.max(tl.load(amax_ptr + tl.arange(0, AMAX_PARTS)), axis=0), epsilon, FP8_MAX, 1.0, POW2)
    else:
        scale = tl.load(scale_ptr)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(scale_inv_ptr, tl.div_rn(_like(1.0, scale), scale))
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    # The tile is read as ROWS_PER_WORD interleaved sets of rows (M is a multiple of it), so that each
    # columnwise store writes that many consecutive codes of a column as one word (1: one byte).
    groups = tl.program_id(0).to(tl.int64) * (BLOCK_M // ROWS_PER_WORD) + tl.arange(0, BLOCK_M // ROWS_PER_WORD)
    mask = (groups[:, None] * ROWS_PER_WORD < M) & (offs_n[None, :] < N)
    if ROWS_PER_WORD == 4:
        words = tl.zeros((BLOCK_M // ROWS_PER_WORD, BLOCK_N), dtype=tl.int32)
    else:
        words = tl.zeros((BLOCK_M // ROWS_PER_WORD, BLOCK_N), dtype=tl.uint8)
    magnitudes = tl.zeros((BLOCK_M // ROWS_PER_WORD, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(ROWS_PER_WORD):
        rows = groups * ROWS_PER_WORD + j
        x = tl.load(x_ptr + rows[:, None] * stride_m + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        if AMAX_OUT:
            magnitudes = tl.maximum(magnitudes, _finite_magnitude(x))
        codes = _codes(x, scale, FP8_MAX, E5M2)
        if ROWWISE:
            tl.store(row_ptr + rows[:, None] * N + offs_n[None, :], codes, mask=mask)
        if ROWS_PER_WORD == 1:
            words = codes
        else:
            words = words | (codes.to(words.dtype) << (8 * j))
    if COLUMNWISE:
        word_ptr = col_ptr.to(tl.pointer_type(words.dtype))
        tl.store(word_ptr + offs_n[:, None] * (M // ROWS_PER_WORD) + groups[None, :], tl.trans(words), mask=tl.trans(mask))
    if AMAX_OUT:  # delayed scaling records the amax of what it casts: one partial per program
        tile_max = tl.max(tl.max(magnitudes, axis=1), axis=0)
        tl.store(amax_out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tile_max)


def cast(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
    *,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    amax_epsilon: float = 0.0,
    force_pow_2_scales: bool = False,
    amax_out: bool = False,
    block: tuple[int, int, int] | None = None,
    rows_per_word: int | None = None,
):
    """Cast the 2-D `x` to FP8 at `scale`, or at the scale current scaling derives from `amax`
    (a 0-d amax, or the partial amaxes of `amax_partials`).

    Returns (rowwise codes or None, columnwise codes (the transpose) or None, 1/scale, partial
    amaxes of `x` or None), the first three as Float8Storage.layout declares them; the partial
    amaxes (their max is the finite amax of `x`) only with `amax_out=True`.
    """
    M, N = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    # The rowwise storage's buffers (its scale_inv serves both directions) and the columnwise codes.
    if rowwise:
        row, scale_inv = Float8Storage.empty_buffers(("data", "scale_inv"), "rowwise", M, N, x.device, fp8_dtype=fp8_dtype)
    else:
        row, (scale_inv,) = None, Float8Storage.empty_buffers(("scale_inv",), "rowwise", M, N, x.device, fp8_dtype=fp8_dtype)
    col = Float8Storage.empty_buffers(("data",), "columnwise", M, N, x.device, fp8_dtype=fp8_dtype)[0] if columnwise else None
    if scale is None:
        amax = amax.reshape(-1)
    if rows_per_word is None:
        rows_per_word = 4 if M % 4 == 0 else 1
    block_m, block_n, warps = block or _CAST_TILE[rows_per_word]
    grid = (max(triton.cdiv(M, block_m), 1), max(triton.cdiv(N, block_n), 1))
    partials = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x.device) if amax_out else None
    codes = (row if rowwise else col).view(torch.uint8)
    launch(
        _cast_kernel, grid,
        x, scale if scale is not None else scale_inv, amax if scale is None else scale, scale_inv, partials if amax_out else scale_inv,
        codes, (col if columnwise else row).view(torch.uint8),
        M, N, x.stride(0), float(amax_epsilon),
        FP8_MAX=_FP8_MAX[fp8_dtype], E5M2=fp8_dtype == torch.float8_e5m2, ROWWISE=rowwise, COLUMNWISE=columnwise,
        AMAX_PARTS=amax.numel() if scale is None else 0, POW2=force_pow_2_scales, AMAX_OUT=amax_out,
        ROWS_PER_WORD=rows_per_word, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )
    return row, col, scale_inv, partials


@triton.jit
def _delayed_scale_kernel(
    history_ptr, scale_ptr, epsilon, LENGTH: tl.constexpr, BLOCK: tl.constexpr,
    MOST_RECENT: tl.constexpr, FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr, POW2: tl.constexpr,
):
    if MOST_RECENT:
        window_amax = tl.load(history_ptr + LENGTH - 1)
    else:
        offsets = tl.arange(0, BLOCK)
        window_amax = tl.max(tl.load(history_ptr + offsets, mask=offsets < LENGTH, other=-float("inf")), axis=0)
    scale = _scale_from_amax(window_amax, epsilon, FP8_MAX, MARGIN_FACTOR, POW2)
    # Scale 1 until a cast has been recorded (an unrecorded entry holds -1).
    tl.store(scale_ptr, tl.where(window_amax >= 0.0, scale, 1.0))


def delayed_scale(history, fp8_dtype, amax_epsilon, force_pow_2_scales, margin, most_recent):
    """The scale of the next cast from the amax history, as Float8Quantizer.compute_scale."""
    scale = torch.empty((), dtype=torch.float32, device=history.device)
    length = history.numel()
    launch(
        _delayed_scale_kernel, (1,),
        history, scale, float(amax_epsilon), LENGTH=length, BLOCK=triton.next_power_of_2(length),
        MOST_RECENT=most_recent, FP8_MAX=_FP8_MAX[fp8_dtype], MARGIN_FACTOR=2.0**margin, POW2=force_pow_2_scales,
    )
    return scale


@triton.jit
def _record_amax_kernel(history_ptr, partials_ptr, parts, LENGTH: tl.constexpr, BLOCK: tl.constexpr, PART_BLOCK: tl.constexpr):
    # One program: the amax is the max of the partials; every history entry is loaded before any is stored.
    running = tl.zeros((PART_BLOCK,), dtype=tl.float32)
    for start in range(0, parts, PART_BLOCK):
        offsets = start + tl.arange(0, PART_BLOCK)
        running = tl.maximum(running, tl.load(partials_ptr + offsets, mask=offsets < parts, other=0.0))
    offsets = tl.arange(0, BLOCK)
    newer = tl.load(history_ptr + offsets + 1, mask=offsets + 1 < LENGTH)
    newer = tl.where(offsets == LENGTH - 1, tl.max(running, axis=0), newer)
    tl.store(history_ptr + offsets, newer, mask=offsets < LENGTH)


def record_amax(history: torch.Tensor, partials: torch.Tensor) -> None:
    """Drop the oldest entry of `history` and append the max of `partials` (an amax), in place."""
    length = history.numel()
    launch(
        _record_amax_kernel, (1,),
        history, partials, partials.numel(), LENGTH=length, BLOCK=triton.next_power_of_2(length), PART_BLOCK=1024, num_warps=4
    )


@triton.jit
def _dequantize_kernel(data_ptr, scale_inv_ptr, out_ptr, n, E5M2: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    codes = tl.load(data_ptr + offsets, mask=mask, other=0)
    if E5M2:
        values = codes.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    values = values * tl.load(scale_inv_ptr)
    tl.store(out_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`data.float() * scale_inv` rounded once to `out_dtype` (float32 or bfloat16), same shape."""
    data = data.contiguous()
    out = torch.empty(data.shape, dtype=out_dtype, device=data.device)
    n = data.numel()
    if n:
        block = 4096
        launch(
            _dequantize_kernel, (triton.cdiv(n, block),),
            data.view(torch.uint8), scale_inv, out, n, E5M2=data.dtype == torch.float8_e5m2, BLOCK=block, num_warps=8
        )
    return out


_TRANSPOSE_TILE = 64


@triton.jit
def _transpose_kernel(source_ptr, out_ptr, rows, cols, stride_row, stride_col, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = (row[:, None] < rows) & (col[None, :] < cols)
    tile = tl.load(source_ptr + row[:, None] * stride_row + col[None, :] * stride_col, mask=mask)
    # out[c, r] = source[r, c]: the tile written transposed, rows of `out` contiguous.
    tl.store(out_ptr + col[:, None] * stride_out + row[None, :], tl.trans(tile), mask=tl.trans(mask))


def transpose_into(source: torch.Tensor, out: torch.Tensor) -> None:
    """`out.copy_(source.t())`: `source` any 2-D tensor of 1-byte elements, `out` a contiguous
    `[cols, rows]` tensor of the same element size."""
    rows, cols = source.shape
    if out.shape != (cols, rows) or not out.is_contiguous() or source.element_size() != 1 or out.element_size() != 1:
        raise ValueError(
            f"transpose_into writes a contiguous [cols, rows] tensor of 1-byte elements; got source {tuple(source.shape)} "
            f"{source.dtype} and out {tuple(out.shape)} {out.dtype} (contiguous: {out.is_contiguous()})."
        )
    if source.numel() == 0:
        return
    grid = (triton.cdiv(rows, _TRANSPOSE_TILE), triton.cdiv(cols, _TRANSPOSE_TILE))
    launch(
        _transpose_kernel, grid,
        source.view(torch.uint8), out.view(torch.uint8), rows, cols, source.stride(0), source.stride(1), out.stride(0),
        BLOCK=_TRANSPOSE_TILE, num_warps=4,
    )


# Registered into qtensor's kernel table (qtensor_kernels/__init__.py).
KERNELS = {
    "finite_amax": finite_amax,
    "float8.cast": cast,
    "float8.amax_partials": amax_partials,
    "float8.delayed_scale": delayed_scale,
    "float8.record_amax": record_amax,
    "float8.dequantize": dequantize,
    "float8.transpose": transpose_into,
}
