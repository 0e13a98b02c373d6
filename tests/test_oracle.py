"""The oracle against values computed by hand from docs/numerics.md (no library involved)."""

import ml_dtypes
import numpy as np
import pytest

import oracle

F32 = np.float32


def f32(*values):
    return np.array(values, dtype=F32)


# ---- narrow casts: ml_dtypes must round to nearest even, and the oracle clamps first ------------


def test_e2m1_cast_rounds_ties_to_even_and_saturates():
    scaled = f32(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 7, -7, -0.2, -0.75, 0.2500001)
    codes = oracle.saturating_cast(scaled, ml_dtypes.float4_e2m1fn, F32(6)).view(np.uint8)
    assert codes.tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 15, 8, 10, 1]


def test_e2m1_cast_is_round_to_nearest_even_everywhere():
    rng = np.random.default_rng(0)
    scaled = np.concatenate([rng.uniform(-6, 6, 20000).astype(F32),
                             (oracle.E2M1_MAGNITUDES[:-1] + oracle.E2M1_MAGNITUDES[1:]) / 2])
    got = oracle.e2m1_values(scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))
    # independent RNE: nearest grid value; on a tie the one with an even code (index)
    distance = np.abs(np.abs(scaled)[:, None].astype(np.float64) - oracle.E2M1_MAGNITUDES[None, :])
    best = distance.min(axis=1, keepdims=True)
    candidates = np.where(distance == best, np.arange(8), 99)
    index = np.where((candidates % 2 == 0) & (candidates != 99), candidates, 99).min(axis=1)
    index = np.where(index == 99, candidates.min(axis=1), index)
    want = np.copysign(oracle.E2M1_MAGNITUDES[index], scaled)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
def test_fp8_cast_rounds_every_midpoint_to_even(fp8):
    narrow, fp8_max, _ = oracle.FP8_FORMATS[fp8]
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(narrow).astype(F32)
    keep = np.isfinite(values) & (values >= 0) & ~((values == 0) & (codes >= 128))
    values, codes = values[keep], codes[keep]
    order = np.argsort(values)
    values, codes = values[order], codes[order]
    midpoints = ((values[:-1] + values[1:]) / 2).astype(F32)
    got = oracle.saturating_cast(midpoints, narrow, fp8_max).view(np.uint8)
    even = np.where(codes[:-1] % 2 == 0, codes[:-1], codes[1:])
    assert np.array_equal(got, even)
    above = np.nextafter(midpoints, F32(np.inf))
    assert np.array_equal(oracle.saturating_cast(above, narrow, fp8_max).view(np.uint8), codes[1:])


def test_fp8_hand_values():
    e4m3, e5m2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    got = oracle.saturating_cast(f32(1.0625, 1.1875, 1.0625 + 2**-20, 464, 1e30, -np.inf, np.nan), e4m3, F32(448))
    assert got.astype(F32)[:5].tolist() == [1.0, 1.25, 1.125, 448, 448]
    assert np.isnan(got.astype(F32)[5:]).all()  # E4M3 has no Inf
    got = oracle.saturating_cast(f32(1.125, 1.375, 61440, np.inf), e5m2, F32(57344))
    assert got.astype(F32).tolist() == [1.0, 1.5, 57344, np.inf]


# ---- Float8 ------------------------------------------------------------------------------------


def test_float8_current_scale_and_scale_inv():
    x = f32(3, -1, 0.5).reshape(1, 3)
    r = oracle.float8_current(x, "e4m3")
    assert r.scale == F32(448) / F32(3) and r.scale_inv == F32(1) / r.scale
    assert oracle.float8_current(x, "e4m3", force_pow_2_scales=True).scale == 128
    assert oracle.float8_current(x, "e5m2", force_pow_2_scales=True).scale == 16384
    assert oracle.float8_current(x, "e4m3", amax_epsilon=10.0).scale == F32(448) / F32(10)
    assert oracle.float8_current(np.zeros((2, 2), F32)).scale == 1
    # 448 / 1e-39 overflows fp32: the scale is capped at FLT_MAX
    assert oracle.float8_current(f32(1e-39).reshape(1, 1)).scale == np.finfo(F32).max


