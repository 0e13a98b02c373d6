"""MXFP8 (32-element blocks, E8M0 scales) numerics, bit-exact against the numpy oracle (docs/numerics.md, MXFP8)."""

import numpy as np
import pytest
import torch

import oracle
from cases import DIRECTIONS, DTYPES, FP8_DTYPES, KIND_SHAPES, as_2d, assert_default_dequantize, assert_holds_only, dtype_id
import qtensor


def assert_matches_oracle(q, x, fp8="e4m3", rule="rceil", directions=DIRECTIONS):
    """Per direction: element codes (outside non-finite blocks), E8M0 scale codes, dequantized values."""
    x2d = as_2d(x)
    for direction in directions:
        expected = oracle.mxfp8(x2d, direction, fp8, rule)
        storage = getattr(q, direction)
        assert storage.data.dtype == FP8_DTYPES[fp8] and storage.scale_inv.dtype == torch.uint8
        oracle.assert_same_codes(storage.data, expected.codes, expected.code_mask, f"{direction} codes")
        oracle.assert_same_codes(storage.scale_inv, expected.scale_inv, what=f"{direction} E8M0 scales")
        oracle.assert_same_bits(q.dequantize(torch.float32, direction), expected.deq.reshape(x.shape),
                                f"{direction} dequantized")
    first = oracle.mxfp8(x2d, directions[0], fp8, rule)
    assert_default_dequantize(q, x, first.deq)


@pytest.mark.parametrize("kind", list(KIND_SHAPES))
@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_matches_oracle_bitwise(inputs, dtype, fp8, rule, kind):
    x = inputs.make(kind, KIND_SHAPES[kind], dtype)
    q = qtensor.MXFP8Quantizer(fp8_dtype=FP8_DTYPES[fp8], scale_rounding=rule).quantize(x)
    assert_matches_oracle(q, x, fp8, rule)


@pytest.mark.parametrize("shape", [(64, 96), (37, 45)], ids=str)
@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_exact_ties_round_to_nearest_even(inputs, dtype, fp8, rule, shape):
    x = inputs.mxfp8_ties(fp8, shape, dtype)
    q = qtensor.MXFP8Quantizer(fp8_dtype=FP8_DTYPES[fp8], scale_rounding=rule).quantize(x)
    assert_matches_oracle(q, x, fp8, rule)


def test_known_block_amaxes_give_known_scale_codes():
    # one row per block amax; rceil (E4M3): 448 -> 127, 449 -> 128, 0 -> 0, 1 -> 119, NaN -> 255
    x = torch.zeros(5, 32)
    x[:, 7] = torch.tensor([448.0, 449.0, 0.0, 1.0, float("nan")])
    rceil = qtensor.MXFP8Quantizer().quantize(x, columnwise=False)
    assert rceil.rowwise.scale_inv[:, 0].tolist() == [127, 128, 0, 119, 255]
    floor = qtensor.MXFP8Quantizer(scale_rounding="floor").quantize(x, columnwise=False)
    assert floor.rowwise.scale_inv[:, 0].tolist() == [127, 127, 0, 119, 255]
    assert floor.dequantize(torch.float32)[1, 7] == 448  # 449 saturates under the floor rule


def test_nonfinite_block_dequantizes_to_nan_in_every_element():
    x = torch.ones(2, 64)
    x[0, 40] = float("nan")
    x[1, 3] = float("inf")
    q = qtensor.MXFP8Quantizer().quantize(x)
    assert q.rowwise.scale_inv.tolist() == [[127 - 8, 255], [255, 127 - 8]]
    row = q.dequantize(torch.float32, "rowwise")
    assert row[0, 32:].isnan().all() and row[1, :32].isnan().all()
    assert (row[0, :32] == 1).all() and (row[1, 32:] == 1).all()
    col = q.dequantize(torch.float32, "columnwise")
    assert (q.columnwise.scale_inv[0, [3, 40]] == 255).all()
    assert col[:, [3, 40]].isnan().all() and (col.isnan().sum() == 4)


@pytest.mark.parametrize("shape", [(45,), (3, 13, 45), (0, 45), (2, 0, 7)], ids=str)
def test_leading_dimensions_fold_into_rows(inputs, shape):
    x = inputs.make("special" if 0 not in shape else "varied", shape, torch.bfloat16)
    q = qtensor.MXFP8Quantizer().quantize(x)
    rows = int(np.prod(shape[:-1]))
    assert q.shape == x.shape
    assert tuple(q.rowwise.scale_inv.shape) == (rows, -(-shape[-1] // 32))
    assert tuple(q.columnwise.scale_inv.shape) == (-(-rows // 32), shape[-1])
    assert_matches_oracle(q, x)


@pytest.mark.parametrize("rowwise, columnwise", [(True, False), (False, True)])
def test_single_direction_quantization_holds_only_that_direction(inputs, rowwise, columnwise):
    x = inputs.make("special", (37, 45), torch.float16)
    q = qtensor.MXFP8Quantizer().quantize(x, rowwise=rowwise, columnwise=columnwise)
    assert_holds_only(q, "rowwise" if rowwise else "columnwise")
    assert_matches_oracle(q, x, directions=("rowwise",) if rowwise else ("columnwise",))
