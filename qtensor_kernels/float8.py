"""Triton kernels of the Float8 format (one fp32 scale per tensor), bit-identical to the pure-torch
reference in qtensor/formats/float8.py and qtensor/numerics.py (DESIGN.md §2 "Float8"):

- `finite_amax(x)`: max|x| over the finite values, into a 0-d fp32 tensor, with no host sync.
- `cast(x, scale, fp8_dtype, rowwise, columnwise)`: one pass over `x` that writes the rowwise codes
  `[M, N]` and the transposed columnwise codes `[N, M]` (the layout the FP8 GEMMs read).
- `dequantize(data, scale_inv, out_dtype)`: codes times the scale, rounded once to `out_dtype`.
"""

import torch
import triton
import triton.language as tl

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_NAN_CODE = tl.constexpr(0x7F)  # the one NaN code qtensor writes (numerics.FP8_NAN_CODE)


@triton.jit
def _finite_amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr):
    start = tl.program_id(0) * BLOCK * BLOCKS_PER_PROGRAM
    running = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(BLOCKS_PER_PROGRAM):
        offsets = start + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
        magnitude = tl.abs(x)
        finite = magnitude < float("inf")  # false for Inf and NaN
        running = tl.maximum(running, tl.where(finite, magnitude, 0.0))
    tl.atomic_max(amax_ptr, tl.max(running, axis=0))


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    n = x.numel()
    if n == 0:
        return amax
    x = x.contiguous()
    block, per_program = 4096, 8
    grid = (triton.cdiv(n, block * per_program),)
    _finite_amax_kernel[grid](x, amax, n, BLOCK=block, BLOCKS_PER_PROGRAM=per_program, num_warps=8)
    return amax


@triton.jit
def _cast_kernel(
    x_ptr, scale_ptr, row_ptr, col_ptr, M, N, stride_m,
    FP8_MAX: tl.constexpr, E5M2: tl.constexpr, ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    x = tl.load(x_ptr + offs_m[:, None] * stride_m + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    y = x * tl.load(scale_ptr)
    # Saturate (comparisons are false for NaN, which stays NaN; ±Inf products clamp).
    y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))
    if E5M2:
        codes = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
        codes = tl.where(x == float("inf"), 0x7C, tl.where(x == -float("inf"), 0xFC, codes))
        codes = tl.where(y != y, _NAN_CODE, codes)
    else:  # E4M3 has no Inf: an infinite input becomes NaN
        codes = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        codes = tl.where((y != y) | (tl.abs(x) == float("inf")), _NAN_CODE, codes)
    codes = codes.to(tl.uint8)
    if ROWWISE:
        tl.store(row_ptr + offs_m[:, None] * N + offs_n[None, :], codes, mask=mask)
    if COLUMNWISE:
        tl.store(col_ptr + offs_n[:, None] * M + offs_m[None, :], tl.trans(codes), mask=tl.trans(mask))


def cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool):
    """(rowwise codes [M, N] or None, columnwise codes [N, M] or None) of the 2-D `x` at `scale`."""
    M, N = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    row = torch.empty((M, N), dtype=fp8_dtype, device=x.device) if rowwise else None
    col = torch.empty((N, M), dtype=fp8_dtype, device=x.device) if columnwise else None
    if M and N:
        block_m, block_n = 64, 128
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
        _cast_kernel[grid](
            x, scale, (row if rowwise else col).view(torch.uint8), (col if columnwise else row).view(torch.uint8),
            M, N, x.stride(0),
            FP8_MAX=_FP8_MAX[fp8_dtype], E5M2=fp8_dtype == torch.float8_e5m2, ROWWISE=rowwise, COLUMNWISE=columnwise,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8,
        )
    return row, col


@triton.jit
def _dequantize_kernel(data_ptr, scale_inv_ptr, out_ptr, n, E5M2: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
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
        _dequantize_kernel[(triton.cdiv(n, block),)](
            data.view(torch.uint8), scale_inv, out, n, E5M2=data.dtype == torch.float8_e5m2, BLOCK=block, num_warps=8
        )
    return out