def test_float8_nonfinite_inputs_and_finite_amax():
    x = f32(2, np.nan, np.inf, -np.inf, -1).reshape(1, 5)
    r = oracle.float8_current(x, "e4m3")
    assert r.amax == 2 and r.scale == 224
    assert r.deq[0, 0] == 2 and r.deq[0, 4] == -1 and np.isnan(r.deq[0, 1:4]).all()
    r = oracle.float8_current(x, "e5m2")
    assert np.isnan(r.deq[0, 1]) and r.deq[0, 2] == np.inf and r.deq[0, 3] == -np.inf
    assert r.code_mask.tolist() == [[True, False, False, False, True]]


def test_float8_delayed_uses_the_history_before_each_cast():
    d = oracle.Float8Delayed("e4m3", amax_history_len=2, amax_compute_algo="max")
    scales = [d.quantize(f32(a).reshape(1, 1)).scale for a in (4, 2, 1, 1)]
    assert scales == [1, 112, 112, 224]  # window [4], [4, 2], [2, 1]
    d = oracle.Float8Delayed("e4m3", amax_compute_algo="most_recent", margin=1)
    scales = [d.quantize(f32(a).reshape(1, 1)).scale for a in (4, 2, 1)]
    assert scales == [1, 56, 112]
    d = oracle.Float8Delayed("e4m3")
    r = [d.quantize(f32(a).reshape(1, 1)) for a in (0.5, 100)][1]
    assert r.scale == 896 and r.deq[0, 0] == F32(448) * (F32(1) / F32(896))  # saturated


# ---- MXFP8 scales --------------------------------------------------------------------------------


def test_e8m0_rceil_codes():
    amax = f32(448, 449, 0, np.nan, np.inf, 448 * 2.0**-127, 448 * 2.0**-126, 1, np.finfo(F32).max)
    assert oracle.e8m0_rceil(amax, "e4m3").tolist() == [127, 128, 0, 255, 255, 0, 1, 119, 247]
    assert oracle.e8m0_rceil(f32(57344, 57345, 1), "e5m2").tolist() == [127, 128, 112]


def test_e8m0_floor_codes():
    amax = f32(1.0, 448, 511, 512, 0, np.nan, np.finfo(F32).max, 1e-40)
    assert oracle.e8m0_floor(amax, "e4m3").tolist() == [119, 127, 127, 128, 0, 255, 246, 0]
    assert oracle.e8m0_floor(f32(1.0, 57344, 65536), "e5m2").tolist() == [112, 127, 128]


def test_mxfp8_block_hand_example():
    x = np.zeros((1, 40), F32)
    x[0, :3] = [448, 1.0625, -1.1875]  # block 0: amax 448 -> code 127, scale 1
    x[0, 32:34] = [2.0**-120, np.nan]  # block 1 (partial): NaN -> code 255
    r = oracle.mxfp8(x, "rowwise")
    assert r.scale_inv.tolist() == [[127, 255]]
    assert r.deq[0, :3].tolist() == [448, 1.0, -1.25]
    assert np.isnan(r.deq[0, 32:]).all() and not r.code_mask[0, 32:].any()
    assert oracle.mxfp8(x, "rowwise", rule="floor").scale_inv.tolist() == [[127, 255]]
    col = oracle.mxfp8(x.T, "columnwise")
    assert col.scale_inv.tolist() == [[127], [255]] and np.array_equal(col.deq, r.deq.T, equal_nan=True)


def test_mxfp8_smallest_code_uses_multiplier_two_to_the_127():
    x = f32(1e-40, 0).reshape(1, 2)  # v <= 2**-127 -> code 0, elements scaled by 2**127
    r = oracle.mxfp8(x, "rowwise")
    assert r.scale_inv.tolist() == [[0]]
    q = oracle.saturating_cast(F32(1e-40) * F32(2.0**127), ml_dtypes.float8_e4m3fn, F32(448))
    assert r.deq[0, 0] == q.astype(F32) * F32(2.0**-127)


# ---- NVFP4 -------------------------------------------------------------------------------------


