"""NVFP4 (16-element E2M1 blocks, E4M3 block scales, fp32 tensor scale) numerics against the numpy
oracle (docs/numerics.md, NVFP4): bit-exact for round-to-nearest-even, 2-D blocks and the RHT codes;
distributional for stochastic rounding."""

import ml_dtypes
import numpy as np
import pytest
import torch

import oracle
from cases import DIRECTIONS, DTYPES, KIND_SHAPES, as_2d, assert_default_dequantize, assert_holds_only, dtype_id
import qtensor


def element_codes(storage, length):
    """Unpacked E2M1 nibbles [R, length] of a storage's packed data."""
    assert storage.data.dtype == torch.uint8
    return oracle.unpack_nibbles(oracle.as_codes(storage.data), length)


def assert_storage_matches(storage, expected, direction):
    """Packed codes (outside non-finite blocks; an odd count's padding nibble is zero), E4M3 block
    scales and the global amax of one direction's storage."""
    assert storage.data.dtype == torch.uint8 and storage.scale_inv.dtype == torch.float8_e4m3fn
    assert tuple(storage.data.shape) == expected.packed.shape, f"{direction} packed data shape"
    length = expected.codes.shape[1]
    oracle.assert_same_codes(element_codes(storage, length), expected.codes, expected.code_mask,
                             f"{direction} E2M1 codes")
    if length % 2:
        assert not (oracle.as_codes(storage.data)[:, -1] >> 4).any(), f"{direction} padding nibble"
    oracle.assert_same_codes(storage.scale_inv, expected.stored_scales, what=f"{direction} stored E4M3 scales")
    oracle.assert_same_codes(storage.block_scales(), expected.scale_inv, what=f"{direction} E4M3 block scales")
    oracle.assert_same_bits(storage.global_amax, expected.global_amax, f"{direction} global_amax")


def assert_matches_oracle(q, x, block_2d=False, directions=DIRECTIONS):
    x2d = as_2d(x)
    for direction in directions:
        expected = oracle.nvfp4(x2d, direction, block_2d=block_2d)
        assert_storage_matches(getattr(q, direction), expected, direction)
        oracle.assert_same_bits(q.dequantize(torch.float32, direction), expected.deq.reshape(x.shape),
                                f"{direction} dequantized")
    first = oracle.nvfp4(x2d, directions[0], block_2d=block_2d)
    assert_default_dequantize(q, x, first.deq)


