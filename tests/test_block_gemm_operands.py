"""What the fast GEMM paths of the block formats rest on, checked on the CPU against independent
references: the bf16 and block-scaled operands hold the formats' values exactly, the tensor scale
applied to the result gives back the dequantized value bit for bit, stochastic rounding's draws
follow their counter-based definition, Blackwell's scale layout places every scale where the tiled
layout puts it, and the backend a pair of storages runs on follows the operand forms they offer."""

import threading
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
import torch

import oracle
from cases import DIRECTIONS
import qtensor
from qtensor import gemm
from qtensor.gemm import backends
from qtensor.formats import nvfp4, nvfp4_draws


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
    draws = nvfp4_draws.uniform_draws(keys, 37, 45)
    assert draws.dtype == torch.float32
    np.testing.assert_array_equal(draws.double().numpy(), numpy_draws(0xDEADBEEF, 0x12345678, 37, 45))
    assert 0.45 < float(draws.mean()) < 0.55  # 1665 draws in [0, 1)
    assert len(torch.unique(draws)) > 1600  # distinct, the two halves of a hash included


def test_stochastic_draws_past_two_to_the_32_pairs_use_the_high_word():
    keys = torch.tensor([7, 9], dtype=torch.int64)
    p = torch.tensor([5, 5 + 2**32])
    hashes = nvfp4_draws.mix32((p & 0xFFFFFFFF) ^ keys[0] ^ nvfp4_draws.mix32((p >> 32) ^ keys[1]))
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


def k_last_values(operand):
    """fp32 values of a block-scaled operand, decoded from its own fields: [R, K]."""
    data = operand.data.view(torch.uint8).numpy()
    if operand.block_size == 32:  # FP8 codes times 2**(E8M0 code - 127)
        fp8 = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e5m2: ml_dtypes.float8_e5m2}[operand.data.dtype]
        values = data.view(fp8).astype(np.float32)
        scales = np.exp2(operand.scales.view(torch.uint8).numpy().astype(np.float32) - 127)
    else:  # E2M1 pairs (element 2i in the low nibble) times E4M3 scales, times the tensor scale
        codes = oracle.unpack_nibbles(data, operand.length)
        values = np.where(codes & 8, -1, 1) * oracle.E2M1_MAGNITUDES[codes & 7]
        scales = operand.scales.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    per_element = np.repeat(scales, operand.block_size, axis=1)[:, : operand.length]
    values = (values * per_element).astype(np.float32)
    if operand.tensor_scale is not None:
        values = (values * operand.tensor_scale.value().numpy()).astype(np.float32)
    return values


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_mxfp8_block_scaled_operand_holds_its_values_reduction_dimension_last(fp8_dtype, direction):
    x = varied(64, 96)
    operand = getattr(qtensor.MXFP8Quantizer(fp8_dtype).quantize(x), direction).block_scaled_operand()
    assert operand.data.is_contiguous() and operand.scales.dtype == torch.float8_e8m0fnu and operand.tensor_scale is None
    expected = oracle.mxfp8(x.numpy(), direction, "e4m3" if fp8_dtype == torch.float8_e4m3fn else "e5m2").deq
    oracle.assert_same_bits(k_last_values(operand), expected if direction == "rowwise" else expected.T, f"MXFP8 {direction}")


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("options", ["blocks", "tiles"])
def test_nvfp4_block_scaled_operand_holds_its_values_times_its_tensor_scale(options, direction):
    x = varied(70, 96)
    operand = getattr(qtensor.NVFP4Quantizer(**NVFP4_OPTIONS[options]).quantize(x), direction).block_scaled_operand()
    assert operand.data.dtype == torch.float4_e2m1fn_x2 and operand.scales.dtype == torch.float8_e4m3fn
    expected = oracle.nvfp4(x.numpy(), direction, **NVFP4_OPTIONS[options])
    oracle.assert_same_bits(k_last_values(operand), expected.deq_storage, f"NVFP4 {direction}")


def test_a_transformed_nvfp4_copy_offers_no_block_scaled_operand():
    """The native GEMM takes the values themselves: wgrad's Hadamard-domain copies stay on bf16."""
    q = qtensor.NVFP4Quantizer(rht=True).quantize(varied(64, 96))
    assert q.columnwise.block_scaled_operand() is None and q.columnwise.reduction_transform() == "rht"
    assert q.rowwise.block_scaled_operand() is not None and q.rowwise.reduction_transform() is None


