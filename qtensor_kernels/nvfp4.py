"""Triton kernels of the NVFP4 format (E2M1 elements, an E4M3 scale per 16 elements, an fp32 tensor
scale), bit-identical to the pure-torch reference in qtensor/formats/nvfp4.py (DESIGN.md §2 "NVFP4"):

- `amaxes(x)`: the finite amax of `x` and of its columnwise copy after the Hadamard transform, from
  one read (without the transform, the Float8 kernels' `finite_amax` gives the one amax).
- `cast(x, global_amax, column_amax, keys, rowwise, columnwise, block_2d, rht)`: one read of each
  tile of `x` gives both directions: the rowwise codes (blocks of 16 along each row) and the
  columnwise codes of the transposed tile (blocks of 16 down each column, after the transform with
  `rht`), rounding to nearest even or, given `keys`, stochastically with the reference's draws.
- `dequantize(data, scale_inv, length, out_dtype, global_amax=None)`: codes times their block
  scale, times 1/S_enc when `global_amax` is given, rounded once to `out_dtype`.

Every conversion to and from E4M3 and E2M1 is integer arithmetic on the bit patterns, so nothing
depends on the device's conversion instructions; every division is IEEE round-to-nearest, and the
kernels are compiled without fused multiply-adds (each product is rounded, as in the reference).
"""

import torch
import triton
import triton.language as tl

from qtensor.formats.nvfp4 import _MIX_MULTIPLIERS, _RHT_NEGATIVE_MASK

from .float8 import _like
from .mxfp8 import _block_amax, _pow2

BLOCK = tl.constexpr(16)
_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_ONE_SIXTH = tl.constexpr(torch.tensor(1 / 6, dtype=torch.float32).item())  # fp32(1/6), as the reference
_E4M3_NAN = tl.constexpr(0x7F)
_SIGNS_NEGATIVE = tl.constexpr(_RHT_NEGATIVE_MASK)
_MIX_A = tl.constexpr(_MIX_MULTIPLIERS[0])
_MIX_B = tl.constexpr(_MIX_MULTIPLIERS[1])


# ---- numerics ------------------------------------------------------------------------------------
@triton.jit
def _encode_scale(global_amax):
    """nvfp4.encode_scale: (448 * 6) / global_amax; 1 for 0, FLT_MAX when it overflows."""
    scale = tl.div_rn(_like(2688.0, global_amax), global_amax)
    scale = tl.where(scale == float("inf"), _FLT_MAX, scale)
    return tl.where(global_amax == 0.0, 1.0, scale)


@triton.jit
def _e4m3_saturating(v):
    """numerics.to_fp8_saturating(v, E4M3) for v >= 0 or NaN, as (the fp32 value, the code): clamped
    at 448, rounded to nearest even on E4M3's grid (3 mantissa bits; steps of 2**-9 below 2**-6)."""
    v = tl.where(v > 448.0, 448.0, v)  # +Inf too; NaN stays
    bits = v.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    significand = (bits & 0x7FFFFF) | 0x800000
    drop = tl.maximum(14 - exponent, 20)  # significand bits below the grid; above 24 the value rounds to 0
    shift = tl.minimum(drop, 24)
    kept = significand >> shift
    rest = significand - (kept << shift)
    half = (kept * 0 + 1) << (shift - 1)
    kept += ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int32)
    kept = tl.where(drop > 24, 0, kept)
    value = kept.to(tl.float32) * _pow2(exponent - 23 + shift)
    # The code: the subnormal multiple of 2**-9, or the biased exponent and 3 mantissa bits.
    value_bits = value.to(tl.int32, bitcast=True)
    normal_code = ((((value_bits >> 23) & 0xFF) - 120) << 3) | ((value_bits >> 20) & 7)
    code = tl.where(value >= 0.015625, normal_code, (value * 512.0).to(tl.int32))
    nan = v != v
    return tl.where(nan, v, value), tl.where(nan, _E4M3_NAN, code)


