"""Triton kernels of the MXFP8 format (an E8M0 scale per 32 elements), bit-identical to the pure-torch
reference in qtensor/formats/mxfp8.py (docs/numerics.md, MXFP8):

- `cast(x, fp8_dtype, scale_rounding, rowwise, columnwise)`: one read of each tile of `x` gives both
  directions: the rowwise codes with a scale per 32 elements along each row, and the columnwise
  codes (same element order) with a scale per 32 elements down each column.
  With `values`, a direction's bf16 values instead of its codes (what a grouped GEMM multiplies).
- `dequantize(data, codes, direction, out_dtype)`: codes times their block scale, rounded once.
"""

import torch
import triton
import triton.language as tl

from qtensor.formats.mxfp8 import MXFP8Storage
from .launch import launch

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_ELEMENT_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}
_NAN_CODE = tl.constexpr(0x7F)
BLOCK = tl.constexpr(32)


@triton.jit
def _pow2(exponent):
    """2**exponent as fp32, exactly, for int32 exponents in [-149, 127] (numerics.exact_pow2)."""
    normal = (tl.maximum(exponent + 127, 0) << 23).to(tl.float32, bitcast=True)
    subnormal = (tl.full(exponent.shape, 1, tl.int32) << tl.minimum(tl.maximum(exponent + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(exponent >= -126, normal, subnormal)


@triton.jit
def _e8m0(amax, FP8_MAX: tl.constexpr, EMAX: tl.constexpr, RCEIL: tl.constexpr):
    """mxfp8.e8m0_codes: the biased E8M0 code (int32) of each block amax; 255 for NaN/Inf."""
    if RCEIL:
        ratio = amax * (1.0 / FP8_MAX)
        bits = ratio.to(tl.int32, bitcast=True)
        codes = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        codes = tl.where(ratio <= 5.877471754111438e-39, 0, tl.minimum(codes, 254))  # 2**-127
        finite = tl.abs(ratio) < float("inf")
    else:
        # floor(log2(amax)) + 1 (frexp's exponent), subnormal amaxes scaled up by 2**64 first.
        biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        scaled = ((amax * 18446744073709551616.0).to(tl.int32, bitcast=True) >> 23) & 0xFF
        exponent = tl.where(biased == 0, scaled - 126 - 64, biased - 126)
        codes = tl.minimum(tl.maximum(exponent - 1 - EMAX + 127, 0), 254)
        codes = tl.where(amax == 0.0, 0, codes)
        finite = tl.abs(amax) < float("inf")
    return tl.where(finite, codes, 255)


@triton.jit
def _fp8_codes(y, FP8_MAX: tl.constexpr, E5M2: tl.constexpr):
    """numerics.to_fp8_saturating as uint8 codes: clamp to ±max (±Inf too), NaN to the one NaN code."""
    clamped = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))
    if E5M2:
        codes = clamped.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        codes = clamped.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return tl.where(y != y, _NAN_CODE, codes).to(tl.uint8)


@triton.jit
def _block_amax(magnitude, axis: tl.constexpr):
    """max over `axis` of |x| values, NaN when any is NaN (as torch's amax): one integer max over
    the bit patterns, which order non-negative floats as their values and put NaN above +Inf."""
    return tl.max(magnitude.to(tl.int32, bitcast=True), axis=axis).to(tl.float32, bitcast=True)


@triton.jit
def _block_values(codes, scale_codes, E5M2: tl.constexpr):
    """The fp32 values of FP8 `codes` (uint8) times their blocks' decoded scales (broadcast to the
    codes' shape): the dequantize kernel's product, so that values a cast writes are its values."""
    if E5M2:
        values = codes.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return values * _decode(scale_codes)


@triton.jit
def _quantize_rows(x, rows, cols, column_program, data_ptr, codes_ptr, values_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   FP8_MAX: tl.constexpr, EMAX: tl.constexpr, E5M2: tl.constexpr, RCEIL: tl.constexpr, CODES: tl.constexpr, VALUES: tl.constexpr):
    """The rowwise copy of the fp32 tile x [BLOCK_M, BLOCK_N] at (rows, cols), the column_program'th
    tile of its rows: blocks of 32 along each row; with CODES, the codes into data [M, N] and the
    scale codes into codes [M, ceil(N/32)]; with VALUES, the codes' bf16 values into values [M, N]."""
    codes = _e8m0(_block_amax(tl.reshape(tl.abs(x), (BLOCK_M, BLOCK_N // BLOCK, BLOCK)), 2), FP8_MAX, EMAX, RCEIL)
    scale = _pow2(127 - tl.minimum(codes, 254))
    y = tl.reshape(tl.reshape(x, (BLOCK_M, BLOCK_N // BLOCK, BLOCK)) * scale[:, :, None], (BLOCK_M, BLOCK_N))
    inside = rows[:, None] < M
    elements = inside & (cols[None, :] < N)
    fp8 = _fp8_codes(y, FP8_MAX, E5M2)
    if CODES:
        tl.store(data_ptr + rows[:, None] * N + cols[None, :], fp8, mask=elements)
        blocks = column_program * (BLOCK_N // BLOCK) + tl.arange(0, BLOCK_N // BLOCK)
        row_blocks = tl.cdiv(N, BLOCK)
        tl.store(codes_ptr + rows[:, None] * row_blocks + blocks[None, :], codes.to(tl.uint8), mask=inside & (blocks[None, :] < row_blocks))
    if VALUES:
        block_codes = tl.reshape(tl.broadcast_to(codes[:, :, None], (BLOCK_M, BLOCK_N // BLOCK, BLOCK)), (BLOCK_M, BLOCK_N))
        tl.store(values_ptr + rows[:, None] * N + cols[None, :], _block_values(fp8, block_codes, E5M2).to(tl.bfloat16), mask=elements)


@triton.jit
def _cast_kernel(
    x_ptr, row_ptr, row_codes_ptr, row_values_ptr, col_ptr, col_codes_ptr, col_values_ptr, M, N, stride_m,
    FP8_MAX: tl.constexpr, EMAX: tl.constexpr, E5M2: tl.constexpr, RCEIL: tl.constexpr,
    ROW_CODES: tl.constexpr, ROW_VALUES: tl.constexpr, COL_CODES: tl.constexpr, COL_VALUES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    # Partial blocks behave as zero-padded (docs/numerics.md, Non-finite values and partial blocks).
    x = tl.load(x_ptr + offs_m[:, None] * stride_m + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROW_CODES or ROW_VALUES:  # blocks of 32 along each row
        _quantize_rows(x, offs_m, offs_n, tl.program_id(1), row_ptr, row_codes_ptr, row_values_ptr, M, N, BLOCK_M, BLOCK_N,
                       FP8_MAX, EMAX, E5M2, RCEIL, ROW_CODES, ROW_VALUES)
    if COL_CODES or COL_VALUES:  # blocks of 32 down each column; the codes keep the [rows, cols] element order
        codes = _e8m0(_block_amax(tl.reshape(tl.abs(x), (BLOCK_M // BLOCK, BLOCK, BLOCK_N)), 1), FP8_MAX, EMAX, RCEIL)
        scale = _pow2(127 - tl.minimum(codes, 254))
        y = tl.reshape(tl.reshape(x, (BLOCK_M // BLOCK, BLOCK, BLOCK_N)) * scale[:, None, :], (BLOCK_M, BLOCK_N))
        fp8 = _fp8_codes(y, FP8_MAX, E5M2)
        if COL_CODES:
            tl.store(col_ptr + offs_m[:, None] * N + offs_n[None, :], fp8, mask=mask)
            blocks_m = tl.program_id(0) * (BLOCK_M // BLOCK) + tl.arange(0, BLOCK_M // BLOCK)
            block_mask = (blocks_m[:, None] < tl.cdiv(M, BLOCK)) & (offs_n[None, :] < N)
            tl.store(col_codes_ptr + blocks_m[:, None] * N + offs_n[None, :], codes.to(tl.uint8), mask=block_mask)
        if COL_VALUES:
            block_codes = tl.reshape(tl.broadcast_to(codes[:, None, :], (BLOCK_M // BLOCK, BLOCK, BLOCK_N)), (BLOCK_M, BLOCK_N))
            tl.store(col_values_ptr + offs_m[:, None] * N + offs_n[None, :], _block_values(fp8, block_codes, E5M2).to(tl.bfloat16), mask=mask)


def cast(x: torch.Tensor, fp8_dtype: torch.dtype, scale_rounding: str, rowwise: bool, columnwise: bool, block=None, values=(False, False)):
    """((rowwise data, scale codes) or None, (columnwise data, scale codes) or None) of the 2-D
    `x`, shaped as MXFP8Storage.layout declares them, from one read of each tile. A direction that
    `values` (rowwise, columnwise) asks for gives instead the bf16 values of its codes, [M, N] in
    `x`'s element order, without the codes (registered as `mxfp8.cast_values` too: what a grouped
    GEMM multiplies at once)."""
    M, N = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    new = lambda direction: MXFP8Storage.empty_buffers(("data", "scale_inv"), direction, M, N, x.device, fp8_dtype=fp8_dtype)
    as_values = lambda: torch.empty((M, N), dtype=torch.bfloat16, device=x.device)
    row_codes, col_codes = rowwise and not values[0], columnwise and not values[1]
    row = new("rowwise") if row_codes else None
    col = new("columnwise") if col_codes else None
    row_values = as_values() if rowwise and values[0] else None
    col_values = as_values() if columnwise and values[1] else None
    if M and N:
        block_m, block_n, warps = block or _CAST_TILE
        unused = x  # the pointer of what is not written (its branch is compiled out)
        pair = lambda codes: [p.view(torch.uint8) for p in codes] if codes else [unused, unused]
        launch(
            _cast_kernel, (triton.cdiv(M, block_m), triton.cdiv(N, block_n)),
            x, *pair(row), unused if row_values is None else row_values, *pair(col), unused if col_values is None else col_values,
            M, N, x.stride(0),
            FP8_MAX=_FP8_MAX[fp8_dtype], EMAX=_ELEMENT_EMAX[fp8_dtype], E5M2=fp8_dtype == torch.float8_e5m2, RCEIL=scale_rounding == "rceil",
            ROW_CODES=row_codes, ROW_VALUES=row_values is not None, COL_CODES=col_codes, COL_VALUES=col_values is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
        )
    return (row_values if row_values is not None else row), (col_values if col_values is not None else col)


@triton.jit
def _dequantize_kernel(
    data_ptr, codes_ptr, out_ptr, M, N, ALONG_ROWS: tl.constexpr, E5M2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    raw = tl.load(data_ptr + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0)
    if E5M2:
        values = raw.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        values = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    # One scale per block, loaded once and broadcast over its 32 elements.
    if ALONG_ROWS:
        blocks_n = tl.program_id(1) * (BLOCK_N // BLOCK) + tl.arange(0, BLOCK_N // BLOCK)
        row_blocks = tl.cdiv(N, BLOCK)
        codes = tl.load(codes_ptr + offs_m[:, None] * row_blocks + blocks_n[None, :], mask=(offs_m[:, None] < M) & (blocks_n[None, :] < row_blocks), other=127)
        scale = _decode(codes.to(tl.int32))
        values = tl.reshape(tl.reshape(values, (BLOCK_M, BLOCK_N // BLOCK, BLOCK)) * scale[:, :, None], (BLOCK_M, BLOCK_N))
    else:
        blocks_m = tl.program_id(0) * (BLOCK_M // BLOCK) + tl.arange(0, BLOCK_M // BLOCK)
        codes = tl.load(codes_ptr + blocks_m[:, None] * N + offs_n[None, :], mask=(blocks_m[:, None] < tl.cdiv(M, BLOCK)) & (offs_n[None, :] < N), other=127)
        scale = _decode(codes.to(tl.int32))
        values = tl.reshape(tl.reshape(values, (BLOCK_M // BLOCK, BLOCK, BLOCK_N)) * scale[:, None, :], (BLOCK_M, BLOCK_N))
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], values.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode(codes):
    """mxfp8.decode_scales: 2**(code - 127), NaN for 255."""
    return tl.where(codes == 255, float("nan"), _pow2(tl.minimum(codes, 254) - 127))


# (BLOCK_M, BLOCK_N, warps) of the cast and the dequantize (benchmarks/sweep_cast.py --mxfp8).
_CAST_TILE = (32, 128, 2)  # 54% of the copy bandwidth on an H200 ((32, 128, 4): 47%, (64, 64, 4): 41%)
_DEQUANTIZE_TILE = (64, 256, 8)  # 81% of the copy bandwidth on an H200


def dequantize(data: torch.Tensor, codes: torch.Tensor, along_rows: bool, out_dtype: torch.dtype, block=None) -> torch.Tensor:
    """`data` [M, N] times the block scales (along rows, or down columns), rounded once to `out_dtype`."""
    M, N = data.shape
    out = torch.empty((M, N), dtype=out_dtype, device=data.device)
    block_m, block_n, warps = block or _DEQUANTIZE_TILE
    if M and N:
        launch(
            _dequantize_kernel, (triton.cdiv(M, block_m), triton.cdiv(N, block_n)),
            data.contiguous().view(torch.uint8), codes.contiguous(), out, M, N,
            ALONG_ROWS=along_rows, E5M2=data.dtype == torch.float8_e5m2, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
        )
    return out


# Registered into qtensor's kernel table (qtensor_kernels/__init__.py).
KERNELS = {"mxfp8.cast": cast, "mxfp8.cast_values": cast, "mxfp8.dequantize": dequantize}