# ---- which backend runs a pair: the operand forms its storages offer -------------------------------
QUANTIZERS = {
    "float8": lambda: qtensor.Float8Quantizer(),
    "float8_e5m2": lambda: qtensor.Float8Quantizer(torch.float8_e5m2),
    "mxfp8": lambda: qtensor.MXFP8Quantizer(),
    "nvfp4": lambda: qtensor.NVFP4Quantizer(),
    "nvfp4_rht": lambda: qtensor.NVFP4Quantizer(rht=True),
    "mxfp8_fwd_nvfp4_bwd": lambda: qtensor.HybridQuantizer(qtensor.MXFP8Quantizer(), qtensor.NVFP4Quantizer()),
    "identity": lambda: qtensor.IdentityQuantizer(torch.bfloat16),
    "identity_fp32": lambda: qtensor.IdentityQuantizer(),
    "float8_rowwise": lambda: qtensor.Float8BlockQuantizer(block_rows=1, block_cols=None),
    "float8_1x128": lambda: qtensor.Float8BlockQuantizer(block_rows=1, block_cols=128),
    "float8_128x128": lambda: qtensor.Float8BlockQuantizer(block_rows=128, block_cols=128),
}
CPU, AMPERE, HOPPER, BLACKWELL = None, (8, 0), (9, 0), (10, 0)
MKN = (64, 128, 32)

# (device, A's quantizer, B's quantizer, GEMM, [M, K, N]) → the backend that runs it.
SELECTION = [
    (HOPPER, "float8", "float8", "fprop", MKN, "float8_scaled_mm"),
    (HOPPER, "float8", "float8_e5m2", "wgrad", MKN, "float8_scaled_mm"),
    (HOPPER, "float8_e5m2", "float8_e5m2", "dgrad", MKN, "reference"),  # no E5M2 x E5M2 FP8 GEMM, and Float8 pairs
    (HOPPER, "float8", "float8", "fprop", (40, 128, 32), "reference"),  # never fall back to the bf16 one
    (AMPERE, "float8", "float8", "fprop", MKN, "reference"),
    (AMPERE, "mxfp8", "mxfp8", "fprop", MKN, "dequantized_bf16_mm"),
    (HOPPER, "mxfp8", "mxfp8", "dgrad", MKN, "dequantized_bf16_mm"),
    (HOPPER, "mxfp8", "nvfp4", "fprop", MKN, "dequantized_bf16_mm"),
    (HOPPER, "float8", "nvfp4", "wgrad", MKN, "dequantized_bf16_mm"),
    (HOPPER, "mxfp8_fwd_nvfp4_bwd", "mxfp8_fwd_nvfp4_bwd", "dgrad", MKN, "dequantized_bf16_mm"),
    (HOPPER, "nvfp4_rht", "nvfp4_rht", "wgrad", MKN, "dequantized_bf16_mm"),  # the transform cancels
    (HOPPER, "nvfp4_rht", "nvfp4", "wgrad", MKN, "reference"),  # one transformed copy, one not
    (HOPPER, "identity", "float8", "fprop", MKN, "dequantized_bf16_mm"),  # bf16 values are their own bf16 operand
    (HOPPER, "identity", "identity", "wgrad", MKN, "dequantized_bf16_mm"),  # float8_rowwise_gw_hp's weight gradient
    (HOPPER, "identity_fp32", "identity_fp32", "wgrad", MKN, "reference"),  # fp32 values bf16 cannot hold
    (BLACKWELL, "mxfp8", "mxfp8", "wgrad", MKN, "block_scaled_mm"),
    (BLACKWELL, "nvfp4", "nvfp4", "fprop", MKN, "block_scaled_mm"),
    (BLACKWELL, "mxfp8_fwd_nvfp4_bwd", "mxfp8_fwd_nvfp4_bwd", "fprop", MKN, "block_scaled_mm"),
    (BLACKWELL, "mxfp8_fwd_nvfp4_bwd", "mxfp8_fwd_nvfp4_bwd", "wgrad", MKN, "block_scaled_mm"),
    (BLACKWELL, "mxfp8", "nvfp4", "fprop", MKN, "dequantized_bf16_mm"),  # blocks of 32 and of 16 do not meet
    (BLACKWELL, "mxfp8", "mxfp8", "fprop", (64, 48, 32), "dequantized_bf16_mm"),  # K not a multiple of 32
    (BLACKWELL, "nvfp4_rht", "nvfp4_rht", "wgrad", MKN, "dequantized_bf16_mm"),
    (BLACKWELL, "float8", "float8", "dgrad", MKN, "float8_scaled_mm"),
    (HOPPER, "float8_1x128", "float8_128x128", "fprop", MKN, "float8_block_scaled_mm"),
    (HOPPER, "float8_1x128", "float8_1x128", "wgrad", (256, 128, 32), "float8_block_scaled_mm"),  # K = M, 128 blocks
    (HOPPER, "float8_128x128", "float8_128x128", "fprop", MKN, "reference"),  # no 128x128 x 128x128 GEMM
    (HOPPER, "float8_rowwise", "float8_rowwise", "dgrad", MKN, "float8_block_scaled_mm"),
    (HOPPER, "float8_rowwise", "float8_1x128", "fprop", MKN, "reference"),  # row-wise beside blocks
    (BLACKWELL, "float8_1x128", "float8_128x128", "fprop", MKN, "reference"),  # Hopper's scalings only
    (AMPERE, "float8_rowwise", "float8_rowwise", "fprop", MKN, "reference"),
    (CPU, "float8", "float8", "fprop", MKN, "reference"),
    (CPU, "mxfp8", "mxfp8", "fprop", MKN, "reference"),
]


