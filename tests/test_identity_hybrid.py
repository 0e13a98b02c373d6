"""Identity and hybrid quantization numerics against the numpy oracle (docs/numerics.md, Identity and Hybrid)."""

import pytest
import torch

import oracle
from cases import DIRECTIONS, DTYPES, as_2d, dtype_id
import qtensor

SINGLE_FORMATS = {
    "float8_current": lambda: qtensor.Float8Quantizer(),
    "float8_e5m2_pow2": lambda: qtensor.Float8Quantizer(fp8_dtype=torch.float8_e5m2, force_pow_2_scales=True),
    "mxfp8": lambda: qtensor.MXFP8Quantizer(),
    "mxfp8_floor": lambda: qtensor.MXFP8Quantizer(scale_rounding="floor"),
    "nvfp4": lambda: qtensor.NVFP4Quantizer(),
    "nvfp4_2d": lambda: qtensor.NVFP4Quantizer(block_2d=True),
}


# ---- identity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", [None, torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_identity_dequantize_is_the_input_cast_to_its_dtype(inputs, dtype, target):
    x = inputs.make("special", (3, 13, 45), dtype)
    q = qtensor.IdentityQuantizer(dtype=target).quantize(x)
    stored_dtype = target or dtype
    stored = oracle.round_to_dtype(oracle.as_f32(x), stored_dtype)
    assert q.rowwise.data.dtype == stored_dtype and tuple(q.rowwise.data.shape) == (39, 45)
    oracle.assert_same_bits(q.rowwise.data, stored.reshape(39, 45), "stored data")
    for direction in DIRECTIONS:
        oracle.assert_same_bits(q.dequantize(torch.float32, direction), stored, direction)
    default = q.dequantize()
    assert default.dtype == x.dtype and default.shape == x.shape
    oracle.assert_same_bits(default, oracle.round_to_dtype(stored, dtype), "dequantize()")