def test_nvfp4_hand_example_with_unit_tensor_scale():
    x = np.zeros((1, 35), F32)
    x[0, 0] = 2688  # global amax 2688 -> S_enc = 1; block 0 scale e4m3(448)
    x[0, 16:25] = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.1]  # block 1 scale 1.0
    x[0, 32:35] = [0.5, -3, 1]  # partial block 2: amax 3 -> scale 0.5, f = 2
    r = oracle.nvfp4(x, "rowwise")
    assert r.global_amax == 2688
    assert r.scale_inv.tolist() == [[0x7E, 0x38, 0x30]]
    assert r.codes[0, 16:25].tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 8]
    assert r.codes[0, 32:].tolist() == [2, 15, 4]  # x * 2 = 1, -6, 2
    assert r.packed.shape == (1, 18) and r.packed[0, 17] == 0x04  # odd count: zero high nibble
    assert r.packed[0, 8] == 0x07 | (0 << 4) and r.packed[0, 9] == 0x02 | (2 << 4)
    assert r.deq[0, 16:25].tolist() == [6, 0, 1, 1, 2, 2, 4, 4, -0.0]
    assert r.deq[0, 32:].tolist() == [0.5, -3, 1]


def test_nvfp4_tensor_scale_edges():
    assert oracle.nvfp4_tensor_scale(0) == 1
    assert oracle.nvfp4_tensor_scale(1e-40) == np.finfo(F32).max
    assert oracle.nvfp4_tensor_scale(6) == F32(2688) / F32(6)


def test_nvfp4_nonfinite_block_scale_is_e4m3_nan():
    x = np.ones((2, 20), F32)
    x[1, 18] = np.inf
    r = oracle.nvfp4(x, "rowwise")
    assert r.global_amax == 1 and r.scale_inv.tolist() == [[r.scale_inv[0, 0], r.scale_inv[0, 1]],
                                                              [r.scale_inv[0, 0], 0x7F]]
    assert np.isnan(r.deq[1, 16:]).all() and np.isfinite(r.deq[1, :16]).all()


def test_nvfp4_block_2d_tiles_share_scales():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 33)).astype(F32)
    x[17, 5] = 40  # tile (1, 0) amax
    row = oracle.nvfp4(x, "rowwise", block_2d=True)
    col = oracle.nvfp4(x, "columnwise", block_2d=True)
    assert np.array_equal(row.deq, col.deq)
    assert row.scale_inv[16, 0] == row.scale_inv[19, 0] == col.scale_inv[0, 1] == col.scale_inv[15, 1]
    assert row.scale_inv.shape == (20, 3) and col.scale_inv.shape == (33, 2)


def test_hadamard_matrix_is_orthogonal_and_signed():
    h = oracle.hadamard_16()
    assert np.array_equal(h @ h.T, np.eye(16, dtype=F32))
    assert np.array_equal(h[:, 0] * 4, f32(1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1))
    assert np.array_equal(np.abs(h), np.full((16, 16), 0.25, F32))


def test_rht_pads_rows_and_inverts():
    x = np.arange(20 * 3, dtype=F32).reshape(20, 3)
    t = oracle.rht_transform(x)
    assert t.shape == (32, 3)
    assert np.array_equal(oracle.rht_inverse(t, 20), x)


def test_e2m1_neighbours():
    lower, upper = oracle.e2m1_neighbours(f32(0.3, -2.5, 6, 0, 4.5))
    assert lower.tolist() == [0, -2, 6, 0, 4] and upper.tolist() == [0.5, -3, 6, 0, 6]


def test_pack_and_unpack_nibbles():
    packed = oracle.pack_nibbles(np.array([[1, 2, 3]], np.uint8))
    assert packed.tolist() == [[0x21, 0x03]]
    assert oracle.unpack_nibbles(packed, 3).tolist() == [[1, 2, 3]]


def test_round_to_dtype_is_round_to_nearest_even():
    got = oracle.round_to_dtype(f32(1 + 2**-8, 1 + 3 * 2**-8), "bfloat16")
    assert got.tolist() == [1.0, 1 + 2**-6]
    got = oracle.round_to_dtype(f32(1 + 2**-11, 1 + 3 * 2**-11), "float16")
    assert got.tolist() == [1.0, 1 + 2**-9]


def test_bitwise_comparison_treats_shared_nan_as_equal():
    oracle.assert_same_bits(f32(np.nan, 1), f32(np.nan, 1))
    with pytest.raises(AssertionError):
        oracle.assert_same_bits(f32(0.0), f32(-0.0))
    with pytest.raises(AssertionError):
        oracle.assert_same_codes(np.array([1, 2], np.uint8), np.array([1, 3], np.uint8))
    oracle.assert_same_codes(np.array([1, 2], np.uint8), np.array([1, 3], np.uint8), mask=np.array([True, False]))
