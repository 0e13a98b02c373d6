"""Float8 (per-tensor scale) numerics, bit-exact against the numpy oracle (docs/numerics.md, Float8)."""

import numpy as np
import pytest
import torch

import oracle
from cases import DTYPES, FP8_DTYPES, KIND_SHAPES, as_2d, assert_default_dequantize, assert_holds_only, dtype_id
import qtensor


def assert_matches_oracle(q, x, expected, fp8, rowwise=True, columnwise=True):
    """Codes (where the input is finite), scale_inv and dequantized values, per direction."""
    rows, cols = as_2d(x).shape
    if rowwise:
        assert q.rowwise.data.dtype == FP8_DTYPES[fp8]
        oracle.assert_same_codes(q.rowwise.data, expected.codes, expected.code_mask, "rowwise codes")
        oracle.assert_same_bits(q.rowwise.scale_inv, expected.scale_inv, "rowwise scale_inv")
        oracle.assert_same_bits(q.dequantize(torch.float32, "rowwise"), expected.deq.reshape(x.shape),
                                "rowwise dequantized")
    if columnwise:
        # the columnwise copy is the transpose [K, M] holding the same codes
        assert q.columnwise.data.dtype == FP8_DTYPES[fp8]
        assert tuple(q.columnwise.data.shape) == (cols, rows)
        oracle.assert_same_codes(q.columnwise.data, expected.codes.T, expected.code_mask.T, "columnwise codes")
        oracle.assert_same_bits(q.columnwise.scale_inv, expected.scale_inv, "columnwise scale_inv")
        oracle.assert_same_bits(q.dequantize(torch.float32, "columnwise"), expected.deq.reshape(x.shape),
                                "columnwise dequantized")
    assert_default_dequantize(q, x, expected.deq)


@pytest.mark.parametrize("kind", list(KIND_SHAPES))
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_current_scaling_matches_oracle_bitwise(inputs, dtype, fp8, kind):
    x = inputs.make(kind, KIND_SHAPES[kind], dtype)
    q = qtensor.Float8Quantizer(fp8_dtype=FP8_DTYPES[fp8]).quantize(x)
    assert_matches_oracle(q, x, oracle.float8_current(as_2d(x), fp8), fp8)


@pytest.mark.parametrize("exponent", [0, -6])
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_exact_ties_round_to_nearest_even(inputs, dtype, fp8, exponent):
    x = inputs.float8_ties(fp8, (64, 96), dtype, exponent)
    expected = oracle.float8_current(as_2d(x), fp8)
    assert expected.scale == 2.0**-exponent  # so every midpoint stays an exact tie after scaling
    q = qtensor.Float8Quantizer(fp8_dtype=FP8_DTYPES[fp8]).quantize(x)
    assert_matches_oracle(q, x, expected, fp8)


@pytest.mark.parametrize("amax_epsilon, force_pow_2_scales", [(0.0, True), (1.0, False), (1.0, True), (1e-30, True)])
@pytest.mark.parametrize("kind", ["special", "all_tiny"])
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
def test_current_scaling_options_match_oracle(inputs, fp8, kind, amax_epsilon, force_pow_2_scales):
    x = inputs.make(kind, KIND_SHAPES[kind], torch.float32)
    quantizer = qtensor.Float8Quantizer(fp8_dtype=FP8_DTYPES[fp8], amax_epsilon=amax_epsilon,
                                        force_pow_2_scales=force_pow_2_scales)
    expected = oracle.float8_current(as_2d(x), fp8, amax_epsilon, force_pow_2_scales)
    assert_matches_oracle(quantizer.quantize(x), x, expected, fp8)


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
def test_nonfinite_inputs_stay_nonfinite_and_are_left_out_of_the_amax(fp8):
    x = torch.tensor([[1.0, float("nan"), float("inf"), float("-inf"), -2.0]])
    q = qtensor.Float8Quantizer(fp8_dtype=FP8_DTYPES[fp8]).quantize(x)
    fp8_max = {"e4m3": 448, "e5m2": 57344}[fp8]
    scale_inv = np.float32(1) / (np.float32(fp8_max) / np.float32(2))  # amax 2: NaN/Inf ignored
    oracle.assert_same_bits(q.rowwise.scale_inv, scale_inv, "scale_inv")
    infinity = np.nan if fp8 == "e4m3" else np.inf  # E4M3 has no Inf code
    expected = np.array([[1, np.nan, infinity, -infinity, -2]], np.float32)
    for direction in ("rowwise", "columnwise"):
        oracle.assert_same_bits(q.dequantize(torch.float32, direction), expected, direction)


