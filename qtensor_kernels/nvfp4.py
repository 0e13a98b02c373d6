"""Triton kernels of the NVFP4 format (E2M1 elements, an E4M3 scale per 16 elements, an fp32 tensor
scale), bit-identical to the pure-torch reference in qtensor/formats/nvfp4.py (docs/numerics.md, NVFP4):

- `amaxes(x)`: the finite amax of `x` and of its columnwise copy after the Hadamard transform, from
  one read (without the transform, the Float8 kernels' `finite_amax` gives the one amax).
- `cast(x, global_amax, column_amax, keys, rowwise, columnwise, block_2d, rht)`: one read of each
  tile of `x` gives both directions: the rowwise codes (blocks of 16 along each row) and the
  columnwise codes of the transposed tile (blocks of 16 down each column, after the transform with
  `rht`), rounding to nearest even or, given `keys`, stochastically with the reference's draws.
- `dequantize(data, scale_inv, length, out_dtype, global_amax=None)`: codes times their block
  scale, times 1/S_enc when `global_amax` is given, rounded once to `out_dtype`.

The layout: a cast tile is 16 rows, each thread holding VEC adjacent columns of all 16 (`_load_tile`),
so a column's block of 16, and the Hadamard transform down it, are one thread's registers, and a
row's block spans 16/VEC adjacent threads; nothing goes through shared memory but the stores.

The numerics: E2M1 rounding is exact floating-point arithmetic (`_e2m1_nearest`,
`_e2m1_stochastic`), the block scale's rounding to E4M3 is the device's conversion (round to
nearest even, as torch's), decoding is integer arithmetic on the bit patterns; every division is
IEEE round-to-nearest, and the kernels are compiled without fused multiply-adds (each product is
rounded, as in the reference).
"""

import torch
import triton
import triton.language as tl

from qtensor.formats.nvfp4 import _RHT_NEGATIVE_MASK, NVFP4Storage
from qtensor.formats.nvfp4_draws import _MIX_MULTIPLIERS