@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("kind", list(KIND_SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_matches_oracle_bitwise(inputs, dtype, kind, block_2d):
    x = inputs.make(kind, KIND_SHAPES[kind], dtype)
    q = qtensor.NVFP4Quantizer(block_2d=block_2d).quantize(x)
    assert_matches_oracle(q, x, block_2d)


@pytest.mark.parametrize("shape", [(64, 96), (37, 45)], ids=str)
@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_exact_ties_round_to_nearest_even(inputs, dtype, block_2d, shape):
    x = inputs.nvfp4_ties(shape, dtype)
    assert oracle.nvfp4(as_2d(x)).global_amax == 2688  # S_enc = 1: the ties stay exact
    q = qtensor.NVFP4Quantizer(block_2d=block_2d).quantize(x)
    assert_matches_oracle(q, x, block_2d)


def order_sensitive_block_amaxes(global_amax, count=48):
    """Block amaxes whose E4M3 scale is e4m3(amax * (S_enc * (1/6))) but would round the other way
    as e4m3((amax * S_enc) / 6) or from the exact product: they land next to E4M3 midpoints."""
    s_enc = oracle.nvfp4_tensor_scale(global_amax)
    encode = np.float32(s_enc * (np.float32(1) / np.float32(6)))
    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    values = np.unique(values[np.isfinite(values) & (values >= 0)])
    near_midpoints = ((values[:-1] + values[1:]).astype(np.float64) / 2 * 6 / np.float64(s_enc)).astype(np.float32)
    candidates = np.concatenate([near_midpoints + k * np.spacing(near_midpoints) for k in range(-3, 4)])
    candidates = candidates[(candidates > 0) & (candidates < global_amax)]

    def e4m3(v):
        return oracle.saturating_cast(v, ml_dtypes.float8_e4m3fn, np.float32(448)).view(np.uint8)

    spec = e4m3(candidates * encode)
    other = (spec != e4m3(candidates * s_enc / np.float32(6))) | (
        spec != e4m3((candidates.astype(np.float64) * s_enc / 6).astype(np.float32)))
    return candidates[other][:count]


def test_block_scale_follows_the_spec_operation_order():
    # docs/numerics.md, NVFP4: s = e4m3(block_amax * (S_enc * (1/6))), each step an fp32 product
    global_amax = np.float32(51.67034149169922)
    amaxes = order_sensitive_block_amaxes(global_amax)
    assert len(amaxes) >= 16
    rng = np.random.default_rng(0)
    x = (rng.uniform(-1, 1, size=(len(amaxes) + 1, 16)) * np.append(amaxes, global_amax)[:, None]).astype(np.float32)
    x[:, 3] = np.append(amaxes, global_amax)
    q = qtensor.NVFP4Quantizer().quantize(torch.from_numpy(x), columnwise=False)
    assert_matches_oracle(q, torch.from_numpy(x), directions=("rowwise",))


def test_nonfinite_block_scale_is_e4m3_nan_and_dequantizes_to_nan():
    x = torch.ones(3, 40)
    x[1, 20] = float("inf")
    x[2, 39] = float("nan")
    q = qtensor.NVFP4Quantizer().quantize(x)
    assert oracle.as_codes(q.rowwise.scale_inv)[1, 1] == 0x7F and oracle.as_codes(q.rowwise.scale_inv)[2, 2] == 0x7F
    assert float(q.rowwise.global_amax) == 1.0  # over finite values only
    row = q.dequantize(torch.float32, "rowwise")
    assert row[1, 16:32].isnan().all() and row[2, 32:].isnan().all() and row.isnan().sum() == 16 + 8
    col = q.dequantize(torch.float32, "columnwise")
    assert col[:, [20, 39]].isnan().all() and col.isnan().sum() == 6


def test_block_2d_directions_share_tile_scales_and_values(inputs):
    x = inputs.make("special", (37, 45), torch.bfloat16)
    q = qtensor.NVFP4Quantizer(block_2d=True).quantize(x)
    oracle.assert_same_bits(q.dequantize(torch.float32, "rowwise"), q.dequantize(torch.float32, "columnwise"),
                            "rowwise vs columnwise")
    row_scales, col_scales = oracle.as_codes(q.rowwise.scale_inv), oracle.as_codes(q.columnwise.scale_inv)
    # One scale per tile: rowwise [tile row, tile column], columnwise its transpose
    assert row_scales.shape == (3, 3) and np.array_equal(row_scales, col_scales.T)
    row_blocks, col_blocks = oracle.as_codes(q.rowwise.block_scales()), oracle.as_codes(q.columnwise.block_scales())
    m, k = np.meshgrid(np.arange(37), np.arange(45), indexing="ij")
    # per block: rowwise [m, k//16] and columnwise [k, m//16] both name tile (m//16, k//16)
    assert np.array_equal(row_blocks[m, k // 16], col_blocks[k, m // 16])
    assert np.array_equal(row_blocks[m, k // 16], row_scales[m // 16, k // 16])


@pytest.mark.parametrize("shape", [(45,), (3, 13, 45), (0, 45), (2, 0, 7)], ids=str)
def test_leading_dimensions_fold_into_rows(inputs, shape):
    x = inputs.make("special" if 0 not in shape else "varied", shape, torch.bfloat16)
    q = qtensor.NVFP4Quantizer().quantize(x)
    assert q.shape == x.shape
    assert_matches_oracle(q, x)


@pytest.mark.parametrize("rowwise, columnwise", [(True, False), (False, True)])
def test_single_direction_quantization_holds_only_that_direction(inputs, rowwise, columnwise):
    x = inputs.make("special", (37, 45), torch.float32)
    q = qtensor.NVFP4Quantizer().quantize(x, rowwise=rowwise, columnwise=columnwise)
    assert_holds_only(q, "rowwise" if rowwise else "columnwise")
    assert_matches_oracle(q, x, directions=("rowwise",) if rowwise else ("columnwise",))


# ---- random Hadamard transform (columnwise only) -------------------------------------------------


@pytest.mark.parametrize("shape", [(64, 96), (37, 45), (3, 5, 24)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rht_columnwise_codes_match_oracle_on_exactly_transformable_data(inputs, dtype, shape):
    x = inputs.rht_exact(shape, dtype)
    q = qtensor.NVFP4Quantizer(rht=True).quantize(x)
    x2d = as_2d(x)
    rows, cols = x2d.shape
    # rowwise is untouched by the RHT
    row = oracle.nvfp4(x2d, "rowwise")
    assert_storage_matches(q.rowwise, row, "rowwise")
    oracle.assert_same_bits(q.dequantize(torch.float32, "rowwise"), row.deq.reshape(x.shape), "rowwise")
    # columnwise covers the rows zero-padded to a multiple of 16
    col = oracle.nvfp4(x2d, "columnwise", rht=True)
    padded_groups = -(-rows // 16)
    assert tuple(q.columnwise.data.shape) == (cols, 8 * padded_groups)
    assert tuple(q.columnwise.scale_inv.shape) == (cols, padded_groups)
    assert_storage_matches(q.columnwise, col, "columnwise")
    assert q.dequantize(torch.float32, "columnwise").shape == x.shape


def rht_error_bound(x2d, expected):
    """Largest original-domain error the RHT columnwise quantization allows: each transformed element
    errs by at most one block unit u = s/S_enc (half an E2M1 step of 2), or by |t| - 6u where it
    saturates; H has entries ±1/4, so an original element errs by at most (1/4) * sum over its group."""
    transformed = oracle.rht_transform(x2d)  # [Mpad, K]
    scale = oracle.as_codes(expected.scale_inv).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    unit = (scale * (np.float32(1) / oracle.nvfp4_tensor_scale(expected.global_amax))).T  # [groups, K]
    unit = np.repeat(unit, 16, axis=0)
    element = np.maximum(unit, np.abs(transformed) - 6 * unit)
    group_sum = element.reshape(-1, 16, element.shape[1]).sum(axis=1)
    return (np.repeat(group_sum, 16, axis=0) / 4)[: x2d.shape[0]], unit[: x2d.shape[0]]


@pytest.mark.parametrize("shape", [(64, 96), (37, 45)], ids=str)
def test_rht_columnwise_dequantize_returns_the_original_domain(inputs, shape):
    x = inputs.make("varied", shape, torch.float32, seed=3)
    x2d = as_2d(x)
    q = qtensor.NVFP4Quantizer(rht=True).quantize(x)
    expected = oracle.nvfp4(x2d, "columnwise", rht=True)
    # the library may sum the transform in another order: the amax can move by an ulp or so
    transformed_amax = np.abs(oracle.rht_transform(x2d)).max()
    np.testing.assert_allclose(oracle.as_f32(q.columnwise.global_amax), transformed_amax, rtol=1e-6)
    got = oracle.as_f32(q.dequantize(torch.float32, "columnwise")).reshape(x2d.shape)
    bound, unit = rht_error_bound(x2d, expected)
    assert (np.abs(got - x2d) <= bound * (1 + 1e-5)).all(), "RHT dequantize error beyond quantization bound"
    # and it agrees with the oracle's inverse transform, except where a different summation order
    # flipped a rounding decision (rare)
    close = np.abs(got - expected.deq) <= 1e-4 * unit
    assert close.mean() >= 0.999, f"{(~close).sum()} of {close.size} differ from the oracle's inverse RHT"


def test_block_2d_with_rht_is_rejected():
    with pytest.raises(ValueError):
        qtensor.NVFP4Quantizer(block_2d=True, rht=True).quantize(torch.ones(32, 32))


# ---- stochastic rounding ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_stochastic_rounding_picks_one_of_the_two_neighbours(inputs, dtype):
    x = inputs.make("varied", (64, 96), dtype)
    q = qtensor.NVFP4Quantizer(stochastic_rounding=True, seed=1).quantize(x)
    rounded_differently = 0
    for direction in DIRECTIONS:
        expected = oracle.nvfp4(as_2d(x), direction)
        storage = getattr(q, direction)
        # scales and the tensor scale are those of round-to-nearest-even
        oracle.assert_same_codes(storage.scale_inv, expected.scale_inv, what=f"{direction} block scales")
        oracle.assert_same_bits(storage.global_amax, expected.global_amax, f"{direction} global_amax")
        codes = element_codes(storage, expected.codes.shape[1])
        values = oracle.e2m1_values(codes)
        lower, upper = oracle.e2m1_neighbours(expected.scaled)
        outside = (values != lower) & (values != upper)
        assert not outside.any(), f"{direction}: {outside.sum()} codes are not a neighbour of x * f"
        rounded_differently += (values != oracle.e2m1_values(expected.codes)).sum()
        deq = oracle.nvfp4_values(codes, expected.scale_inv, expected.global_amax)
        deq = deq if direction == "rowwise" else deq.T
        oracle.assert_same_bits(q.dequantize(torch.float32, direction), deq.reshape(x.shape), direction)
    assert rounded_differently > 0, "stochastic rounding never departed from round-to-nearest-even"


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_stochastic_rounding_is_unbiased(direction):
    # 2000 copies of one [32, 32] tensor; copies are whole blocks with the same global amax, so
    # every copy sees the same x * f and the mean code value must approach it
    copies = 2000
    rng = np.random.default_rng(5)
    base = (rng.standard_normal((32, 32)) * np.exp2(rng.integers(-3, 4, size=(32, 1)))).astype(np.float32)
    expected = oracle.nvfp4(base, direction)  # scaled: [32, 32] in storage layout
    tiled = np.tile(base, (copies, 1)) if direction == "rowwise" else np.tile(base, (1, copies))
    q = qtensor.NVFP4Quantizer(stochastic_rounding=True, seed=0).quantize(
        torch.from_numpy(tiled), rowwise=direction == "rowwise", columnwise=direction == "columnwise")
    storage = getattr(q, direction)
    values = oracle.e2m1_values(element_codes(storage, 32))  # [copies*32, 32] in storage layout
    mean = values.reshape(copies, 32, 32).mean(axis=0)
    lower, upper = oracle.e2m1_neighbours(expected.scaled)
    # the standard error of a mean of 2000 two-point draws is at most 0.011 steps
    bias = np.abs(mean - expected.scaled)
    assert (bias <= 0.1 * np.abs(upper - lower) + 1e-6).all(), f"largest bias {bias.max()}"


def test_stochastic_rounding_with_the_same_seed_is_reproducible(inputs):
    x = inputs.make("varied", (64, 96), torch.float32)
    first = qtensor.NVFP4Quantizer(stochastic_rounding=True, seed=1234).quantize(x)
    second = qtensor.NVFP4Quantizer(stochastic_rounding=True, seed=1234).quantize(x)
    for direction in DIRECTIONS:
        a, b = getattr(first, direction), getattr(second, direction)
        oracle.assert_same_codes(b.data, oracle.as_codes(a.data), what=f"{direction} codes")
        oracle.assert_same_codes(b.scale_inv, oracle.as_codes(a.scale_inv), what=f"{direction} scales")


@pytest.mark.parametrize("shape", [(64, 96), (33, 17), (7, 5), (1, 1), (72, 200)], ids=str)
@pytest.mark.parametrize("kind", ["varied", "special"])
@pytest.mark.parametrize("kept", ["rowwise", "columnwise"])
def test_a_2d_tiled_tensor_rebuilds_its_dropped_copy_as_the_oracle_casts_it(inputs, shape, kind, kept):
    """16x16 tiles hold the same values both ways: a tensor keeping one copy (`update_usage`)
    rebuilds the other, and it is the oracle's cast of that direction, codes, scales and global
    amax (odd sizes, partial tiles, and tiles with NaN and ±Inf included). 1x16 blocks cannot: they
    say so."""
    x = inputs.make(kind, shape, torch.float32)
    dropped = "columnwise" if kept == "rowwise" else "rowwise"
    q = qtensor.NVFP4Quantizer(block_2d=True).quantize(x)
    q.update_usage(**{dropped: False})
    assert getattr(q, dropped) is None
    q.update_usage(**{dropped: True})
    assert_storage_matches(getattr(q, dropped), oracle.nvfp4(as_2d(x), dropped, block_2d=True), dropped)
    one_d = qtensor.NVFP4Quantizer().quantize(x)
    one_d.update_usage(**{dropped: False})
    with pytest.raises(ValueError, match="cannot rebuild"):
        one_d.update_usage(**{dropped: True})


def test_a_file_without_tile_scales_loads_one_scale_per_tile_and_refuses_scales_that_differ_in_a_tile(inputs):
    """Buffers described without `tile_scales` (a file written before the option) hold a scale per
    stored row. Under a quantizer of 16x16 tiles they load with one scale per tile, the codes and
    values unchanged; scales that differ within a tile were not a tiled cast, and loading says so."""
    x = inputs.make("varied", (37, 45), torch.float32)
    tiled = qtensor.NVFP4Quantizer(block_2d=True).quantize(x)
    buffers, metadata = tiled.to_buffers()
    for direction in DIRECTIONS:  # the older layout: each tile's scale repeated down its 16 stored rows
        storage = getattr(tiled, direction)
        buffers[f"{direction}.scale_inv"] = storage.block_scales().clone()
        del metadata[direction]["tile_scales"]
    loaded = qtensor.QuantizedTensor.from_buffers(buffers, metadata)
    for direction in DIRECTIONS:
        mine, theirs = getattr(loaded, direction), getattr(tiled, direction)
        assert mine.tile_scales and torch.equal(mine.scale_inv.view(torch.uint8), theirs.scale_inv.view(torch.uint8))
        assert torch.equal(mine.data, theirs.data)
    oracle.assert_same_bits(loaded.dequantize(torch.float32), tiled.dequantize(torch.float32), "values")
    one_d = qtensor.NVFP4Quantizer().quantize(x)
    buffers, metadata = one_d.to_buffers()
    for direction in DIRECTIONS:
        del metadata[direction]["tile_scales"]
    metadata["quantizer"]["config"]["block_2d"] = True
    with pytest.raises(ValueError, match="differ within a 16x16 tile"):
        qtensor.QuantizedTensor.from_buffers(buffers, metadata)
