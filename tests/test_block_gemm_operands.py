"""What the fast GEMM paths of the block formats rest on, checked on the CPU against independent
references: the bf16 operands hold the formats' values exactly, the tensor scale applied to the
result gives back the dequantized value bit for bit, stochastic rounding's draws follow their
counter-based definition, and Blackwell's scale layout places every scale where the tiled layout
puts it."""

import numpy as np
import pytest
import torch

import oracle
from cases import DIRECTIONS
import qtensor
from qtensor import gemm
from qtensor.formats import nvfp4


def varied(rows, cols, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * np.exp2(rng.integers(-12, 12, size=(rows, 1)))
    return torch.from_numpy(x.astype(np.float32))


# ---- stochastic rounding's draws ------------------------------------------------------------------
def numpy_draws(k0, k1, rows, cols):
    """The definition, in uint64 arithmetic masked to 32 bits: elements 2j and 2j+1 of row r share
    h = mix(lo(p) ^ k0 ^ mix(hi(p) ^ k1)), p = r*ceil(cols/2) + j, and draw its low and high 16 bits / 2**16."""
    low32 = np.uint64(0xFFFFFFFF)

    def mix(h):
        h = ((h ^ (h >> np.uint64(16))) * np.uint64(0x21F0AAAD)) & low32
        h = ((h ^ (h >> np.uint64(15))) * np.uint64(0x735A2D97)) & low32
        return h ^ (h >> np.uint64(15))

    draws = np.empty((rows, cols))
    for r in range(rows):
        for c in range(cols):
            p = np.uint64(r * ((cols + 1) // 2) + c // 2)
            h = mix((p & low32) ^ np.uint64(k0) ^ mix((p >> np.uint64(32)) ^ np.uint64(k1)))
            draws[r, c] = float((h >> np.uint64(16 * (c % 2))) & np.uint64(0xFFFF)) / 2.0**16
    return draws


def test_stochastic_draws_follow_their_definition():
    keys = torch.tensor([0xDEADBEEF, 0x12345678], dtype=torch.int64)
    draws = nvfp4.uniform_draws(keys, 37, 45)
    assert draws.dtype == torch.float32
    np.testing.assert_array_equal(draws.double().numpy(), numpy_draws(0xDEADBEEF, 0x12345678, 37, 45))
    assert 0.45 < float(draws.mean()) < 0.55  # 1665 draws in [0, 1)
    assert len(torch.unique(draws)) > 1600  # distinct, the two halves of a hash included


def test_stochastic_draws_past_two_to_the_32_pairs_use_the_high_word():
    keys = torch.tensor([7, 9], dtype=torch.int64)
    p = torch.tensor([5, 5 + 2**32])
    hashes = nvfp4.mix32((p & 0xFFFFFFFF) ^ keys[0] ^ nvfp4.mix32((p >> 32) ^ keys[1]))
    assert hashes[0] != hashes[1]


def test_a_stochastic_cast_draws_its_keys_from_torch_generator():
    """Without a quantizer seed, torch.manual_seed reproduces a cast; another seed changes it."""
    x = varied(64, 96)
    casts = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        casts.append(qtensor.NVFP4Quantizer(stochastic_rounding=True).quantize(x).rowwise.data)
    assert torch.equal(casts[0], casts[1])
    assert not torch.equal(casts[0], casts[2])


# ---- bf16 operands -------------------------------------------------------------------------------
NVFP4_OPTIONS = {"blocks": {}, "tiles": {"block_2d": True}, "rht": {"rht": True}}


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("options", list(NVFP4_OPTIONS))
def test_nvfp4_bf16_operand_times_its_tensor_scale_is_the_dequantized_value(options, direction):
    """q * float(s) is exact in bf16; times 1/S_enc it is the oracle's value bit for bit (in the
    transformed domain for a columnwise copy with the Hadamard transform)."""
    x = varied(70, 96)
    storage = getattr(qtensor.NVFP4Quantizer(**NVFP4_OPTIONS[options]).quantize(x), direction)
    values, tensor_scale = storage.bf16_operand()
    assert values.dtype == torch.bfloat16 and tensor_scale.value().shape == ()
    expected = oracle.nvfp4(x.numpy(), direction, **NVFP4_OPTIONS[options])
    oracle.assert_same_bits(values.float() * tensor_scale.value(), expected.deq_storage, f"{direction} operand")


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_mxfp8_and_float8_bf16_operands_hold_their_values(direction, fp8_dtype):
    """Reduction dimension last: MXFP8's values themselves; Float8's codes, times its scale_inv."""
    x = varied(64, 96)
    k_last = lambda values: values if direction == "rowwise" else values.t()
    q = qtensor.MXFP8Quantizer(fp8_dtype).quantize(x)
    values, tensor_scale = getattr(q, direction).bf16_operand()
    assert tensor_scale is None
    expected = oracle.mxfp8(x.numpy(), direction, "e4m3" if fp8_dtype == torch.float8_e4m3fn else "e5m2")
    oracle.assert_same_bits(k_last(values.float()), expected.deq, f"MXFP8 {direction}")
    q = qtensor.Float8Quantizer(fp8_dtype).quantize(x)
    values, tensor_scale = getattr(q, direction).bf16_operand()
    expected = oracle.float8_current(x.numpy(), "e4m3" if fp8_dtype == torch.float8_e4m3fn else "e5m2")
    oracle.assert_same_bits(k_last(values.float() * tensor_scale.value()), expected.deq, f"Float8 {direction}")


def test_every_pair_of_block_and_per_tensor_formats_has_a_fast_gemm():
    formats = ("float8", "mxfp8", "nvfp4")
    assert all((a, b) in gemm.BACKENDS for a in formats for b in formats)


# ---- Blackwell's scale layout --------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(128, 4), (200, 9), (1, 1), (256, 12)])
def test_swizzled_scales_follow_the_tiled_layout(shape):
    """Scale (r, c) of the [R, C] matrix at tile (r // 128, c // 4) (tiles row-major over a grid
    padded to 128 x 4), offset 16 * (r % 32) + 4 * ((r % 128) // 32) + c % 4 inside its tile."""
    rows, cols = shape
    scales = torch.arange(1, rows * cols + 1, dtype=torch.int64).reshape(rows, cols)
    flat = gemm.swizzle_scales(scales).numpy()
    tile_columns = -(-cols // 4)
    assert flat.shape == (-(-rows // 128) * 128 * tile_columns * 4,)
    expected = np.zeros_like(flat)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * tile_columns + c // 4
            expected[tile * 512 + 16 * (r % 32) + 4 * ((r % 128) // 32) + c % 4] = scales[r, c]
    np.testing.assert_array_equal(flat, expected)