from .float8 import _like
from .mxfp8 import _block_amax, _pow2
from .launch import launch

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
def _e4m3_value(code):
    """The fp32 value of an E4M3 code (int32); NaN for 0x7F and 0xFF."""
    exponent = (code >> 3) & 0xF
    mantissa = code & 7
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, (mantissa + 8).to(tl.float32) * _pow2(exponent - 10))
    value = tl.where((code & 0x80) != 0, magnitude * -1.0, magnitude)  # not -x: Triton negates as 0 - x, losing -0
    return tl.where((code & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _code_values(codes):
    """The fp32 values of E2M1 codes (int32, sign in bit 3): the magnitude bits at fp32's bits 22-24
    make q * 2**-126 (E2M1's exponent bias is 1; 0.5 lands on the subnormal 2**-127), the sign bit
    at bit 31 (-0 for code 8)."""
    return (((codes & 7) << 22) | ((codes & 8) << 28)).to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2**126


@triton.jit
def _e2m1_nearest(magnitude):
    """nvfp4.e2m1_codes_nearest without the sign, for magnitudes of blocks without NaN (the caller
    zeroes a NaN block's codes), in floating-point arithmetic rather than comparisons: adding and
    subtracting 1.5 * 2**(e + 22), e = max(floor(log2 m), 0), whose ulp is the grid's step at m,
    rounds m to nearest even on the grid; saturated at 6, the value times 2**-126 has E2M1's biased
    exponent and mantissa bit in fp32's bits 23-24 and 22 (0.5 becomes the subnormal 2**-127)."""
    m = tl.minimum(magnitude, 8.0)
    magic = (tl.maximum(m.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000) + 0x0B400000).to(tl.float32, bitcast=True)
    value = tl.minimum((m + magic) - magic, 6.0)
    return (value * 1.1754943508222875e-38).to(tl.int32, bitcast=True) >> 22  # 2**-126


@triton.jit
def _e2m1_stochastic(magnitude, draws):
    """nvfp4.e2m1_codes_stochastic without the sign, for magnitudes of blocks without NaN: the grid
    value at or below m (_e2m1_nearest's rounding, one step down where it went up), and one code
    up where the draw is below (m - lower) / step. The step is a power of two (2**(e-1), e as in
    _e2m1_nearest), so both the subtraction and the division by it are exact, as in the reference."""
    m = tl.minimum(magnitude, 6.0)
    exponent_bits = tl.maximum(m.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000)
    magic = (exponent_bits + 0x0B400000).to(tl.float32, bitcast=True)
    nearest = (m + magic) - magic
    step_bits = exponent_bits - 0x00800000
    lower = tl.where(nearest > m, nearest - step_bits.to(tl.float32, bitcast=True), nearest)
    probability_up = (m - lower) * (0x7F000000 - step_bits).to(tl.float32, bitcast=True)  # * 1/step
    up = (draws < probability_up).to(tl.int32)
    return ((lower * 1.1754943508222875e-38).to(tl.int32, bitcast=True) >> 22) + up  # 2**-126, as _e2m1_nearest


@triton.jit
def _mix32(h):
    """nvfp4_draws.mix32 on uint32."""
    h = ((h ^ (h >> 16)) * _MIX_A).to(tl.uint32)
    h = ((h ^ (h >> 15)) * _MIX_B).to(tl.uint32)
    return h ^ (h >> 15)


@triton.jit
def _pair_draws(keys_ptr, row, pair, pairs_per_row, WIDE: tl.constexpr):
    """nvfp4_draws.uniform_draws of the pairs `pair` of rows `row` (broadcast together), under the keys at
    keys_ptr (k0, k1): (the draws of their first elements, of their second). Unless WIDE, every
    pair index is below 2**32: it is computed in 32 bits and its high word is 0."""
    k0 = tl.load(keys_ptr).to(tl.uint32)
    k1 = tl.load(keys_ptr + 1).to(tl.uint32)
    if WIDE:
        index = row.to(tl.int64) * pairs_per_row + pair
        low = (index & 0xFFFFFFFF).to(tl.uint32)
        high = _mix32((index >> 32).to(tl.uint32) ^ k1)
    else:
        low = row.to(tl.uint32) * pairs_per_row + pair.to(tl.uint32)  # (pairs_per_row may be a constant 1)
        high = _mix32(k1)
    h = _mix32(low ^ k0 ^ high)
    # Each 16-bit half n as an fp32 integer without a conversion instruction: (2**23 + n) - 2**23.
    first = ((h & 0xFFFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    second = ((h >> 16) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return first * 1.52587890625e-05, second * 1.52587890625e-05  # 2**-16


@triton.jit
def _block_encode(amax, s_enc):
    """(the E4M3 scale code (int32), the fp32 factor that scales the elements) of each block amax:
    nvfp4.quantize_row_blocks up to the element codes."""
    # numerics.to_fp8_saturating by the device's conversion (round to nearest even, subnormals
    # included): clamped at 448 first; NaN/Inf blocks get the NaN scale.
    finite = amax < float("inf")
    code = tl.minimum(tl.where(finite, amax * (s_enc * _ONE_SIXTH), 0.0), 448.0).to(tl.float8e4nv)
    scale = tl.where(finite, code.to(tl.float32), float("nan"))
    scale_code = tl.where(finite, code.to(tl.uint8, bitcast=True).to(tl.int32), _E4M3_NAN)
    decode = scale * tl.div_rn(_like(1.0, s_enc), s_enc)
    encode = tl.div_rn(_like(1.0, decode), decode)
    return scale_code, tl.where(encode > _FLT_MAX, _FLT_MAX, encode)


@triton.jit
def _e2m1_codes(scaled, draws, STOCHASTIC: tl.constexpr):
    """E2M1 codes (int32, sign in bit 3) of the scaled elements of blocks without NaN; stochastically
    with `draws` (uniform_draws) of the same shape."""
    magnitude = tl.abs(scaled)
    if STOCHASTIC:
        codes = _e2m1_stochastic(magnitude, draws)
    else:
        codes = _e2m1_nearest(magnitude)
    return codes | ((scaled.to(tl.int32, bitcast=True) >> 28) & 8)  # _sign_bit (NaN blocks are zeroed after)


@triton.jit
def _butterfly(x, C: tl.constexpr, HALF: tl.constexpr):
    """One stage of nvfp4.hadamard16 down the columns of x [16, C]: in each group of 2*HALF rows,
    (a, b) → (a + b, a - b) for a in the first half and b its partner HALF rows further on."""
    pairs = tl.permute(tl.reshape(x, (16 // (2 * HALF), 2, HALF, C)), (0, 2, 3, 1))
    first, second = tl.split(pairs)
    return tl.reshape(tl.permute(tl.join(first + second, first - second), (0, 3, 1, 2)), (16, C))


@triton.jit
def _hadamard_columns(x, C: tl.constexpr):
    """nvfp4.apply_rht down each column of the tile x [16, C] (its runs of 16 are the columns): the
    Walsh-Hadamard butterfly in the reference's order of additions, then * 1/4, the signs, and -0
    made +0. Each thread holds whole columns, so this is arithmetic on its own registers."""
    x = _butterfly(_butterfly(_butterfly(_butterfly(x, C, 1), C, 2), C, 4), C, 8)
    negative = ((tl.full((16,), _SIGNS_NEGATIVE, tl.int32) >> tl.arange(0, 16)) & 1) == 1
    x = x * 0.25
    return tl.where(negative[:, None], x * -1.0, x) + 0.0  # + 0.0 makes -0 +0


@triton.jit
def _load_tile(x_ptr, M, N, stride_m, BLOCK_N: tl.constexpr, VEC: tl.constexpr):
    """(rows, columns, the fp32 tile x [16, BLOCK_N]) of program (i, j): rows 16i.., zeros past the
    matrix (partial blocks, and the rows the transform pads to a multiple of 16, docs/numerics.md, NVFP4).
    Each thread loads VEC adjacent columns of all 16 rows: the layout every cast below keeps."""
    rows = tl.program_id(0).to(tl.int64) * 16 + tl.arange(0, 16)
    cols = tl.max_contiguous(tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N), VEC)
    x = tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :], mask=(rows[:, None] < M) & (cols[None, :] < N), other=0.0)
    return rows, cols, x.to(tl.float32)


@triton.jit
def _store_rows(codes, scale_code, rows, row_ok, data_ptr, scale_ptr, values_ptr, N, BLOCK_N: tl.constexpr, INT32: tl.constexpr, VALUES: tl.constexpr, TILES: tl.constexpr):
    """The rowwise codes [16, BLOCK_N] of a tile into rows `rows` (those where `row_ok`) of data
    [M, ceil(N/2)] (as int32 [M, N/8] with INT32), its scale codes [16, BLOCK_N/16] into scale
    [M, ceil(N/16)] (with TILES, whose 16 rows of codes are equal, one row of them into row
    program_id(0) of scale [ceil(M/16), ceil(N/16)]); with VALUES also their values q · float(s)
    into values [M, N] (bf16 holds them exactly: the dequantize kernel's, without the tensor scale)."""
    inside = row_ok[:, None]
    if VALUES:
        q = tl.reshape(_code_values(codes), (16, BLOCK_N // 16, 16)) * _e4m3_value(scale_code)[:, :, None]
        value_cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(values_ptr + rows[:, None] * N + value_cols[None, :], tl.reshape(q, (16, BLOCK_N)).to(values_ptr.dtype.element_ty), mask=inside & (value_cols[None, :] < N))
    if INT32:  # 8 codes (one thread's) per word, element 8w + i in nibble i
        words = tl.sum(tl.reshape(codes, (16, BLOCK_N // 8, 8)) << (tl.arange(0, 8) * 4)[None, None, :], axis=2)
        word_cols = tl.program_id(1) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        tl.store(data_ptr + rows[:, None] * (N // 8) + word_cols[None, :], words, mask=inside & (word_cols[None, :] < N // 8))
    else:
        low, high = tl.split(tl.reshape(codes, (16, BLOCK_N // 2, 2)))
        byte_cols = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        row_bytes = tl.cdiv(N, 2)
        tl.store(data_ptr + rows[:, None] * row_bytes + byte_cols[None, :], (low | (high << 4)).to(tl.uint8), mask=inside & (byte_cols[None, :] < row_bytes))
    block_cols = tl.program_id(1) * (BLOCK_N // 16) + tl.arange(0, BLOCK_N // 16)
    row_blocks = tl.cdiv(N, 16)
    if TILES:
        tile_code = tl.max(scale_code, axis=0)  # the rows' codes are equal
        tl.store(scale_ptr + tl.program_id(0).to(tl.int64) * row_blocks + block_cols, tile_code.to(tl.uint8), mask=block_cols < row_blocks)
    else:
        tl.store(scale_ptr + rows[:, None] * row_blocks + block_cols[None, :], scale_code.to(tl.uint8), mask=inside & (block_cols[None, :] < row_blocks))


@triton.jit
def _store_columns(codes, scale_code, cols, data_ptr, scale_ptr, values_ptr, N, length, BLOCK_N: tl.constexpr, INT32: tl.constexpr, VALUES: tl.constexpr, TILES: tl.constexpr):
    """The columnwise codes [16, BLOCK_N] of a tile (column n is row n of the stored matrix) into
    data [N, ceil(length/2)] (int32 [N, length/8] with INT32), its scale codes [BLOCK_N] into
    scale [N, ceil(length/16)] (with TILES, equal across each 16 columns, those of every 16th
    column into scale [ceil(N/16), ceil(length/16)]); with VALUES also their values into values
    [N, length] (as _store_rows)."""
    inside = cols[None, :] < N
    if VALUES:
        q = _code_values(codes) * _e4m3_value(scale_code)[None, :]
        runs = tl.program_id(0).to(tl.int64) * 16 + tl.arange(0, 16)
        tl.store(values_ptr + cols[None, :] * length + runs[:, None], q.to(values_ptr.dtype.element_ty), mask=inside & (runs[:, None] < length))
    if INT32:  # rows 8h..8h+7 of a column in word h
        words = tl.sum(tl.reshape(codes, (2, 8, BLOCK_N)) << (tl.arange(0, 8) * 4)[None, :, None], axis=1)
        halves = tl.program_id(0) * 2 + tl.arange(0, 2)
        tl.store(data_ptr + cols[None, :] * (length // 8) + halves[:, None], words, mask=inside & (halves[:, None] < length // 8))
    else:
        low, high = tl.split(tl.permute(tl.reshape(codes, (8, 2, BLOCK_N)), (0, 2, 1)))
        byte_rows = tl.program_id(0) * 8 + tl.arange(0, 8)
        row_bytes = tl.cdiv(length, 2)
        tl.store(data_ptr + cols[None, :] * row_bytes + byte_rows[:, None], (low | (high << 4)).to(tl.uint8), mask=inside & (byte_rows[:, None] < row_bytes))
    if TILES:
        tl.store(scale_ptr + (cols // 16) * tl.cdiv(length, 16) + tl.program_id(0), scale_code.to(tl.uint8), mask=(cols < N) & (cols % 16 == 0))
    else:
        tl.store(scale_ptr + cols * tl.cdiv(length, 16) + tl.program_id(0), scale_code.to(tl.uint8), mask=cols < N)


@triton.jit
def _quantize_rows(x, amax, s_enc_ptr, keys_ptr, draw_rows, rows, row_ok, data_ptr, scale_ptr, values_ptr, N, BLOCK_N: tl.constexpr, STOCHASTIC: tl.constexpr, INT32: tl.constexpr, WIDE: tl.constexpr, VALUES: tl.constexpr, TILES: tl.constexpr):
    """The rowwise copy of the tile x [16, BLOCK_N], blocks of 16 along each row with amaxes
    `amax` [16, BLOCK_N/16] (see _store_rows); the rows draw as rows `draw_rows` of the cast."""
    scale_code, encode = _block_encode(amax, _encode_scale(tl.load(s_enc_ptr)))
    scaled = tl.reshape(x, (16, BLOCK_N // 16, 16)) * encode[:, :, None]
    draws = scaled  # unused without STOCHASTIC
    if STOCHASTIC:  # pairs of neighbouring columns
        pair_cols = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        first, second = _pair_draws(keys_ptr, draw_rows[:, None], pair_cols[None, :], (N + 1) // 2, WIDE)
        draws = tl.reshape(tl.join(first, second), (16, BLOCK_N))
    codes = _e2m1_codes(tl.reshape(scaled, (16, BLOCK_N)), draws, STOCHASTIC)
    codes = tl.reshape(tl.where((scale_code == _E4M3_NAN)[:, :, None], 0, tl.reshape(codes, (16, BLOCK_N // 16, 16))), (16, BLOCK_N))
    _store_rows(codes, scale_code, rows, row_ok, data_ptr, scale_ptr, values_ptr, N, BLOCK_N, INT32, VALUES, TILES)


@triton.jit
def _quantize_columns(x, amax, s_enc_ptr, keys_ptr, pair_base, pairs_per_row, cols, data_ptr, scale_ptr, values_ptr, N, length, BLOCK_N: tl.constexpr, STOCHASTIC: tl.constexpr, INT32: tl.constexpr, WIDE: tl.constexpr, VALUES: tl.constexpr, TILES: tl.constexpr):
    """The columnwise copy of the tile x [16, BLOCK_N], one block down each column with amax
    `amax` [BLOCK_N] (see _store_columns); its pairs of rows draw as pairs pair_base.. of rows of
    `pairs_per_row` pairs."""
    scale_code, encode = _block_encode(amax, _encode_scale(tl.load(s_enc_ptr)))
    draws = x  # unused without STOCHASTIC
    if STOCHASTIC:  # pairs of neighbouring rows, in one thread
        pair_rows = pair_base + tl.arange(0, 8)
        first, second = _pair_draws(keys_ptr, cols[None, :], pair_rows[:, None], pairs_per_row, WIDE)
        draws = tl.reshape(tl.permute(tl.join(first, second), (0, 2, 1)), (16, BLOCK_N))
    codes = _e2m1_codes(x * encode[None, :], draws, STOCHASTIC)
    codes = tl.where((scale_code == _E4M3_NAN)[None, :], 0, codes)
    _store_columns(codes, scale_code, cols, data_ptr, scale_ptr, values_ptr, N, length, BLOCK_N, INT32, VALUES, TILES)


@triton.jit
def _quantize_tiles(x, s_enc_ptr, rows, row_ok, cols, row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, N, length,
                    BLOCK_N: tl.constexpr, ROW_INT32: tl.constexpr, COL_INT32: tl.constexpr, TILES: tl.constexpr):
    """Both copies of the tile x [16, BLOCK_N] in 16x16 tiles, rounded to nearest: every element has
    one scale and one S_enc in both directions (no transform), so one code serves both copies."""
    scale_code, encode = _block_encode(_tile_amaxes(x, BLOCK_N), _encode_scale(tl.load(s_enc_ptr)))
    encode_cols = tl.reshape(tl.broadcast_to(encode[:, None], (BLOCK_N // 16, 16)), (BLOCK_N,))
    nan_cols = tl.reshape(tl.broadcast_to((scale_code == _E4M3_NAN)[:, None], (BLOCK_N // 16, 16)), (BLOCK_N,))
    codes = tl.where(nan_cols[None, :], 0, _e2m1_codes(x * encode_cols[None, :], x, False))
    _store_rows(codes, tl.broadcast_to(scale_code[None, :], (16, BLOCK_N // 16)), rows, row_ok, row_data_ptr, row_scale_ptr, row_data_ptr, N, BLOCK_N, ROW_INT32, False, TILES)
    scale_cols = tl.reshape(tl.broadcast_to(scale_code[:, None], (BLOCK_N // 16, 16)), (BLOCK_N,))
    _store_columns(codes, scale_cols, cols, col_data_ptr, col_scale_ptr, col_data_ptr, N, length, BLOCK_N, COL_INT32, False, TILES)


@triton.jit
def _tile_amaxes(x, BLOCK_N: tl.constexpr):
    """nvfp4.tile_amax of the tile x [16, BLOCK_N]: max |x| of each 16x16 tile, [BLOCK_N/16]."""
    return _block_amax(tl.reshape(_block_amax(tl.abs(x), 0), (BLOCK_N // 16, 16)), 1)


@triton.jit
def _cast_columns(x, amax_ptr, keys_ptr, pair_base, pairs_per_row, cols, data_ptr, scale_ptr, values_ptr, N, length, BLOCK_N: tl.constexpr,
                  BLOCK_2D: tl.constexpr, RHT: tl.constexpr, STOCHASTIC: tl.constexpr, INT32: tl.constexpr, WIDE: tl.constexpr, VALUES: tl.constexpr,
                  TILES: tl.constexpr):
    """The columnwise copy of the tile x [16, BLOCK_N] (after the transform with RHT), one block
    down each column, in one thread's registers; with TILES one scale per 16x16 tile (_store_columns)."""
    if BLOCK_2D:
        amax = tl.reshape(tl.broadcast_to(_tile_amaxes(x, BLOCK_N)[:, None], (BLOCK_N // 16, 16)), (BLOCK_N,))
    if RHT:
        x = _hadamard_columns(x, BLOCK_N)
    if not BLOCK_2D:
        amax = _block_amax(tl.abs(x), 0)
    _quantize_columns(x, amax, amax_ptr, keys_ptr, pair_base, pairs_per_row, cols, data_ptr, scale_ptr, values_ptr, N, length, BLOCK_N, STOCHASTIC, INT32, WIDE, VALUES, TILES)


@triton.jit
def _cast_kernel(
    x_ptr, M, N, stride_m, row_amax_ptr, col_amax_ptr, keys_ptr,
    row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, col_length,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, BLOCK_2D: tl.constexpr, RHT: tl.constexpr,
    STOCHASTIC: tl.constexpr, ROW_INT32: tl.constexpr, COL_INT32: tl.constexpr, WIDE: tl.constexpr, BLOCK_N: tl.constexpr, VEC: tl.constexpr,
):
    rows, cols, x = _load_tile(x_ptr, M, N, stride_m, BLOCK_N, VEC)
    _cast_tile(
        x, rows, rows, rows < M, cols, row_amax_ptr, col_amax_ptr, keys_ptr, tl.program_id(0) * 8, (col_length + 1) // 2,
        row_data_ptr, row_scale_ptr, row_data_ptr, col_data_ptr, col_scale_ptr, col_data_ptr, N, col_length,
        ROWWISE, COLUMNWISE, BLOCK_2D, RHT, STOCHASTIC, ROW_INT32, COL_INT32, WIDE, BLOCK_N, False, False, BLOCK_2D,
    )


@triton.jit
def _cast_tile(
    x, draw_rows, rows, row_ok, cols, row_amax_ptr, col_amax_ptr, keys_ptr, pair_base, pairs_per_row,
    row_data_ptr, row_scale_ptr, row_values_ptr, col_data_ptr, col_scale_ptr, col_values_ptr, N, col_length,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, BLOCK_2D: tl.constexpr, RHT: tl.constexpr,
    STOCHASTIC: tl.constexpr, ROW_INT32: tl.constexpr, COL_INT32: tl.constexpr, WIDE: tl.constexpr, BLOCK_N: tl.constexpr,
    ROW_VALUES: tl.constexpr, COL_VALUES: tl.constexpr, TILES: tl.constexpr,
):
    """Both copies of the tile x [16, BLOCK_N]: its rowwise codes into rows `rows` (where `row_ok`),
    drawing as rows `draw_rows`; its columnwise codes into run program_id(0) of the stored rows,
    drawing as pairs pair_base.. of rows of `pairs_per_row` pairs; with *_VALUES each copy's
    values too; with TILES (and BLOCK_2D) one scale per tile (_store_rows, _store_columns)."""
    if BLOCK_2D and ROWWISE and COLUMNWISE and not STOCHASTIC and not ROW_VALUES and not COL_VALUES:  # one code per element serves both
        _quantize_tiles(x, row_amax_ptr, rows, row_ok, cols, row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, N, col_length, BLOCK_N, ROW_INT32, COL_INT32, TILES)
    else:
        if ROWWISE:  # blocks of 16 along each row: VEC elements in each of 16/VEC adjacent threads
            if BLOCK_2D:  # one amax per 16x16 tile, for both directions
                amax = tl.broadcast_to(_tile_amaxes(x, BLOCK_N)[None, :], (16, BLOCK_N // 16))
            else:
                amax = _block_amax(tl.reshape(tl.abs(x), (16, BLOCK_N // 16, 16)), 2)
            _quantize_rows(x, amax, row_amax_ptr, keys_ptr, draw_rows, rows, row_ok, row_data_ptr, row_scale_ptr, row_values_ptr, N, BLOCK_N, STOCHASTIC, ROW_INT32, WIDE, ROW_VALUES, TILES)
        if COLUMNWISE:
            _cast_columns(
                x, col_amax_ptr, keys_ptr + 2, pair_base, pairs_per_row, cols, col_data_ptr, col_scale_ptr, col_values_ptr, N, col_length,
                BLOCK_N, BLOCK_2D, RHT, STOCHASTIC, COL_INT32, WIDE, COL_VALUES, TILES,
            )


# (warps, bytes each thread loads from a row) of the cast (by its rounding) and of the
# amaxes, and the dequantize's (BLOCK_R, BLOCK_C, warps): the fastest of
# benchmarks/sweep_cast.py --nvfp4 on an H200 at 8192x8192 bf16.
_CAST_TILE = {"nearest": (4, 8), "stochastic": (4, 4)}
_AMAXES_TILE = (1, 16)
_DEQUANTIZE_TILE = (32, 256, 4)


def _tile_columns(x, tile):
    """(BLOCK_N, VEC, warps) of a tile of 16 rows whose 32 * warps threads each load VEC elements
    (`tile` = (warps, bytes), at least 2 elements) of each row."""
    warps, row_bytes = tile
    # At least 2: stochastic rounding's draw pairs (neighbouring columns) then sit in one thread.
    # (With one column per thread, fp32 stochastic casts came out wrong on an H200, Triton 3.6.)
    vec = max(row_bytes // x.element_size(), 2)
    return vec * 32 * warps, vec, warps


def _wide_pairs(M, N, col_length):
    """Whether some draw pair's index (uniform_draws) reaches 2**32, in either direction."""
    return max(M * -(-N // 2), N * -(-col_length // 2)) > 2**32 - 1


def _kernel_view(pair, length):
    """(data, scales) as the cast kernel writes them: the data as int32 words of 8 codes where rows
    hold whole words, the E4M3 scales as their bytes."""
    return (pair[0].view(torch.int32) if length % 8 == 0 else pair[0]), pair[1].view(torch.uint8)


def cast(x, global_amax, column_amax, keys, rowwise, columnwise, block_2d, rht, tile=None):
    """((rowwise data, scales) or None, (columnwise data, scales) or None) of the 2-D `x`, shaped as
    NVFP4Storage.layout declares them (the columnwise rows padded to whole runs of 16 with `rht`,
    one scale per 16x16 tile with `block_2d`)."""
    M, N = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    col_length = NVFP4Storage.stored_length_for("columnwise", M, N, rht)
    new = lambda direction: NVFP4Storage.empty_buffers(("data", "scale_inv"), direction, M, N, x.device, rht=rht, tile_scales=block_2d)
    row = new("rowwise") if rowwise else None
    col = new("columnwise") if columnwise else None
    if M and N:
        block_n, vec, warps = _tile_columns(x, tile or _CAST_TILE["nearest" if keys is None else "stochastic"])
        some = row or col  # stands in for the absent direction, whose pointers the kernel never uses
        some = (some[0], some[1].view(torch.uint8))
        launch(
            _cast_kernel, (triton.cdiv(M, 16), triton.cdiv(N, block_n)),
            x, M, N, x.stride(0), global_amax, column_amax, keys if keys is not None else global_amax,
            *(_kernel_view(row, N) if row else some), *(_kernel_view(col, col_length) if col else some), col_length,
            ROWWISE=rowwise, COLUMNWISE=columnwise, BLOCK_2D=block_2d, RHT=rht, STOCHASTIC=keys is not None,
            ROW_INT32=N % 8 == 0, COL_INT32=col_length % 8 == 0, WIDE=_wide_pairs(M, N, col_length), BLOCK_N=block_n, VEC=vec, num_warps=warps, enable_fp_fusion=False,
        )
    return row, col


@triton.jit
def _amaxes_kernel(x_ptr, M, N, stride_m, partials_ptr, BLOCK_N: tl.constexpr, VEC: tl.constexpr):
    """Program p writes the finite max |x| of its tile at partials[p] and that of the tile's
    transformed columns (zero rows past M) at partials[programs + p]."""
    _, _, x = _load_tile(x_ptr, M, N, stride_m, BLOCK_N, VEC)
    program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    programs = tl.num_programs(0) * tl.num_programs(1)
    magnitude = tl.abs(x)
    tl.store(partials_ptr + program, tl.max(tl.max(tl.where(magnitude < float("inf"), magnitude, 0.0), axis=0), axis=0))
    transformed = tl.abs(_hadamard_columns(x, BLOCK_N))
    tl.store(partials_ptr + programs + program, tl.max(tl.max(tl.where(transformed < float("inf"), transformed, 0.0), axis=0), axis=0))


def amaxes(x: torch.Tensor, tile=_AMAXES_TILE):
    """(finite amax of x, finite amax of its transformed columnwise copy), 0-d fp32 each."""
    M, N = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    block_n, vec, warps = _tile_columns(x, tile)
    grid = (max(triton.cdiv(M, 16), 1), max(triton.cdiv(N, block_n), 1))
    partials = torch.zeros((2, grid[0] * grid[1]), dtype=torch.float32, device=x.device)
    if M and N:
        launch(_amaxes_kernel, grid, x, M, N, x.stride(0), partials, BLOCK_N=block_n, VEC=vec, num_warps=warps, enable_fp_fusion=False)
    both = partials.amax(dim=1)
    return both[0], both[1]


@triton.jit
def _dequantize_kernel(data_ptr, scale_ptr, amax_ptr, out_ptr, R, C, TENSOR_SCALE: tl.constexpr, WORDS: tl.constexpr, SCALE_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
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
    q = _code_values(codes)
    scale_codes = tl.load(scale_ptr + (rows[:, None] // SCALE_ROWS) * row_blocks + block_cols[None, :], mask=block_mask, other=0)
    scale = _e4m3_value(scale_codes.to(tl.int32))
    values = tl.reshape(tl.reshape(q, (BLOCK_R, BLOCK_C // 16, 16)) * scale[:, :, None], (BLOCK_R, BLOCK_C))
    if TENSOR_SCALE:
        s_enc = _encode_scale(tl.load(amax_ptr))
        values = values * tl.div_rn(_like(1.0, s_enc), s_enc)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], values.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < R) & (cols[None, :] < C))


def dequantize(data, scale_inv, length: int, out_dtype: torch.dtype, global_amax=None, block=None, scale_rows: int = 1) -> torch.Tensor:
    """[R, length] values of packed codes `data` [R, ceil(length/2)] with E4M3 block scales
    `scale_inv` [ceil(R/scale_rows), ceil(length/16)] (a row of them for each `scale_rows` rows:
    16 for scales per 16x16 tile): q * float(s), times 1/S_enc when `global_amax` is given (the
    reference's order), rounded once to `out_dtype`."""
    R = data.shape[0]
    out = torch.empty((R, length), dtype=out_dtype, device=data.device)
    block_r, block_c, warps = block or _DEQUANTIZE_TILE
    if R and length:
        launch(
            _dequantize_kernel, (triton.cdiv(R, block_r), triton.cdiv(length, block_c)),
            data.contiguous().view(torch.int64) if length % 16 == 0 else data.contiguous(), scale_inv.contiguous().view(torch.uint8), global_amax if global_amax is not None else data, out, R, length,
            TENSOR_SCALE=global_amax is not None, WORDS=length % 16 == 0, SCALE_ROWS=scale_rows, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps, enable_fp_fusion=False,
        )
    return out


# Registered into qtensor's kernel table (qtensor_kernels/__init__.py).
KERNELS = {"nvfp4.cast": cast, "nvfp4.amaxes": amaxes, "nvfp4.dequantize": dequantize}
