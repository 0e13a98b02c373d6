"""Independent numpy reference of the qtensor formats, written from docs/numerics.md.

All math is numpy float32 with round-to-nearest-even, in the spec's order of operations;
ml_dtypes provides the narrow casts (it does not saturate, so every cast is clamped first).
Nothing here imports qtensor, and torch appears only in the conversion helpers at the bottom,
which turn the library's outputs into numpy arrays for comparison.

Each format returns a NamedTuple in the library's storage layout: raw codes (uint8), scale codes
or values, the fp32 dequantized values, and `code_mask`, True where the spec pins the element
code (codes inside non-finite blocks are unspecified).
"""

from typing import NamedTuple, Optional

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max

# name -> (ml_dtypes type, fp8_max, emax of the OCP MX floor rule)
FP8_FORMATS = {
    "e4m3": (ml_dtypes.float8_e4m3fn, F32(448), 8),
    "e5m2": (ml_dtypes.float8_e5m2, F32(57344), 15),
}
E2M1_MAGNITUDES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=F32)
E8M0_NAN = 255
E4M3_NAN = 0x7F
MXFP8_BLOCK = 32
NVFP4_BLOCK = 16

_IGNORE_FP = dict(over="ignore", under="ignore", invalid="ignore", divide="ignore")


def finite_amax(x) -> np.float32:
    """max|x| over the finite values (docs/numerics.md, Conventions: tensor-wide amaxes skip NaN/Inf); 0 if none."""
    magnitudes = np.abs(np.asarray(x, F32)[np.isfinite(x)])
    return F32(magnitudes.max()) if magnitudes.size else F32(0)


def saturating_cast(y, narrow_dtype, max_value):
    """Cast fp32 -> narrow type with RNE, clamping finite values to ±max first (NaN/Inf untouched)."""
    y = np.asarray(y, F32)
    clamped = np.where(np.isfinite(y), np.clip(y, -max_value, max_value), y)
    return clamped.astype(narrow_dtype)


def _pad_columns(x2d, multiple):
    """Zero-pad the last dimension to a multiple (docs/numerics.md, Non-finite values and partial blocks: a short last block behaves as zero-padded)."""
    pad = (-x2d.shape[1]) % multiple
    return np.pad(x2d, ((0, 0), (0, pad))) if pad else x2d