@pytest.mark.parametrize("target", [None, "autocast"])
@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
def test_identity_follows_autocast_only_when_asked(inputs, target, autocast):
    """`dtype="autocast"` stores the autocast dtype's rounding under autocast and the input itself
    outside; no dtype stores the input's dtype under autocast too (docs/numerics.md, Identity)."""
    x = inputs.make("special", (8, 64), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        q = qtensor.IdentityQuantizer(dtype=target).quantize(x)
    stored_dtype = torch.bfloat16 if (target == "autocast" and autocast) else torch.float32
    assert q.rowwise.data.dtype == stored_dtype
    oracle.assert_same_bits(q.rowwise.data, oracle.round_to_dtype(oracle.as_f32(x), stored_dtype), "stored data")


# ---- hybrid --------------------------------------------------------------------------------------


def _storage_buffers(storage):
    return {name: getattr(storage, name) for name in ("data", "scale_inv", "global_amax")
            if getattr(storage, name, None) is not None}


@pytest.mark.parametrize("fmt", list(SINGLE_FORMATS))
def test_hybrid_of_one_format_is_bitwise_that_format_alone(inputs, fmt):
    x = inputs.make("special", (64, 96), torch.bfloat16)
    make = SINGLE_FORMATS[fmt]
    alone = make().quantize(x)
    hybrid = qtensor.HybridQuantizer(rowwise=make(), columnwise=make()).quantize(x)
    for direction in DIRECTIONS:
        expected = _storage_buffers(getattr(alone, direction))
        got = _storage_buffers(getattr(hybrid, direction))
        assert got.keys() == expected.keys(), direction
        for name, buffer in expected.items():
            if buffer.is_floating_point() and buffer.element_size() == 4:
                oracle.assert_same_bits(got[name], oracle.as_f32(buffer), f"{direction} {name}")
            else:
                oracle.assert_same_codes(got[name], oracle.as_codes(buffer), what=f"{direction} {name}")
        oracle.assert_same_bits(hybrid.dequantize(torch.float32, direction),
                                oracle.as_f32(alone.dequantize(torch.float32, direction)), direction)
    oracle.assert_same_bits(hybrid.dequantize(), oracle.as_f32(alone.dequantize()), "dequantize()")


def assert_mxfp8_rowwise(q, x, expected):
    oracle.assert_same_codes(q.rowwise.data, expected.codes, expected.code_mask, "rowwise codes")
    oracle.assert_same_codes(q.rowwise.scale_inv, expected.scale_inv, what="rowwise E8M0 scales")
    oracle.assert_same_bits(q.dequantize(torch.float32, "rowwise"), expected.deq.reshape(x.shape), "rowwise")


def assert_nvfp4_columnwise(q, x, expected):
    codes = oracle.unpack_nibbles(oracle.as_codes(q.columnwise.data), expected.codes.shape[1])
    assert tuple(q.columnwise.data.shape) == expected.packed.shape
    oracle.assert_same_codes(codes, expected.codes, expected.code_mask, "columnwise E2M1 codes")
    oracle.assert_same_codes(q.columnwise.scale_inv, expected.scale_inv, what="columnwise E4M3 scales")
    oracle.assert_same_bits(q.columnwise.global_amax, expected.global_amax, "columnwise global_amax")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_mxfp8_rowwise_nvfp4_columnwise_match_their_oracles(inputs, dtype):
    x = inputs.make("special", (37, 45), dtype)
    q = qtensor.HybridQuantizer(rowwise=qtensor.MXFP8Quantizer(), columnwise=qtensor.NVFP4Quantizer()).quantize(x)
    row = oracle.mxfp8(as_2d(x), "rowwise")
    col = oracle.nvfp4(as_2d(x), "columnwise")
    assert_mxfp8_rowwise(q, x, row)
    assert_nvfp4_columnwise(q, x, col)
    oracle.assert_same_bits(q.dequantize(torch.float32, "columnwise"), col.deq.reshape(x.shape), "columnwise")
    oracle.assert_same_bits(q.dequantize(), oracle.round_to_dtype(row.deq, dtype).reshape(x.shape), "dequantize()")


def test_mxfp8_rowwise_nvfp4_rht_columnwise_match_their_oracles(inputs):
    x = inputs.rht_exact((37, 45), torch.bfloat16)
    q = qtensor.HybridQuantizer(rowwise=qtensor.MXFP8Quantizer(),
                                columnwise=qtensor.NVFP4Quantizer(rht=True)).quantize(x)
    assert_mxfp8_rowwise(q, x, oracle.mxfp8(as_2d(x), "rowwise"))
    assert_nvfp4_columnwise(q, x, oracle.nvfp4(as_2d(x), "columnwise", rht=True))


@pytest.mark.parametrize("columnwise_format", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rowwise_dequantized_source_feeds_the_columnwise_child(inputs, dtype, columnwise_format):
    x = inputs.make("special", (37, 45), dtype)
    child = qtensor.NVFP4Quantizer() if columnwise_format == "nvfp4" else qtensor.MXFP8Quantizer()
    q = qtensor.HybridQuantizer(rowwise=qtensor.MXFP8Quantizer(), columnwise=child,
                                columnwise_source="rowwise_dequantized").quantize(x)
    row = oracle.mxfp8(as_2d(x), "rowwise")
    assert_mxfp8_rowwise(q, x, row)
    # the columnwise child sees the rowwise result dequantized in x's dtype
    source = oracle.round_to_dtype(row.deq, dtype)
    if columnwise_format == "nvfp4":
        col = oracle.nvfp4(source, "columnwise")
        assert_nvfp4_columnwise(q, x, col)
    else:
        col = oracle.mxfp8(source, "columnwise")
        oracle.assert_same_codes(q.columnwise.data, col.codes, col.code_mask, "columnwise codes")
        oracle.assert_same_codes(q.columnwise.scale_inv, col.scale_inv, what="columnwise E8M0 scales")
    oracle.assert_same_bits(q.dequantize(torch.float32, "columnwise"), col.deq.reshape(x.shape), "columnwise")