@pytest.mark.parametrize("history_len", [2, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
def test_delayed_scaling_follows_the_amax_history(inputs, fp8, algo, history_len):
    # the first cast's amax is the largest: a window of 2 drops it by the fourth cast; the
    # shrinking-then-growing magnitudes make stale scales saturate; step 2 holds NaN/Inf
    quantizer = qtensor.Float8Quantizer(fp8_dtype=FP8_DTYPES[fp8], scaling="delayed",
                                        amax_history_len=history_len, amax_compute_algo=algo)
    reference = oracle.Float8Delayed(fp8, amax_history_len=history_len, amax_compute_algo=algo)
    for step, magnitude in enumerate([2.0**10, 1.0, 2.0**-8, 2.0**3]):
        x = inputs.make("special" if step == 2 else "varied", (37, 45), torch.float32, seed=step) * magnitude
        assert_matches_oracle(quantizer.quantize(x), x, reference.quantize(as_2d(x)), fp8)


def test_delayed_scaling_first_cast_uses_unit_scale_even_with_amax_epsilon():
    # docs/numerics.md, Float8: scale is 1 while the history is empty; amax_epsilon only floors a history amax
    quantizer = qtensor.Float8Quantizer(scaling="delayed", amax_epsilon=4.0)
    q = quantizer.quantize(torch.tensor([[1.5, -3.0]]))
    oracle.assert_same_bits(q.rowwise.scale_inv, np.float32(1), "first cast scale_inv")
    q = quantizer.quantize(torch.tensor([[1.5, -3.0]]))
    oracle.assert_same_bits(q.rowwise.scale_inv, np.float32(1) / (np.float32(448) / np.float32(4)),
                            "second cast scale_inv (history amax 3 floored to 4)")


@pytest.mark.parametrize("options", [dict(margin=2), dict(margin=127), dict(force_pow_2_scales=True),
                                     dict(amax_epsilon=2.0**25, margin=1, force_pow_2_scales=True)],
                         ids=["margin", "largest_margin", "pow2", "epsilon_margin_pow2"])
def test_delayed_scaling_options_match_oracle(inputs, options):
    quantizer = qtensor.Float8Quantizer(scaling="delayed", **options)
    reference = oracle.Float8Delayed("e4m3", **options)
    for step, magnitude in enumerate([1.0, 2.0**6, 2.0**-3]):
        x = inputs.make("varied", (64, 96), torch.bfloat16, seed=step) * magnitude
        assert_matches_oracle(quantizer.quantize(x), x, reference.quantize(as_2d(x)), "e4m3")


@pytest.mark.parametrize("shape", [(45,), (3, 13, 45), (0, 45), (2, 0, 7)], ids=str)
def test_leading_dimensions_fold_into_rows(inputs, shape):
    x = inputs.make("special" if 0 not in shape else "varied", shape, torch.bfloat16)
    q = qtensor.Float8Quantizer().quantize(x)
    assert q.shape == x.shape and q.dequantize(torch.float32).shape == x.shape
    assert_matches_oracle(q, x, oracle.float8_current(as_2d(x), "e4m3"), "e4m3")


@pytest.mark.parametrize("rowwise, columnwise", [(True, False), (False, True)])
def test_single_direction_quantization_holds_only_that_direction(inputs, rowwise, columnwise):
    x = inputs.make("special", (37, 45), torch.float32)
    q = qtensor.Float8Quantizer().quantize(x, rowwise=rowwise, columnwise=columnwise)
    assert_holds_only(q, "rowwise" if rowwise else "columnwise")
    assert_matches_oracle(q, x, oracle.float8_current(as_2d(x), "e4m3"), "e4m3", rowwise, columnwise)