def _block_stats(x2d, block):
    """Per-block (along rows) finite amax and 'holds NaN/Inf' flag: shapes [R, ceil(N/block)]."""
    padded = _pad_columns(x2d, block)
    blocks = padded.reshape(padded.shape[0], padded.shape[1] // block, block)
    nonfinite = ~np.isfinite(blocks).all(axis=2)
    amax = np.where(np.isfinite(blocks), np.abs(blocks), F32(0)).max(axis=2, initial=F32(0))
    return amax.astype(F32), nonfinite


def _tile_stats(x2d, tile):
    """Per-tile (tile x tile squares of x2d) finite amax and non-finite flag: [ceil(M/t), ceil(K/t)]."""
    padded = _pad_columns(_pad_columns(x2d, tile).T, tile).T
    tiles = padded.reshape(padded.shape[0] // tile, tile, padded.shape[1] // tile, tile)
    nonfinite = ~np.isfinite(tiles).all(axis=(1, 3))
    amax = np.where(np.isfinite(tiles), np.abs(tiles), F32(0)).max(axis=(1, 3), initial=F32(0))
    return amax.astype(F32), nonfinite


def _expand_blocks(per_block, block, length):
    """[R, nb] per-block values -> [R, length] per-element values."""
    return np.repeat(per_block, block, axis=1)[:, :length]


# --------------------------------------------------------------------------------------------
# Float8 (per-tensor scale)


class Float8Result(NamedTuple):
    codes: np.ndarray  # uint8 [M, K]; the columnwise copy holds codes.T
    scale: np.float32
    scale_inv: np.float32
    deq: np.ndarray  # fp32 [M, K]
    amax: np.float32  # this cast's finite amax (what delayed scaling records)
    code_mask: np.ndarray  # True where the input is finite


def float8_scale(amax, fp8="e4m3", margin=0, force_pow_2_scales=False) -> np.float32:
    """docs/numerics.md, Float8: scale = (fp8_max / amax) / 2**margin, 1 for amax 0, Inf -> FLT_MAX, pow2 floor."""
    _, fp8_max, _ = FP8_FORMATS[fp8]
    amax = F32(amax)
    if amax == 0:
        return F32(1)
    with np.errstate(**_IGNORE_FP):
        scale = F32(fp8_max / amax)
        scale = F32(scale / F32(2.0**margin))
    if np.isinf(scale):
        scale = FLT_MAX
    if force_pow_2_scales:
        # round down to a power of two: keep sign and exponent, clear the mantissa bits
        scale = (np.array(scale, F32).view(np.uint32) & np.uint32(0xFF800000)).view(F32)[()]
    return F32(scale)


def float8_cast(x2d, scale, fp8="e4m3") -> Float8Result:
    """docs/numerics.md, Float8: q = fp8(x * scale) saturating (non-finite inputs pass through); value q * (1/scale)."""
    narrow, fp8_max, _ = FP8_FORMATS[fp8]
    x = np.asarray(x2d, F32)
    scale = F32(scale)
    with np.errstate(**_IGNORE_FP):
        q = saturating_cast(x * scale, narrow, fp8_max)
        scale_inv = F32(F32(1) / scale)
        deq = q.astype(F32) * scale_inv
    return Float8Result(q.view(np.uint8), scale, scale_inv, deq, finite_amax(x), np.isfinite(x))


def float8_current(x2d, fp8="e4m3", amax_epsilon=0.0, force_pow_2_scales=False) -> Float8Result:
    """docs/numerics.md, Float8 (current scaling): amax = max(finite max|x|, amax_epsilon)."""
    amax = max(finite_amax(x2d), F32(amax_epsilon))
    return float8_cast(x2d, float8_scale(amax, fp8, 0, force_pow_2_scales), fp8)


class Float8Delayed:
    """docs/numerics.md, Float8 (delayed scaling): the scale comes from the amax history before each cast."""

    def __init__(self, fp8="e4m3", amax_epsilon=0.0, force_pow_2_scales=False,
                 amax_history_len=1024, amax_compute_algo="max", margin=0):
        self.fp8, self.amax_epsilon, self.force_pow_2_scales = fp8, amax_epsilon, force_pow_2_scales
        self.amax_history_len, self.amax_compute_algo, self.margin = amax_history_len, amax_compute_algo, margin
        self.history = []

    def next_scale(self) -> np.float32:
        if not self.history:
            return F32(1)
        window_amax = max(self.history) if self.amax_compute_algo == "max" else self.history[-1]
        amax = max(window_amax, F32(self.amax_epsilon))
        return float8_scale(amax, self.fp8, self.margin, self.force_pow_2_scales)

    def quantize(self, x2d) -> Float8Result:
        result = float8_cast(x2d, self.next_scale(), self.fp8)
        self.history = (self.history + [result.amax])[-self.amax_history_len:]
        return result


# --------------------------------------------------------------------------------------------
# Float8 with block scales (row-wise, 1x128, 128x128)


class Float8BlockResult(NamedTuple):
    codes: np.ndarray  # uint8, the copy as stored: rowwise [M, K], columnwise [K, M]
    scale_inv: np.ndarray  # fp32, one per block of the stored copy
    deq: np.ndarray  # fp32 [M, K]
    code_mask: np.ndarray  # True where the input is finite, in the stored orientation


def float8_block(x2d, direction="rowwise", block_rows=1, block_cols=128, fp8="e4m3", pow2_scales=False, amax_epsilon=0.0):
    """docs/numerics.md, Float8 with block scales: the copy (x, or x transposed for columnwise) cut into
    block_rows x block_cols blocks (block_cols None: whole rows), each quantized by Float8's
    current-scaling rules with its own finite amax floored by amax_epsilon."""
    x = np.asarray(x2d, F32)
    y = x if direction == "rowwise" else x.T
    rows, cols = y.shape
    grid = (-(-rows // block_rows), -(-cols // block_cols) if block_cols else 1)  # row-wise: one block per row
    block_cols = block_cols or max(cols, 1)
    codes = np.zeros((rows, cols), np.uint8)
    scale_inv = np.zeros(grid, F32)
    values = np.zeros((rows, cols), F32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            r, c = slice(i * block_rows, (i + 1) * block_rows), slice(j * block_cols, (j + 1) * block_cols)
            amax = max(finite_amax(y[r, c]), F32(amax_epsilon))
            result = float8_cast(y[r, c], float8_scale(amax, fp8, 0, pow2_scales), fp8)
            codes[r, c], scale_inv[i, j], values[r, c] = result.codes, result.scale_inv, result.deq
    return Float8BlockResult(codes, scale_inv, values if direction == "rowwise" else values.T, np.isfinite(y))


# --------------------------------------------------------------------------------------------
# MXFP8 (block 32, E8M0 scales)


class MXFP8Result(NamedTuple):
    codes: np.ndarray  # uint8 [M, K] in both directions
    scale_inv: np.ndarray  # uint8 E8M0 codes: rowwise [M, ceil(K/32)], columnwise [ceil(M/32), K]
    deq: np.ndarray  # fp32 [M, K]
    code_mask: np.ndarray  # True outside blocks holding NaN/Inf


def e8m0_rceil(block_amax, fp8="e4m3"):
    """docs/numerics.md, MXFP8 (rceil): smallest code with 2**(c-127) >= block_amax * (1/fp8_max), capped at 254."""
    _, fp8_max, _ = FP8_FORMATS[fp8]
    block_amax = np.asarray(block_amax, F32)
    with np.errstate(**_IGNORE_FP):
        v = np.asarray(block_amax * (F32(1) / fp8_max), F32)
    bits = v.view(np.uint32)
    biased_exponent = ((bits >> 23) & 0xFF).astype(np.int64)
    code = biased_exponent + ((bits & 0x7FFFFF) != 0)
    code = np.minimum(code, 254)
    code = np.where(v <= F32(2.0**-127), 0, code)  # zero blocks and v at or below 2**-127
    code = np.where(np.isfinite(v), code, E8M0_NAN)
    return code.astype(np.uint8)


def e8m0_floor(block_amax, fp8="e4m3"):
    """docs/numerics.md, MXFP8 (floor, OCP MX v1.0): clamp(floor(log2(amax)) - emax + 127, 0, 254)."""
    _, _, emax = FP8_FORMATS[fp8]
    block_amax = np.asarray(block_amax, F32)
    _, exponent = np.frexp(np.where(np.isfinite(block_amax), block_amax, F32(1)))
    # frexp: amax = m * 2**e with m in [0.5, 1), so floor(log2(amax)) = e - 1 (subnormals too)
    code = np.clip(exponent.astype(np.int64) - 1 - emax + 127, 0, 254)
    code = np.where(block_amax == 0, 0, code)
    code = np.where(np.isfinite(block_amax), code, E8M0_NAN)
    return code.astype(np.uint8)


def _mxfp8_rows(x, fp8, rule):
    """Quantize each row in blocks of 32 along its length (the rowwise direction)."""
    narrow, fp8_max, _ = FP8_FORMATS[fp8]
    rows, length = x.shape
    block_amax, nonfinite = _block_stats(x, MXFP8_BLOCK)
    block_amax = np.where(nonfinite, F32(np.inf), block_amax)
    codes = (e8m0_rceil if rule == "rceil" else e8m0_floor)(block_amax, fp8)
    element_code = _expand_blocks(codes.astype(np.int32), MXFP8_BLOCK, length)
    bad = element_code == E8M0_NAN
    safe_code = np.where(bad, 127, element_code)
    # 2**(127-c) and 2**(c-127) are exact fp32 powers of two (2**-127 is an fp32 subnormal)
    multiplier = np.ldexp(np.ones_like(x, F32), (127 - safe_code).astype(np.int32))
    block_value = np.ldexp(np.ones_like(x, F32), (safe_code - 127).astype(np.int32))
    with np.errstate(**_IGNORE_FP):
        q = saturating_cast(np.where(bad, F32(0), x * multiplier), narrow, fp8_max)
        deq = np.where(bad, F32(np.nan), q.astype(F32) * block_value).astype(F32)
    return MXFP8Result(q.view(np.uint8), codes, deq, ~bad)


def mxfp8(x2d, direction="rowwise", fp8="e4m3", rule="rceil") -> MXFP8Result:
    """docs/numerics.md, MXFP8: rowwise blocks run along K, columnwise along M; both read the input x."""
    x = np.asarray(x2d, F32)
    if direction == "rowwise":
        return _mxfp8_rows(x, fp8, rule)
    r = _mxfp8_rows(x.T, fp8, rule)
    return MXFP8Result(r.codes.T, r.scale_inv.T, r.deq.T, r.code_mask.T)


# --------------------------------------------------------------------------------------------
# NVFP4 (block 16, E2M1 elements, E4M3 block scales, fp32 tensor scale)


class NVFP4Result(NamedTuple):
    packed: np.ndarray  # uint8 [R, ceil(N/2)], element 2i in the low nibble
    codes: np.ndarray  # uint8 nibbles [R, N] (storage layout: columnwise is [K, M] or [K, Mpad])
    scale_inv: np.ndarray  # uint8 E4M3 codes [R, ceil(N/16)]
    stored_scales: np.ndarray  # as the storage holds them: scale_inv, or for 16x16 tiles one row per 16 rows (per tile)
    global_amax: np.float32
    scaled: np.ndarray  # fp32 [R, N]: x * f clamped to ±6, the value E2M1 rounding sees
    deq_storage: np.ndarray  # fp32 [R, N]: dequantized, in storage layout (RHT domain if rht)
    deq: np.ndarray  # fp32 [M, K] in the original domain (for rht: float64 inverse, approximate)
    code_mask: np.ndarray  # [R, N], True outside blocks holding NaN/Inf


def nvfp4_tensor_scale(global_amax) -> np.float32:
    """docs/numerics.md, NVFP4: S_enc = (448 * 6) / global_amax; 1 if global_amax is 0; FLT_MAX on overflow."""
    global_amax = F32(global_amax)
    if global_amax == 0:
        return F32(1)
    with np.errstate(**_IGNORE_FP):
        s_enc = F32(F32(448 * 6) / global_amax)
    return FLT_MAX if np.isinf(s_enc) else s_enc


def pack_nibbles(codes):
    """Two E2M1 codes per byte, element 2i in the low nibble; an odd count leaves a zero high nibble."""
    codes = _pad_columns(np.asarray(codes, np.uint8), 2)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed, length):
    """Inverse of pack_nibbles, keeping `length` elements per row."""
    packed = np.asarray(packed, np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], 2 * packed.shape[1])
    return codes[:, :length]


def _nvfp4_rows(t, s_enc, block_amax, nonfinite):
    """Quantize rows of t [R, N] in blocks of 16 given each block's amax / non-finite flag [R, nb]."""
    length = t.shape[1]
    with np.errstate(**_IGNORE_FP):
        encode = F32(s_enc * (F32(1) / F32(6)))
        s = saturating_cast(block_amax * encode, ml_dtypes.float8_e4m3fn, F32(448))
        s_value = s.astype(F32)
        decode = F32(F32(1) / s_enc)
        f = np.minimum(F32(1) / (s_value * decode), FLT_MAX).astype(F32)
        scale_codes = np.where(nonfinite, np.uint8(E4M3_NAN), s.view(np.uint8)).astype(np.uint8)
        bad = _expand_blocks(nonfinite, NVFP4_BLOCK, length)
        scaled = np.clip(t * _expand_blocks(f, NVFP4_BLOCK, length), F32(-6), F32(6))
        scaled = np.where(bad, F32(0), scaled).astype(F32)
        q = scaled.astype(ml_dtypes.float4_e2m1fn)
        deq = (q.astype(F32) * _expand_blocks(s_value, NVFP4_BLOCK, length)) * decode
        deq = np.where(bad, F32(np.nan), deq).astype(F32)
    codes = q.view(np.uint8) & np.uint8(0xF)
    return codes, scale_codes, scaled, deq, ~bad


def hadamard_16():
    """docs/numerics.md, NVFP4 (random Hadamard transform): matrix H = diag(s) @ H16 / 4 (H16 the Sylvester Hadamard matrix), in fp32."""
    i = np.arange(16)
    popcount = np.vectorize(lambda v: bin(v).count("1"))(i[:, None] & i[None, :])
    h16 = np.where(popcount % 2 == 0, 1.0, -1.0)
    signs = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=np.float64)
    return (signs[:, None] * h16 / 4).astype(F32)


def rht_transform(x2d):
    """Apply H to every run of 16 rows of each column (rows zero-padded to a multiple of 16): [Mpad, K]."""
    x = np.asarray(x2d, F32)
    padded_rows = -(-x.shape[0] // NVFP4_BLOCK) * NVFP4_BLOCK
    x = np.pad(x, ((0, padded_rows - x.shape[0]), (0, 0)))
    groups = x.reshape(padded_rows // NVFP4_BLOCK, NVFP4_BLOCK, x.shape[1])
    with np.errstate(**_IGNORE_FP):
        return np.matmul(hadamard_16(), groups).astype(F32).reshape(padded_rows, x.shape[1])


def rht_inverse(t_padded, rows):
    """Undo rht_transform (H is orthogonal: H^-1 = H^T) in float64, keep the first `rows` rows."""
    h = hadamard_16().astype(np.float64)
    groups = np.asarray(t_padded, np.float64)
    groups = groups.reshape(groups.shape[0] // NVFP4_BLOCK, NVFP4_BLOCK, groups.shape[1])
    return np.matmul(h.T, groups).reshape(t_padded.shape)[:rows].astype(F32)


def nvfp4(x2d, direction="rowwise", block_2d=False, rht=False) -> NVFP4Result:
    """docs/numerics.md, NVFP4. Rowwise: blocks along K, storage [M, .]. Columnwise: the transpose [K, M] quantized
    along its rows (rht: of the Hadamard-transformed, row-padded x). block_2d: 16x16 tiles of x2d."""
    x = np.asarray(x2d, F32)
    rows, cols = x.shape
    rht = rht and direction == "columnwise"
    source = rht_transform(x) if rht else x
    global_amax = finite_amax(source)
    s_enc = nvfp4_tensor_scale(global_amax)
    t = source if direction == "rowwise" else source.T
    if block_2d:
        # tile (i, j) covers x2d rows 16i.. and columns 16j..: rowwise block (m, j) is tile (m//16, j),
        # columnwise block (k, i) is tile (i, k//16)
        tile_amax, tile_nonfinite = _tile_stats(x, NVFP4_BLOCK)
        if direction == "rowwise":
            block_amax = np.repeat(tile_amax, NVFP4_BLOCK, axis=0)[:rows]
            nonfinite = np.repeat(tile_nonfinite, NVFP4_BLOCK, axis=0)[:rows]
        else:
            block_amax = np.repeat(tile_amax.T, NVFP4_BLOCK, axis=0)[:cols]
            nonfinite = np.repeat(tile_nonfinite.T, NVFP4_BLOCK, axis=0)[:cols]
    else:
        block_amax, nonfinite = _block_stats(t, NVFP4_BLOCK)
    codes, scale_codes, scaled, deq_storage, mask = _nvfp4_rows(t, s_enc, block_amax, nonfinite)
    if direction == "rowwise":
        deq = deq_storage
    elif rht:
        deq = rht_inverse(deq_storage.T, rows)
    else:
        deq = deq_storage.T
    stored_scales = scale_codes[::NVFP4_BLOCK] if block_2d else scale_codes  # docs/checkpoint-format.md: one per tile
    return NVFP4Result(pack_nibbles(codes), codes, scale_codes, stored_scales, global_amax, scaled, deq_storage,
                       deq, mask)


def e2m1_neighbours(scaled):
    """The two E2M1 values bracketing each scaled value (equal when it is representable)."""
    scaled = np.asarray(scaled, F32)
    magnitude = np.abs(scaled)
    upper_index = np.searchsorted(E2M1_MAGNITUDES, magnitude, side="left")
    upper = E2M1_MAGNITUDES[np.minimum(upper_index, 7)]
    lower = np.where(upper == magnitude, upper, E2M1_MAGNITUDES[np.maximum(upper_index - 1, 0)])
    sign = np.where(scaled < 0, F32(-1), F32(1))
    return sign * lower, sign * upper


def nvfp4_values(codes, scale_codes, global_amax):
    """docs/numerics.md, NVFP4: value (q * float(s)) * (1/S_enc) of element codes [R, N] under block scales [R, nb]."""
    codes = np.asarray(codes, np.uint8)
    s_value = np.asarray(scale_codes, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)
    decode = F32(F32(1) / nvfp4_tensor_scale(global_amax))
    with np.errstate(**_IGNORE_FP):
        return ((e2m1_values(codes) * _expand_blocks(s_value, NVFP4_BLOCK, codes.shape[1])) * decode).astype(F32)


def e2m1_values(codes):
    """Decode E2M1 nibbles to fp32."""
    codes = np.asarray(codes, np.uint8)
    magnitude = E2M1_MAGNITUDES[codes & 7]
    return np.where(codes & 8, -magnitude, magnitude).astype(F32)


# --------------------------------------------------------------------------------------------
# Identity / dtype rounding


def round_to_dtype(values, dtype):
    """fp32 -> float32 | bfloat16 | float16 (RNE) -> fp32, the way a torch .to() rounds.
    `dtype` is a name or a torch dtype."""
    name = str(dtype).replace("torch.", "")
    narrow = {"float32": F32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[name]
    with np.errstate(**_IGNORE_FP):
        return np.asarray(values, F32).astype(narrow).astype(F32)


# --------------------------------------------------------------------------------------------
# Conversions from the library's torch tensors, and bitwise comparisons


def as_f32(t):
    """A torch (or numpy) float tensor as an fp32 numpy array."""
    if hasattr(t, "detach"):
        t = t.detach().cpu().float().numpy()
    return np.asarray(t, F32)


def as_codes(t):
    """A torch float8 / uint8 tensor (or numpy array) as its raw uint8 codes."""
    if hasattr(t, "detach"):
        import torch  # conversion only

        t = t.detach().cpu()
        if t.dtype != torch.uint8:
            t = t.view(torch.uint8)
        t = t.numpy()
    return np.asarray(t).view(np.uint8)


def _first_difference(mask):
    index = tuple(int(i) for i in np.argwhere(mask)[0])
    return index, f"{int(mask.sum())} of {mask.size} differ, first at {index}"


def assert_same_bits(actual, expected, what="values"):
    """fp32 bitwise equality; positions that are NaN in both count as equal."""
    actual, expected = as_f32(actual), np.asarray(expected, F32)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != expected {expected.shape}"
    differ = (actual.view(np.uint32) != expected.view(np.uint32)) & ~(np.isnan(actual) & np.isnan(expected))
    if differ.any():
        index, summary = _first_difference(differ)
        raise AssertionError(f"{what}: {summary}: got {actual[index]!r} "
                             f"(0x{actual.view(np.uint32)[index]:08x}), expected {expected[index]!r} "
                             f"(0x{expected.view(np.uint32)[index]:08x})")


def assert_same_codes(actual, expected, mask: Optional[np.ndarray] = None, what="codes"):
    """uint8 code equality, restricted to `mask` (True = compare) when given."""
    actual, expected = as_codes(actual), np.asarray(expected, np.uint8)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != expected {expected.shape}"
    differ = actual != expected
    if mask is not None:
        differ &= mask
    if differ.any():
        index, summary = _first_difference(differ)
        raise AssertionError(f"{what}: {summary}: got 0x{actual[index]:02x}, expected 0x{expected[index]:02x}")