def zeros_product(a, b, *args, out_dtype=torch.float32, output_dtype=None, **kwargs):
    """A stand-in for torch's fast GEMMs, which the CPU has none of: only the shape matters here."""
    return torch.zeros(a.shape[0], b.shape[1], dtype=output_dtype or out_dtype)


@pytest.mark.parametrize("capability,a,b,which,mkn,expected", SELECTION)
def test_the_backend_of_a_pair_follows_the_operand_forms_its_storages_offer(capability, a, b, which, mkn, expected):
    m, k, n = mkn
    x, w, g = varied(m, k, 1), varied(n, k, 2), varied(m, n, 3)
    qa, qb = QUANTIZERS[a](), QUANTIZERS[b]()
    a_tensor, a_direction, b_tensor, b_direction = {
        "fprop": (qa.quantize(x), "rowwise", qb.quantize(w), "rowwise"),
        "dgrad": (qa.quantize(g), "rowwise", qb.quantize(w), "columnwise"),
        "wgrad": (qa.quantize(g), "columnwise", qb.quantize(x), "columnwise"),
    }[which]
    device = torch.device("cpu") if capability is None else torch.device("cuda", 0)
    with (
        mock.patch.object(backends, "_capability", lambda index: capability),
        mock.patch.object(torch.version, "cuda", "12.9"),  # the CPU build has none; Hopper's block scaling needs 12.9
        mock.patch.object(torch, "_scaled_mm", zeros_product),
        mock.patch.object(torch.nn.functional, "scaled_mm", zeros_product),
        mock.patch.object(torch, "mm", zeros_product),
    ):
        a_storage, b_storage = a_tensor.storage_for(a_direction).oriented(a_direction), b_tensor.storage_for(b_direction).oriented(b_direction)
        fast = backends._fast_product(a_storage, b_storage, device, None, torch.float32, False)
    assert (fast[0] if fast else "reference") == expected
    if fast:
        assert fast[1].shape == (m if which != "wgrad" else n, n if which == "fprop" else k)


def test_every_pair_of_float8_mxfp8_and_nvfp4_storages_offers_the_bf16_form():
    """So every such pair, hybrid children included, has a fast GEMM on any GPU with bf16 tensor cores."""
    x = varied(64, 96)
    storages = [
        getattr(QUANTIZERS[name]().quantize(x), direction)
        for name in ("float8", "mxfp8", "nvfp4", "nvfp4_rht")
        for direction in DIRECTIONS
    ]
    assert all(storage.bf16_operand() is not None for storage in storages)
    assert qtensor.IdentityQuantizer().quantize(x).rowwise.bf16_operand() is None


def test_backend_counts_count_every_gemm_of_every_thread():
    x, w = qtensor.MXFP8Quantizer().quantize(varied(32, 64)), qtensor.MXFP8Quantizer().quantize(varied(16, 64, 1))
    gemm.backend_counts(reset=True)
    threads = [threading.Thread(target=lambda: [gemm.fprop(x, w) for _ in range(50)]) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert gemm.backend_counts(reset=True) == {"reference": 400}
    assert gemm.backend_counts() == {}


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