@triton.jit
def _e4m3_value(code):
    """The fp32 value of an E4M3 code (int32); NaN for 0x7F and 0xFF."""
    exponent = (code >> 3) & 0xF
    mantissa = code & 7
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, (mantissa + 8).to(tl.float32) * _pow2(exponent - 10))
    value = tl.where((code & 0x80) != 0, magnitude * -1.0, magnitude)  # not -x: Triton negates as 0 - x, losing -0
    return tl.where((code & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _e2m1_magnitude(code):
    """nvfp4.E2M1_GRID[code] for codes 0..7 (int32): m/2, or 2**(e-1) * (1 + m/2)."""
    exponent = code >> 1
    mantissa = (code & 1).to(tl.float32)
    return tl.where(exponent == 0, mantissa * 0.5, (2.0 + mantissa) * _pow2(exponent - 2))


@triton.jit
def _e2m1_nearest(magnitude):
    """nvfp4.e2m1_codes_nearest without the sign: count the bounds passed (ties to the even code)."""
    codes = (magnitude > 0.25).to(tl.int32) + (magnitude >= 0.75).to(tl.int32)
    codes += (magnitude > 1.25).to(tl.int32) + (magnitude >= 1.75).to(tl.int32)
    codes += (magnitude > 2.5).to(tl.int32) + (magnitude >= 3.5).to(tl.int32)
    return codes + (magnitude > 5.0).to(tl.int32)


@triton.jit
def _e2m1_stochastic(magnitude, draws):
    """nvfp4.e2m1_codes_stochastic without the sign."""
    magnitude = tl.where(magnitude > 6.0, 6.0, magnitude)  # NaN stays
    lower = (magnitude >= 0.5).to(tl.int32) + (magnitude >= 1.0).to(tl.int32) + (magnitude >= 1.5).to(tl.int32)
    lower += (magnitude >= 2.0).to(tl.int32) + (magnitude >= 3.0).to(tl.int32)
    lower += (magnitude >= 4.0).to(tl.int32) + (magnitude >= 6.0).to(tl.int32)
    # The gap to the next grid value is 0.5 (codes 0-3), 1 (4, 5), 2 (6) or none (7): a power of two,
    # so multiplying by its reciprocal is the reference's division, exactly.
    inverse_gap = tl.where(lower < 4, 2.0, tl.where(lower < 6, 1.0, 0.5))
    probability_up = tl.where(lower < 7, (magnitude - _e2m1_magnitude(lower)) * inverse_gap, 0.0)
    return lower + (draws < probability_up).to(tl.int32)


@triton.jit
def _mix32(h):
    """nvfp4.mix32 on uint32."""
    h = ((h ^ (h >> 16)) * _MIX_A).to(tl.uint32)
    h = ((h ^ (h >> 15)) * _MIX_B).to(tl.uint32)
    return h ^ (h >> 15)


@triton.jit
def _draws(keys_ptr, rows, cols, row_length):
    """nvfp4.uniform_draws at the elements (rows[:, None], cols[None, :]) of a matrix whose rows hold
    `row_length` elements, under the keys at keys_ptr (k0, k1)."""
    k0 = tl.load(keys_ptr).to(tl.uint32)
    k1 = tl.load(keys_ptr + 1).to(tl.uint32)
    index = rows[:, None].to(tl.int64) * row_length + cols[None, :]
    low = (index & 0xFFFFFFFF).to(tl.uint32)
    high = (index >> 32).to(tl.uint32)
    bits = _mix32(_mix32(low ^ k0) ^ high ^ k1)
    return (bits >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


@triton.jit
def _butterfly(x, R: tl.constexpr, C: tl.constexpr, HALF: tl.constexpr):
    """One stage of nvfp4.hadamard16: in each group of 2*HALF, (a, b) → (a + b, a - b) for a in
    the first half and b its partner HALF further on."""
    pairs = tl.permute(tl.reshape(x, (R, C // (2 * HALF), 2, HALF)), (0, 1, 3, 2))
    first, second = tl.split(pairs)
    return tl.reshape(tl.permute(tl.join(first + second, first - second), (0, 1, 3, 2)), (R, C))


@triton.jit
def _hadamard_runs(x, R: tl.constexpr, C: tl.constexpr):
    """nvfp4.apply_rht on each run of 16 along the last dim of x [R, C]: the Walsh-Hadamard butterfly
    in the reference's order of additions, then * 1/4, the signs, and -0 made +0."""
    x = _butterfly(_butterfly(_butterfly(_butterfly(x, R, C, 1), R, C, 2), R, C, 4), R, C, 8)
    negative = ((tl.full((C,), _SIGNS_NEGATIVE, tl.int32) >> (tl.arange(0, C) % 16)) & 1) == 1
    x = x * 0.25
    x = tl.where(negative[None, :], x * -1.0, x)
    return tl.where(x == 0.0, 0.0, x)


@triton.jit
def _quantize_blocks(x, amax, s_enc, keys_ptr, rows, cols, row_length, R: tl.constexpr, C: tl.constexpr, STOCHASTIC: tl.constexpr, WORDS: tl.constexpr):
    """nvfp4.quantize_row_blocks of the fp32 tile x [R, C] given its block amaxes [R, C/16]: the E2M1
    codes, packed two per byte (element 2i in the low nibble), as one 64-bit word per block [R, C/16]
    (WORDS) or as bytes [R, C/2]; and the E4M3 scale codes [R, C/16]."""
    wanted = amax * (s_enc * _ONE_SIXTH)
    scale, scale_code = _e4m3_saturating(tl.where(amax < float("inf"), wanted, float("nan")))  # NaN/Inf blocks: NaN
    decode = scale * tl.div_rn(_like(1.0, s_enc), s_enc)
    encode = tl.div_rn(_like(1.0, decode), decode)
    encode = tl.where(encode > _FLT_MAX, _FLT_MAX, encode)
    scaled = tl.reshape(x, (R, C // 16, 16)) * encode[:, :, None]
    magnitude = tl.abs(scaled)
    if STOCHASTIC:
        draws = tl.reshape(_draws(keys_ptr, rows, cols, row_length), (R, C // 16, 16))
        codes = _e2m1_stochastic(magnitude, draws)
    else:
        codes = _e2m1_nearest(magnitude)
    codes = codes | (((scaled.to(tl.int32, bitcast=True) >> 31) & (scaled == scaled).to(tl.int32)) << 3)  # _sign_bit
    if WORDS:  # the block's 16 nibbles in one word: disjoint bit fields, so the sum is their OR
        shifts = (tl.arange(0, 16) * 4).to(tl.int64)
        packed = tl.sum(codes.to(tl.int64) << shifts[None, None, :], axis=2)
    else:
        low, high = tl.split(tl.reshape(codes, (R, C // 2, 2)))
        packed = (low | (high << 4)).to(tl.uint8)
    return packed, scale_code.to(tl.uint8)


@triton.jit
def _tile_amax(magnitude, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """nvfp4.tile_amax: max |x| of each 16x16 tile, [BLOCK_M/16, BLOCK_N/16], NaN when any is NaN."""
    per_row = _block_amax(tl.reshape(magnitude, (BLOCK_M // 16, 16, BLOCK_N // 16, 16)), 3)
    return _block_amax(per_row, 1)


@triton.jit
def _spread(tiles, A: tl.constexpr, B: tl.constexpr):
    """[A/16, B/16] tile values as the block amaxes [A, B/16] of the A rows they cover."""
    return tl.reshape(tl.broadcast_to(tiles[:, None, :], (A // 16, 16, B // 16)), (A, B // 16))


@triton.jit
def _cast_kernel(
    x_ptr, M, N, stride_m, row_amax_ptr, col_amax_ptr, keys_ptr,
    row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, col_length,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, BLOCK_2D: tl.constexpr, RHT: tl.constexpr,
    STOCHASTIC: tl.constexpr, ROW_WORDS: tl.constexpr, COL_WORDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Partial blocks, and the rows the transform pads to a multiple of 16, are zeros (DESIGN.md §2).
    x = tl.load(x_ptr + offs_m[:, None] * stride_m + offs_n[None, :], mask=(offs_m[:, None] < M) & (offs_n[None, :] < N), other=0.0).to(tl.float32)
    if BLOCK_2D:
        tiles = _tile_amax(tl.abs(x), BLOCK_M, BLOCK_N)
    if ROWWISE:  # blocks of 16 along each row
        if BLOCK_2D:
            amax = _spread(tiles, BLOCK_M, BLOCK_N)
        else:
            amax = _block_amax(tl.reshape(tl.abs(x), (BLOCK_M, BLOCK_N // 16, 16)), 2)
        s_enc = _encode_scale(tl.load(row_amax_ptr))
        packed, scales = _quantize_blocks(x, amax, s_enc, keys_ptr, offs_m, offs_n, N, BLOCK_M, BLOCK_N, STOCHASTIC, ROW_WORDS)
        _store_rows(row_data_ptr, row_scale_ptr, packed, scales, offs_m, tl.program_id(1), M, N, BLOCK_M, BLOCK_N, ROW_WORDS)
    if COLUMNWISE:  # the transposed tile, blocks of 16 down each column of x
        xt = tl.trans(x)
        if RHT:
            xt = _hadamard_runs(xt, BLOCK_N, BLOCK_M)
        if BLOCK_2D:
            amax = _spread(tl.trans(tiles), BLOCK_N, BLOCK_M)
        else:
            amax = _block_amax(tl.reshape(tl.abs(xt), (BLOCK_N, BLOCK_M // 16, 16)), 2)
        s_enc = _encode_scale(tl.load(col_amax_ptr))
        packed, scales = _quantize_blocks(xt, amax, s_enc, keys_ptr + 2, offs_n, offs_m, col_length, BLOCK_N, BLOCK_M, STOCHASTIC, COL_WORDS)
        _store_rows(col_data_ptr, col_scale_ptr, packed, scales, offs_n, tl.program_id(0), N, col_length, BLOCK_N, BLOCK_M, COL_WORDS)


@triton.jit
def _store_rows(data_ptr, scale_ptr, packed, scales, rows, column_program, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, WORDS: tl.constexpr):
    """Store a tile's packed codes into data [R, ceil(C/2)] (as words [R, C/16] with WORDS) and its
    scales into scale [R, ceil(C/16)]."""
    row_bytes, row_blocks = tl.cdiv(C, 2), tl.cdiv(C, 16)
    block_cols = column_program * (BLOCK_C // 16) + tl.arange(0, BLOCK_C // 16)
    block_mask = (rows[:, None] < R) & (block_cols[None, :] < row_blocks)
    if WORDS:
        tl.store(data_ptr + rows[:, None] * row_blocks + block_cols[None, :], packed, mask=block_mask)
    else:
        byte_cols = column_program * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
        tl.store(data_ptr + rows[:, None] * row_bytes + byte_cols[None, :], packed, mask=(rows[:, None] < R) & (byte_cols[None, :] < row_bytes))
    tl.store(scale_ptr + rows[:, None] * row_blocks + block_cols[None, :], scales, mask=block_mask)


# (BLOCK_M, BLOCK_N, warps) of the cast (by whether it transforms) and of the dequantize: the fastest
# of benchmarks/sweep_cast.py --nvfp4 on an H200 at 8192x8192 bf16.
_CAST_TILE = {False: (64, 32, 4), True: (64, 64, 8)}
_DEQUANTIZE_TILE = (32, 256, 4)
_AMAXES_TILE = (32, 64, 4)


def _as_words(pair, length):
    """(data, scales) with the data viewed as one int64 word per block where rows hold whole blocks."""
    return (pair[0].view(torch.int64) if length % 16 == 0 else pair[0]), pair[1]


def cast(x, global_amax, column_amax, keys, rowwise, columnwise, block_2d, rht, block=None):
    """((rowwise data [M, ceil(N/2)], scales [M, ceil(N/16)]) or None, (columnwise data
    [N, ceil(L/2)], scales [N, ceil(M/16)]) or None) of the 2-D `x`, L being M, or M padded to a
    multiple of 16 with `rht`; the scale codes as float8_e4m3fn."""
    M, N = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    device = x.device
    col_length = -(-M // 16) * 16 if rht else M
    new = lambda r, c: (torch.empty((r, -(-c // 2)), dtype=torch.uint8, device=device), torch.empty((r, -(-c // 16)), dtype=torch.uint8, device=device))
    row = new(M, N) if rowwise else None
    col = new(N, col_length) if columnwise else None
    if M and N:
        block_m, block_n, warps = block or _CAST_TILE[rht and columnwise]
        some = row or col
        _cast_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
            x, M, N, x.stride(0), global_amax, column_amax, keys if keys is not None else global_amax,
            *(_as_words(row, N) if row else some), *(_as_words(col, col_length) if col else some), col_length,
            ROWWISE=rowwise, COLUMNWISE=columnwise, BLOCK_2D=block_2d, RHT=rht, STOCHASTIC=keys is not None,
            ROW_WORDS=N % 16 == 0, COL_WORDS=col_length % 16 == 0,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, enable_fp_fusion=False,
        )
    as_scales = lambda pair: None if pair is None else (pair[0], pair[1].view(torch.float8_e4m3fn))
    return as_scales(row), as_scales(col)


@triton.jit
def _amaxes_kernel(x_ptr, M, N, stride_m, partials_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program p writes the finite max |x| of its tile at partials[p] and that of the tile's
    transformed columns (runs of 16 rows, zero-padded past M) at partials[programs + p]."""
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    x = tl.load(x_ptr + offs_m[:, None] * stride_m + offs_n[None, :], mask=(offs_m[:, None] < M) & (offs_n[None, :] < N), other=0.0).to(tl.float32)
    program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    programs = tl.num_programs(0) * tl.num_programs(1)
    magnitude = tl.abs(x)
    tl.store(partials_ptr + program, tl.max(tl.max(tl.where(magnitude < float("inf"), magnitude, 0.0), axis=1), axis=0))
    transformed = tl.abs(_hadamard_runs(tl.trans(x), BLOCK_N, BLOCK_M))
    tl.store(partials_ptr + programs + program, tl.max(tl.max(tl.where(transformed < float("inf"), transformed, 0.0), axis=1), axis=0))


def amaxes(x: torch.Tensor, block=_AMAXES_TILE):
    """(finite amax of x, finite amax of its transformed columnwise copy), 0-d fp32 each."""
    M, N = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    block_m, block_n, warps = block
    grid = (max(triton.cdiv(M, block_m), 1), max(triton.cdiv(N, block_n), 1))
    partials = torch.zeros((2, grid[0] * grid[1]), dtype=torch.float32, device=x.device)
    if M and N:
        _amaxes_kernel[grid](x, M, N, x.stride(0), partials, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, enable_fp_fusion=False)
    both = partials.amax(dim=1)
    return both[0], both[1]


@triton.jit
def _dequantize_kernel(data_ptr, scale_ptr, amax_ptr, out_ptr, R, C, TENSOR_SCALE: tl.constexpr, WORDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_bytes, row_blocks = tl.cdiv(C, 2), tl.cdiv(C, 16)
    byte_cols = tl.program_id(1) * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
    block_cols = tl.program_id(1) * (BLOCK_C // 16) + tl.arange(0, BLOCK_C // 16)
    block_mask = (rows[:, None] < R) & (block_cols[None, :] < row_blocks)
    if WORDS:  # one 64-bit word per block: nibble j is element j
        words = tl.load(data_ptr + rows[:, None] * row_blocks + block_cols[None, :], mask=block_mask, other=0)
        shifts = (tl.arange(0, 16) * 4).to(tl.int64)
        codes = tl.reshape(((words[:, :, None] >> shifts[None, None, :]) & 0xF).to(tl.int32), (BLOCK_R, BLOCK_C))
    else:
        packed = tl.load(data_ptr + rows[:, None] * row_bytes + byte_cols[None, :], mask=(rows[:, None] < R) & (byte_cols[None, :] < row_bytes), other=0).to(tl.int32)
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_R, BLOCK_C))
    magnitude = _e2m1_magnitude(codes & 7)
    q = tl.where((codes & 8) != 0, magnitude * -1.0, magnitude)  # -0 for code 8 (not 0 - x)
    scale_codes = tl.load(scale_ptr + rows[:, None] * row_blocks + block_cols[None, :], mask=block_mask, other=0)
    scale = _e4m3_value(scale_codes.to(tl.int32))
    values = tl.reshape(tl.reshape(q, (BLOCK_R, BLOCK_C // 16, 16)) * scale[:, :, None], (BLOCK_R, BLOCK_C))
    if TENSOR_SCALE:
        s_enc = _encode_scale(tl.load(amax_ptr))
        values = values * tl.div_rn(_like(1.0, s_enc), s_enc)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], values.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < R) & (cols[None, :] < C))


def dequantize(data, scale_inv, length: int, out_dtype: torch.dtype, global_amax=None, block=None) -> torch.Tensor:
    """[R, length] values of packed codes `data` [R, ceil(length/2)] with E4M3 block scales
    `scale_inv` [R, ceil(length/16)]: q * float(s), times 1/S_enc when `global_amax` is given (the
    reference's order), rounded once to `out_dtype`."""
    R = data.shape[0]
    out = torch.empty((R, length), dtype=out_dtype, device=data.device)
    block_r, block_c, warps = block or _DEQUANTIZE_TILE
    if R and length:
        _dequantize_kernel[(triton.cdiv(R, block_r), triton.cdiv(length, block_c))](
            _as_words((data.contiguous(), None), length)[0], scale_inv.contiguous().view(torch.uint8), global_amax if global_amax is not None else data, out, R, length,
            TENSOR_SCALE=global_amax is not None, WORDS=length % 16 == 0, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps, enable_fp_fusion=False,
        )
    return out
