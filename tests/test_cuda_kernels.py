"""The fast GPU paths equal their pure-torch references: the Float8 Triton kernels bit for bit, the
FP8 tensor-core GEMMs within the bound of Hopper's FP8 accumulation, and a training step of any
recipe makes no host synchronisation. Skipped without a GPU; run on the device machine."""

from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

import qtensor
from qtensor import gemm
from qtensor.gemm import backends
from qtensor.core import kernels
from qtensor.core.kernels import lookup, reference_kernels
from qtensor.core.groups import RowGroups

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def hard_input(rows, cols, dtype, seed=0):
    from test_cuda import hard_input as hard

    return hard(rows, cols, dtype, seed).cuda()


def varied(rows, cols, seed):
    generator = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.randint(-8, 8, (rows, cols), generator=generator).float())
    return (torch.randn(rows, cols, generator=generator) * magnitude).cuda()


QUANTIZERS = {
    "e4m3": lambda: qtensor.Float8Quantizer(),
    "e5m2": lambda: qtensor.Float8Quantizer(torch.float8_e5m2),
    "e4m3_pow2_eps": lambda: qtensor.Float8Quantizer(force_pow_2_scales=True, amax_epsilon=1e-3),
    "delayed": lambda: qtensor.Float8Quantizer(scaling="delayed", amax_history_len=4),
    "delayed_e5m2_recent_margin_pow2_eps": lambda: qtensor.Float8Quantizer(
        torch.float8_e5m2, scaling="delayed", amax_history_len=3, amax_compute_algo="most_recent", margin=3,
        force_pow_2_scales=True, amax_epsilon=1e-2,
    ),
}


def raw(q):
    out = {}
    for direction in ("rowwise", "columnwise"):
        storage = getattr(q, direction)
        if storage is not None:
            out[f"{direction}.data"] = storage.data.view(torch.uint8).cpu()
            out[f"{direction}.scale_inv"] = storage.scale_inv.cpu()
    return out


def test_every_kernel_of_the_table_is_registered_on_a_gpu():
    """The loader `import qtensor` hands the table registered a kernel under every name: none was
    lost to an import that failed quietly, so the tests below compare kernels, not the reference
    with itself."""
    assert kernels.registered() == set(kernels.REFERENCES)
    x = torch.ones(4, 4, device="cuda")
    assert lookup("float8.cast", x) is kernels.TABLE.eager["float8.cast"]


_COMPILED_FIRST = """
import torch
from torch import nn
import qtensor
from qtensor.core import kernels
torch.manual_seed(0)
layer = nn.Linear(128, 64, device="cuda")
qtensor.quantize_(layer, qtensor.recipes.nvfp4())
x = torch.randn(32, 128, device="cuda")
compiled = torch.compile(layer)(x)  # the first lookup of the process comes while dynamo traces
assert kernels.TABLE.loaded and set(kernels.TABLE.compiled) >= {"nvfp4.cast", "nvfp4.amaxes"}, kernels.TABLE.compiled
torch.testing.assert_close(compiled, layer(x), rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_a_model_compiled_before_any_eager_step_loads_the_kernels():
    """The table's loader runs outside the traced graph when the first lookup comes under torch.compile."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _COMPILED_FIRST], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.parametrize("shape", [(256, 512), (68, 200), (4, 3), (37, 45), (1, 1), (130, 7), (0, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_float8_cast_kernel_is_bitwise_the_reference(name, dtype, shape):
    x = hard_input(max(shape[0], 8), max(shape[1], 64), dtype)[: shape[0], : shape[1]] if shape[0] else torch.zeros(shape, dtype=dtype, device="cuda")
    fast_quantizer, reference_quantizer = QUANTIZERS[name](), QUANTIZERS[name]()
    for step in range(3):  # delayed scaling: the history moves on the device
        fast = fast_quantizer.quantize(x * (step + 1), rowwise=True, columnwise=True)
        with reference_kernels():
            reference = reference_quantizer.quantize(x * (step + 1), rowwise=True, columnwise=True)
        fast_raw, reference_raw = raw(fast), raw(reference)
        assert fast_raw.keys() == reference_raw.keys()
        for key in fast_raw:
            assert torch.equal(fast_raw[key], reference_raw[key]), key
    if fast_quantizer.scaling == "delayed":
        assert torch.equal(fast_quantizer.amax_history, reference_quantizer.amax_history)


COMPILED_QUANTIZERS = {
    **{name: make for name, make in QUANTIZERS.items() if not name.startswith("delayed")},
    "mxfp8_rceil": lambda: qtensor.MXFP8Quantizer(),
    "mxfp8_floor_e5m2": lambda: qtensor.MXFP8Quantizer(torch.float8_e5m2, scale_rounding="floor"),
}


@pytest.mark.parametrize("shape", [(256, 512), (68, 200), (37, 45)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(COMPILED_QUANTIZERS))
def test_casts_traced_by_inductor_are_bitwise_the_reference(name, dtype, shape):
    """Under torch.compile the Float8 and MXFP8 casts are the references' torch ops, fused by
    inductor into Triton kernels of its own (whose fp32 division is not correctly rounded and whose
    FP8 conversion saturates): the bytes must still be the reference's, NaN, ±Inf, ties, subnormals
    and huge values included, with a producer (x · 3) fused in. Inductor hands a fused producer's
    bf16 result on unrounded unless told to round it as eager does (emulate_precision_casts; an
    MXFP8 cast fuses with its producer, so without it the cast sees x · 3 in fp32): the cast is
    checked on the values eager gives it."""
    from qtensor.core.storage import DIRECTIONS

    quantizer = COMPILED_QUANTIZERS[name]()

    def buffers(x):  # the cast's storages (a quantized tensor is built inside a compiled step, not returned)
        storages = quantizer._quantize_2d(x * 3, True, True)
        return {f"{d}.{n}": b.reshape(-1).view(torch.uint8) for d, st in zip(DIRECTIONS, storages) for n, b in st.buffers.items()}

    torch._dynamo.reset()
    compiled = torch.compile(buffers)
    with mock.patch.object(torch._inductor.config, "emulate_precision_casts", True):
        for seed in range(2):
            x = hard_input(max(shape[0], 8), max(shape[1], 64), dtype, seed=seed)[: shape[0], : shape[1]]
            got = compiled(x)
            with reference_kernels():
                expected = buffers(x)
            assert got.keys() == expected.keys()
            for key, value in expected.items():
                assert torch.equal(got[key], value), key


@pytest.mark.parametrize("numel", [0, 1, 4097, 9_000_001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_amax_kernel_equals_the_reference(dtype, numel):
    """Partial amaxes over a grid-stride loop (9M elements: several blocks per program), NaN and
    ±Inf ignored."""
    from qtensor.core.numerics import finite_amax

    x = varied(1, numel, seed=numel).to(dtype).reshape(-1)
    if numel > 3:
        x[[0, numel // 2, -1]] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype, device="cuda")
    fast = finite_amax(x)
    with reference_kernels():
        reference = finite_amax(x)
    assert fast.shape == reference.shape == () and torch.equal(fast, reference)


@pytest.mark.parametrize("magnitude", [0.0, 1e-39, 1e-30, 3.0, 1e38, 3.3e38])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_float8_scale_edges_are_bitwise_the_reference(name, magnitude):
    """Scales computed in the kernels: amax 0 (scale 1), an fp32 subnormal amax (the quotient
    overflows to FLT_MAX), huge amaxes (tiny scales, subnormal reciprocals)."""
    x = torch.full((32, 64), magnitude, device="cuda")
    x[::2] *= -0.75
    fast_quantizer, reference_quantizer = QUANTIZERS[name](), QUANTIZERS[name]()
    for _ in range(2):
        fast = raw(fast_quantizer.quantize(x))
        with reference_kernels():
            reference = raw(reference_quantizer.quantize(x))
        for key in fast:
            assert torch.equal(fast[key], reference[key]), key


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_dequantize_kernel_equals_the_reference(fp8_dtype, out_dtype):
    q = qtensor.Float8Quantizer(fp8_dtype).quantize(hard_input(96, 160, torch.float32), columnwise=False)
    fast = q.dequantize(out_dtype)
    with reference_kernels():
        reference = q.dequantize(out_dtype)
    assert torch.equal(torch.isnan(fast), torch.isnan(reference))  # NaN payloads may differ
    assert torch.equal(fast.nan_to_num(0.0), reference.nan_to_num(0.0))


# Hopper's FP8 tensor cores accumulate in reduced precision inside each K chunk before cuBLAS
# promotes the partial sums to fp32: the products are exact, the sums are not fp32's. The bound is
# relative to sum |a||b| (the scale of the accumulation), measured ratios are printed.
FP8_ACCUMULATION = 2.0**-9


# fp32 accumulation in any order: k roundings of at most 2**-24 relative each, bounded as in
# the accumulation-order tolerance of docs/design.md, The three GEMMs.
FP32_ACCUMULATION = 1e-5


def assert_close_to_reference(actual, a, b, out_dtype, bias=None, accumulation=FP8_ACCUMULATION):
    """|actual - (a @ b + bias)| <= accumulation * (|a| @ |b|) (+ half a bf16 ulp when rounded
    to bf16), the reference product taken in float64 on the CPU."""
    a, b = a.double().cpu().numpy(), b.double().cpu().numpy()
    expected = a @ b + (0.0 if bias is None else bias.double().cpu().numpy())
    bound = accumulation * (np.abs(a) @ np.abs(b)) + 1e-30
    if out_dtype == torch.bfloat16:
        bound = bound + np.abs(expected) * 2.0**-8
    error = np.abs(actual.double().cpu().numpy() - expected)
    ratio = float(np.max(error / bound))
    print(f"max error / bound: {ratio:.3g}")
    assert ratio <= 1.0


def check_the_three_gemms(quantizer, grad_quantizer, backend, out_dtype, accumulation, weight_quantizer=None):
    """fprop (with bias), dgrad and wgrad of quantized operands all run on `backend`, each within
    `accumulation` of the float64 product of the operands' dequantized values."""
    m, k, n = 256, 4096, 128
    x = quantizer().quantize(varied(m, k, 1))
    w = (weight_quantizer or quantizer)().quantize(varied(n, k, 2))
    g = grad_quantizer().quantize(varied(m, n, 3))
    bias = varied(1, n, 4)[0].to(out_dtype)
    gemm.backend_counts(reset=True)
    results = {
        "fprop": (gemm.fprop(x, w, bias, out_dtype), x.dequantize(torch.float32), w.dequantize(torch.float32).t()),
        "dgrad": (gemm.dgrad(g, w, out_dtype), g.dequantize(torch.float32), w.dequantize(torch.float32, "columnwise")),
        "wgrad": (gemm.wgrad(g, x, out_dtype), g.dequantize(torch.float32, "columnwise").t(), x.dequantize(torch.float32, "columnwise")),
    }
    assert gemm.backend_counts() == {backend: 3}
    for name, (actual, a, b) in results.items():
        assert actual.dtype == out_dtype, name
        assert_close_to_reference(actual.float(), a, b, out_dtype, bias if name == "fprop" else None, accumulation)


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape, strided", [((1, 1), False), ((3, 200), False), ((127, 129), False), ((4096, 64), False), ((130, 70), True)])
def test_float8_transpose_kernel_writes_the_transposed_bytes(fp8_dtype, shape, strided):
    """The tiled transpose (the columnwise codes an FSDP2 gather rebuilds) writes, byte for byte, the
    numpy transpose of the codes: ragged edge tiles, a strided source, both FP8 formats."""
    generator = torch.Generator().manual_seed(0)
    rows, cols = shape
    codes = torch.randint(0, 256, (rows, cols * (2 if strided else 1)), dtype=torch.uint8, generator=generator)
    source = codes[:, ::2] if strided else codes
    expected = np.ascontiguousarray(source.numpy().T)
    out = torch.full((cols, rows), 7, dtype=torch.uint8, device="cuda").view(fp8_dtype)
    lookup("float8.transpose", out)(source.cuda().view(fp8_dtype), out)
    np.testing.assert_array_equal(out.view(torch.uint8).cpu().numpy(), expected)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_float8_tensor_core_gemms_agree_with_the_reference(out_dtype):
    e5m2 = lambda: qtensor.Float8Quantizer(torch.float8_e5m2)
    check_the_three_gemms(qtensor.Float8Quantizer, e5m2, "float8_scaled_mm", out_dtype, FP8_ACCUMULATION)


# fprop with fast accumulation (the Float8 recipes' default): the partial sums stay in the tensor
# cores' reduced-precision accumulator over all of K. Measured on an H100 and an H200 (the ratios
# printed): see docs/numerics.md, FP8 GEMMs, for the figures and the bound.
FP8_FAST_ACCUMULATION = 2.0**-7


@pytest.mark.parametrize("k", [1024, 4096, 16384])
@pytest.mark.parametrize("fast", [False, True], ids=["split", "fast"])
def test_float8_fprop_accumulation_error_is_bounded(fast, k):
    """|fprop - exact| <= bound · (|X| @ |W|ᵀ) over K, for the split accumulator (2**-9) and for
    fast accumulation (2**-7)."""
    x = qtensor.Float8Quantizer().quantize(varied(128, k, 5))
    w = qtensor.Float8Quantizer().quantize(varied(256, k, 6))
    gemm.backend_counts(reset=True)
    got = gemm.fprop(x, w, None, torch.float32, fast_accumulation=fast)
    assert gemm.backend_counts() == {"float8_scaled_mm": 1}
    bound = FP8_FAST_ACCUMULATION if fast else FP8_ACCUMULATION
    assert_close_to_reference(got, x.dequantize(torch.float32), w.dequantize(torch.float32).t(), torch.float32, accumulation=bound)


@pytest.mark.parametrize("recipe", ["float8_current", "float8_delayed", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd"])
@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_a_linear_training_step_makes_no_host_sync(recipe, weights):
    """Forward, backward and the MasterWeights step of a quantized layer, under sync debug "error"."""
    torch.manual_seed(0)
    layer = nn.Linear(512, 256, device="cuda", dtype=torch.bfloat16)
    qtensor.quantize_(layer, getattr(qtensor.recipes, recipe)(), weights=weights)
    optimizer = qtensor.optim.MasterWeights(torch.optim.SGD(layer.parameters(), lr=1e-3))
    x = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        layer(x).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up: kernels compiled, running state moved to the GPU
    gemm.backend_counts(reset=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if recipe.startswith("float8"):
        assert gemm.backend_counts() == {"float8_scaled_mm": 3}
    if recipe in ("mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd"):
        assert gemm.backend_counts() == {"dequantized_bf16_mm": 3}


@pytest.mark.parametrize("name", ["e4m3", "delayed"])
def test_a_shard_quantized_inside_sharded_cast_casts_as_the_whole(name):
    """The sharded path of the kernels (a 0-d amax reduced over the group; delayed scaling's partial
    amaxes reduced before they are recorded), on a one-rank NCCL group: bytes and history as unsharded."""
    import torch.distributed as dist

    from qtensor.core.numerics import sharded_cast

    x = hard_input(96, 160, torch.bfloat16)
    sharded_quantizer, whole_quantizer = QUANTIZERS[name](), QUANTIZERS[name]()
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        for _ in range(2):
            with sharded_cast(dist.group.WORLD):
                sharded = raw(sharded_quantizer.quantize(x))
            whole = raw(whole_quantizer.quantize(x))
            for key in whole:
                assert torch.equal(sharded[key], whole[key]), key
    finally:
        dist.destroy_process_group()
    if name == "delayed":
        assert torch.equal(sharded_quantizer.amax_history, whole_quantizer.amax_history)


# ---- MXFP8 --------------------------------------------------------------------------------------
MX_QUANTIZERS = {
    "e4m3_rceil": lambda: qtensor.MXFP8Quantizer(),
    "e4m3_floor": lambda: qtensor.MXFP8Quantizer(scale_rounding="floor"),
    "e5m2_rceil": lambda: qtensor.MXFP8Quantizer(torch.float8_e5m2),
    "e5m2_floor": lambda: qtensor.MXFP8Quantizer(torch.float8_e5m2, scale_rounding="floor"),
}


def mx_raw(q):
    return {
        f"{d}.{name}": getattr(getattr(q, d), name).view(torch.uint8).cpu()
        for d in ("rowwise", "columnwise")
        if getattr(q, d) is not None
        for name in ("data", "scale_inv")
    }


@pytest.mark.parametrize("directions", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("shape", [(96, 160), (64, 64), (37, 45), (130, 7), (1, 1), (0, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(MX_QUANTIZERS))
def test_mxfp8_cast_kernel_is_bitwise_the_reference(name, dtype, shape, directions):
    """NaN, ±Inf, subnormal and huge values (hard_input), partial blocks, fp32 subnormal amaxes."""
    x = hard_input(max(shape[0], 8), max(shape[1], 64), dtype)[: shape[0], : shape[1]] if shape[0] else torch.zeros(shape, dtype=dtype, device="cuda")
    rowwise, columnwise = directions
    fast = mx_raw(MX_QUANTIZERS[name]().quantize(x, rowwise=rowwise, columnwise=columnwise))
    with reference_kernels():
        reference = mx_raw(MX_QUANTIZERS[name]().quantize(x, rowwise=rowwise, columnwise=columnwise))
    assert fast.keys() == reference.keys()
    for key in fast:
        assert torch.equal(fast[key], reference[key]), key


@pytest.mark.parametrize("magnitude", [0.0, 1e-44, 1e-39, 2.0**-120, 3.0, 3.3e38])
@pytest.mark.parametrize("name", list(MX_QUANTIZERS))
def test_mxfp8_scale_edges_are_bitwise_the_reference(name, magnitude):
    x = torch.full((64, 96), magnitude, device="cuda")
    x[::3] *= -0.625
    x[:, 40:] *= 2.0**-7
    fast = mx_raw(MX_QUANTIZERS[name]().quantize(x))
    with reference_kernels():
        reference = mx_raw(MX_QUANTIZERS[name]().quantize(x))
    for key in fast:
        assert torch.equal(fast[key], reference[key]), key


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_mxfp8_dequantize_kernel_equals_the_reference(fp8_dtype, direction, out_dtype):
    q = qtensor.MXFP8Quantizer(fp8_dtype).quantize(hard_input(96, 150, torch.float32))
    fast = q.dequantize(out_dtype, direction)
    with reference_kernels():
        reference = q.dequantize(out_dtype, direction)
    assert torch.equal(torch.isnan(fast), torch.isnan(reference))
    assert torch.equal(fast.nan_to_num(0.0), reference.nan_to_num(0.0))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("values", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_mxfp8_grouped_copies_as_values_are_the_reference_copies_values(fp8_dtype, values, padded):
    """A grouped GEMM's copy asked for as values is the cast writing bf16 values instead of codes:
    each must be the reference copy's dequantized bf16 values, bit for bit (NaN where they are NaN),
    and a copy not asked for as values keeps the reference's codes."""
    lengths = (40, 0, 25, 31) if padded else (64, 0, 32, 96)  # runs of 32 rows (padded with zeros) or not
    x = hard_input(sum(lengths), 96, torch.bfloat16)
    ends = torch.tensor(lengths, device="cuda").cumsum(0)
    quantizer = qtensor.MXFP8Quantizer(fp8_dtype)
    fast = quantizer.quantize_padded_groups(x, RowGroups(lengths, ends, align=32), True, True, values)
    with reference_kernels():
        reference = quantizer.quantize_padded_groups(x, RowGroups(lengths, ends, align=32), True, True)
    for asked, copy, expected in zip(values, fast, reference):
        want, _ = expected.operand()
        if asked:
            assert copy.storage is None  # no codes written
            got, scale = copy.operand()
            assert scale is None and got.shape == want.shape and got.dtype == torch.bfloat16
            assert torch.equal(torch.isnan(got), torch.isnan(want))
            assert torch.equal(got.nan_to_num(0.0).view(torch.int16), want.nan_to_num(0.0).view(torch.int16))
        else:
            for name in ("data", "scale_inv"):
                assert torch.equal(getattr(copy.storage, name).view(torch.uint8), getattr(expected.storage, name).view(torch.uint8)), name


def test_mxfp8_values_are_exact_in_bf16_above_its_normal_range():
    """The bf16 GEMM backend's premise: every dequantized MXFP8 value at or above 2**-126 is a bf16."""
    q = qtensor.MXFP8Quantizer().quantize(varied(256, 512, 9))
    values = q.dequantize(torch.float32)
    normal = values.abs() >= 2.0**-126
    assert torch.equal(values[normal].bfloat16().float(), values[normal])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_gemms_on_bf16_tensor_cores_agree_with_the_reference(out_dtype):
    e5m2 = lambda: qtensor.MXFP8Quantizer(torch.float8_e5m2)
    check_the_three_gemms(qtensor.MXFP8Quantizer, e5m2, "dequantized_bf16_mm", out_dtype, FP32_ACCUMULATION)
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction  # torch's default, restored


# ---- NVFP4 --------------------------------------------------------------------------------------
NV_QUANTIZERS = {
    "blocks": lambda: qtensor.NVFP4Quantizer(),
    "tiles": lambda: qtensor.NVFP4Quantizer(block_2d=True),
    "rht": lambda: qtensor.NVFP4Quantizer(rht=True),
    "stochastic": lambda: qtensor.NVFP4Quantizer(stochastic_rounding=True, seed=5),
    "rht_stochastic": lambda: qtensor.NVFP4Quantizer(rht=True, stochastic_rounding=True, seed=6),
    "tiles_stochastic": lambda: qtensor.NVFP4Quantizer(block_2d=True, stochastic_rounding=True, seed=7),
}


def same_bits(values):
    """The bit patterns of `values` with every NaN as one pattern (devices write different NaNs)."""
    bits = values.view(torch.int32 if values.dtype == torch.float32 else torch.int16)
    return torch.where(torch.isnan(values), 0, bits).cpu()


def nv_raw(q):
    out = {}
    for direction in ("rowwise", "columnwise"):
        storage = getattr(q, direction)
        if storage is not None:
            out[f"{direction}.data"] = storage.data.cpu()
            out[f"{direction}.scale_inv"] = storage.scale_inv.view(torch.uint8).cpu()
            out[f"{direction}.global_amax"] = storage.global_amax.cpu()
    return out


@pytest.mark.parametrize("directions", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("shape", [(96, 160), (64, 64), (37, 45), (130, 7), (1, 1), (0, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(NV_QUANTIZERS))
def test_nvfp4_cast_kernel_is_bitwise_the_reference(name, dtype, shape, directions):
    """NaN, ±Inf, subnormal and huge values (hard_input), partial blocks and tiles, the Hadamard
    transform's padding rows; stochastic rounding with the same seed draws the same numbers."""
    x = hard_input(max(shape[0], 8), max(shape[1], 64), dtype)[: shape[0], : shape[1]] if shape[0] else torch.zeros(shape, dtype=dtype, device="cuda")
    rowwise, columnwise = directions
    fast_quantizer, reference_quantizer = NV_QUANTIZERS[name](), NV_QUANTIZERS[name]()
    for _ in range(2):  # stochastic rounding: the second cast draws new keys
        fast = nv_raw(fast_quantizer.quantize(x, rowwise=rowwise, columnwise=columnwise))
        with reference_kernels():
            reference = nv_raw(reference_quantizer.quantize(x, rowwise=rowwise, columnwise=columnwise))
        assert fast.keys() == reference.keys()
        for key in fast:
            assert torch.equal(fast[key], reference[key]), key


@pytest.mark.parametrize("tile", [(1, 8), (2, 16), (8, 4)])
@pytest.mark.parametrize("name", ["blocks", "tiles", "rht_stochastic"])
def test_nvfp4_cast_is_the_same_bits_for_every_tile(name, tile):
    """The tile (warps, bytes each thread loads) moves blocks between threads, never their values."""
    from qtensor_kernels import nvfp4

    x = hard_input(80, 1000, torch.bfloat16)
    quantizer = NV_QUANTIZERS[name]()
    with mock.patch.dict(nvfp4._CAST_TILE, {"nearest": tile, "stochastic": tile}):
        fast = nv_raw(quantizer.quantize(x))
    with reference_kernels():
        reference = nv_raw(NV_QUANTIZERS[name]().quantize(x))
    for key in fast:
        assert torch.equal(fast[key], reference[key]), key


HYBRID_QUANTIZERS = {
    "mxfp8_nvfp4_rht": lambda: qtensor.HybridQuantizer(qtensor.MXFP8Quantizer(), qtensor.NVFP4Quantizer(rht=True)),
    "mxfp8_nvfp4": lambda: qtensor.HybridQuantizer(qtensor.MXFP8Quantizer(), qtensor.NVFP4Quantizer()),
    "e5m2_floor_nvfp4_tiles": lambda: qtensor.HybridQuantizer(qtensor.MXFP8Quantizer(torch.float8_e5m2, scale_rounding="floor"), qtensor.NVFP4Quantizer(block_2d=True)),
    "mxfp8_nvfp4_rht_stochastic": lambda: qtensor.HybridQuantizer(qtensor.MXFP8Quantizer(), qtensor.NVFP4Quantizer(rht=True, stochastic_rounding=True, seed=9)),
}


@pytest.mark.parametrize("shape", [(96, 160), (37, 45), (130, 7), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(HYBRID_QUANTIZERS))
def test_hybrid_cast_in_one_read_is_bitwise_the_two_children(name, dtype, shape):
    """MXFP8 rowwise + NVFP4 columnwise written by one kernel (hybrid.cast) equal the children's
    reference casts, stochastic rounding's draws included."""
    x = hard_input(max(shape[0], 8), max(shape[1], 64), dtype)[: shape[0], : shape[1]]
    fast_quantizer, reference_quantizer = HYBRID_QUANTIZERS[name](), HYBRID_QUANTIZERS[name]()
    from qtensor_kernels import hybrid

    fused = mock.Mock(wraps=hybrid.cast)
    kernels.registered()  # the table filled before one of its entries is replaced
    with mock.patch.dict(kernels.TABLE.eager, {"hybrid.cast": fused}):
        fast = fast_quantizer.quantize(x)
    assert fused.call_count == 1
    with reference_kernels():
        reference = reference_quantizer.quantize(x)
    assert torch.equal(fast.rowwise.data.view(torch.uint8).cpu(), reference.rowwise.data.view(torch.uint8).cpu())
    assert torch.equal(fast.rowwise.scale_inv.cpu(), reference.rowwise.scale_inv.cpu())
    for name in ("data", "scale_inv", "global_amax"):
        fast_values, reference_values = getattr(fast.columnwise, name), getattr(reference.columnwise, name)
        if fast_values.dtype == torch.float8_e4m3fn:
            fast_values, reference_values = fast_values.view(torch.uint8), reference_values.view(torch.uint8)
        assert torch.equal(fast_values.cpu(), reference_values.cpu()), name


@pytest.mark.parametrize("magnitude", [0.0, 1e-44, 1e-39, 2.0**-120, 3.0, 3.3e38])
@pytest.mark.parametrize("name", ["blocks", "tiles", "rht_stochastic"])
def test_nvfp4_scale_edges_are_bitwise_the_reference(name, magnitude):
    """Block scales that saturate at 448, round to E4M3 subnormals or to zero, and S_enc at FLT_MAX."""
    x = torch.full((64, 96), magnitude, device="cuda")
    x[::3] *= -0.625
    x[:, 40:] *= 2.0**-7
    x[5, :] *= 2.0**-30
    fast = nv_raw(NV_QUANTIZERS[name]().quantize(x))
    with reference_kernels():
        reference = nv_raw(NV_QUANTIZERS[name]().quantize(x))
    for key in fast:
        assert torch.equal(fast[key], reference[key]), key


def test_nvfp4_stochastic_rounding_reproduces_from_torch_manual_seed():
    """Without a quantizer seed, the keys come from torch's CUDA generator: one seed, one result."""
    x = varied(96, 160, 3)
    casts = []
    for _ in range(2):
        torch.manual_seed(11)
        casts.append(nv_raw(qtensor.NVFP4Quantizer(rht=True, stochastic_rounding=True).quantize(x)))
    torch.manual_seed(12)
    other = nv_raw(qtensor.NVFP4Quantizer(rht=True, stochastic_rounding=True).quantize(x))
    assert all(torch.equal(casts[0][key], casts[1][key]) for key in casts[0])
    assert not torch.equal(casts[0]["rowwise.data"], other["rowwise.data"])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
@pytest.mark.parametrize("name", ["blocks", "tiles", "rht"])
def test_nvfp4_dequantize_kernel_equals_the_reference(name, direction, out_dtype):
    """Bit for bit (the sign of zero included), NaN where the reference has NaN."""
    q = NV_QUANTIZERS[name]().quantize(hard_input(96, 150, torch.float32))
    fast = q.dequantize(out_dtype, direction)
    with reference_kernels():
        reference = q.dequantize(out_dtype, direction)
    assert torch.equal(torch.isnan(fast), torch.isnan(reference))
    assert torch.equal(same_bits(fast), same_bits(reference))
    storage = getattr(q, direction)
    fast_values, fast_scale = storage.bf16_operand()
    with reference_kernels():
        reference_values, reference_scale = storage.bf16_operand()
    fast_scale, reference_scale = fast_scale.value(), reference_scale.value()
    assert torch.equal(torch.isnan(fast_values), torch.isnan(reference_values))
    assert torch.equal(same_bits(fast_values), same_bits(reference_values))
    assert torch.equal(fast_scale, reference_scale)


@pytest.mark.parametrize("name", ["blocks", "tiles", "rht"])
def test_nvfp4_dequantize_traced_by_inductor_is_bitwise_the_reference(name):
    """Under torch.compile NVFP4's dequantize is its reference's torch ops, fused by inductor into a
    kernel of its own (whose fp32 division is not correctly rounded): both directions' fp32 values
    and bf16 operands must still be the eager kernel's bit for bit, NaN blocks included."""
    q = NV_QUANTIZERS[name]().quantize(hard_input(96, 150, torch.float32))
    storages = [q.rowwise, q.columnwise]

    def values():  # (the storages' buffers are the compiled graph's inputs)
        return [v for storage in storages for v in (storage.dequantize(), storage.bf16_operand()[0])]

    torch._dynamo.reset()
    got = torch.compile(values, fullgraph=True)()
    expected = values()  # eager: qtensor's Triton kernel
    for fast, reference in zip(got, expected, strict=True):
        assert fast.dtype == reference.dtype and fast.shape == reference.shape
        assert torch.equal(torch.isnan(fast), torch.isnan(reference))
        assert torch.equal(same_bits(fast), same_bits(reference))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["blocks", "tiles", "rht"])
def test_nvfp4_gemms_on_bf16_tensor_cores_agree_with_the_reference(name, out_dtype):
    """wgrad of two transformed copies runs in the transformed domain (the transform cancels)."""
    gradient = lambda: qtensor.NVFP4Quantizer(rht=name == "rht", stochastic_rounding=True)
    weight = qtensor.NVFP4Quantizer if name == "rht" else None  # dgrad's W copy must not carry it
    check_the_three_gemms(NV_QUANTIZERS[name], gradient, "dequantized_bf16_mm", out_dtype, FP32_ACCUMULATION, weight)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_hybrid_gemms_on_bf16_tensor_cores_agree_with_the_reference(out_dtype):
    """mxfp8_fwd_nvfp4_bwd's operands: MXFP8 × MXFP8 forward, NVFP4 × NVFP4 backward; and Float8 × NVFP4."""
    hybrid_input = lambda: qtensor.HybridQuantizer(qtensor.MXFP8Quantizer(), qtensor.NVFP4Quantizer(rht=True))
    hybrid_weight = lambda: qtensor.HybridQuantizer(qtensor.MXFP8Quantizer(), qtensor.NVFP4Quantizer())
    gradient = lambda: qtensor.NVFP4Quantizer(rht=True, stochastic_rounding=True)
    check_the_three_gemms(hybrid_input, gradient, "dequantized_bf16_mm", out_dtype, FP32_ACCUMULATION, hybrid_weight)
    float8_nvfp4 = lambda: qtensor.HybridQuantizer(qtensor.Float8Quantizer(), qtensor.NVFP4Quantizer())
    check_the_three_gemms(qtensor.MXFP8Quantizer, float8_nvfp4, "dequantized_bf16_mm", out_dtype, FP32_ACCUMULATION)


@pytest.mark.parametrize("scales", ["inverse", "nvfp4", "nvfp4_and_inverse", "nvfp4_pair", "nvfp4_zero_amax"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scaled_gemm_epilogue_kernel_is_bitwise_the_reference(out_dtype, with_bias, scales):
    """The tensor scales computed in the kernel (NVFP4's 1/S_enc from the amax) as TensorScale.value."""
    from qtensor.core.storage import TensorScale

    product = varied(130, 96, 5) * 1e3
    inverse = TensorScale(torch.tensor(3.7e-5, device="cuda"))
    nvfp4 = lambda amax: TensorScale(torch.tensor(amax, device="cuda"), amax_max=448.0 * 6)
    a_scale, b_scale = {
        "inverse": (inverse, None),
        "nvfp4": (None, nvfp4(17.3)),
        "nvfp4_and_inverse": (nvfp4(1e-3), inverse),
        "nvfp4_pair": (nvfp4(3.1e5), nvfp4(2.5e-38)),
        "nvfp4_zero_amax": (nvfp4(0.0), nvfp4(7.0)),
    }[scales]
    bias = varied(1, 96, 6)[0].to(torch.bfloat16) if with_bias else None
    fast = lookup("gemm.scale_output", product)(product, a_scale, b_scale, bias, out_dtype)
    scale = b_scale.value() if a_scale is None else (a_scale.value() if b_scale is None else a_scale.value() * b_scale.value())
    reference = backends._scale_and_finish(product, scale, bias, out_dtype)
    assert torch.equal(fast, reference)
    # Under torch.compile the epilogue without a bias is its reference's ops, fused by inductor; one
    # with a bias stays the kernel (inductor would fuse the scaling and the add into one rounding).
    torch._dynamo.reset()
    compiled = torch.compile(lambda p: backends.scaled_epilogue(p, a_scale, b_scale, bias, out_dtype), fullgraph=True)
    assert torch.equal(compiled(product), reference)


@pytest.mark.parametrize("rht", [False, True])
def test_nvfp4_amaxes_kernel_is_the_reference(rht):
    x = hard_input(100, 72, torch.bfloat16)
    from qtensor.formats.nvfp4 import apply_rht
    from qtensor.core.numerics import finite_amax, pad_to_multiple

    plain, transformed = lookup("nvfp4.amaxes", x)(x)
    with reference_kernels():
        assert torch.equal(plain, finite_amax(x.float()))
        assert torch.equal(transformed, finite_amax(apply_rht(pad_to_multiple(x.float().t(), 16, dim=1))))


def test_launch_key_is_never_coarser_than_tritons_specialization():
    """The direct launch (qtensor_kernels/launch.py) reuses a compiled kernel for every call of one
    launch key: two arguments of one key must get one Triton specialization, for every kind of
    argument the kernels take (ints around 1, 16 and the int32 range, aligned and misaligned
    pointers of several dtypes, floats, bools)."""
    from qtensor_kernels import float8 as float8_kernels
    from qtensor_kernels.launch import launch_key, triton_specialization

    base = torch.zeros(256, dtype=torch.uint8, device="cuda")
    tensors = [base, base[16:], base[1:], base[8:], base.view(torch.float32), base[4:].view(torch.float32), base.view(torch.bfloat16)]
    ints = [0, 1, 2, 15, 16, 17, 32, 48, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**32, 2**63, -1, -16, -(2**31), -(2**31) - 16]
    kernel = float8_kernels._dequantize_kernel  # (data_ptr, scale_inv_ptr, out_ptr, n, E5M2, BLOCK)
    seen = {}
    for data in tensors:
        for n in ints:
            args = (data, tensors[0], tensors[4], n)
            key, specialization = launch_key(*args), triton_specialization(kernel, *args, E5M2=False, BLOCK=4096)
            assert seen.setdefault(key, specialization) == specialization, (key, specialization, seen[key])
    assert len(seen) > 10  # the rule tells many cases apart
    # Floats and bools: Triton specializes on the type alone.
    scalar_kernel = float8_kernels._delayed_scale_kernel  # (history_ptr, scale_ptr, epsilon, ...)
    constexprs = dict(LENGTH=4, BLOCK=4, MOST_RECENT=False, FP8_MAX=448.0, MARGIN_FACTOR=1.0, POW2=False)
    for epsilon in (0.0, 1.0, 1e-3, -2.5):
        key = launch_key(base.view(torch.float32), base.view(torch.float32), epsilon)
        specialization = triton_specialization(scalar_kernel, base.view(torch.float32), base.view(torch.float32), epsilon, **constexprs)
        assert seen.setdefault(key, specialization) == specialization


def test_direct_launches_equal_launches_through_triton():
    """Casts of misaligned and aligned inputs of one shape (two Triton specializations), launched
    directly from the kept compiled kernels, give the bytes of the same casts launched through
    kernel[grid] (as with a launch hook set); a warm launch never goes through kernel[grid]."""
    from qtensor_kernels import float8 as float8_kernels
    from qtensor_kernels import launch as launch_module

    quantizer = qtensor.Float8Quantizer()
    flat = varied(65, 256, seed=3).to(torch.bfloat16).reshape(-1)
    # 16-byte aligned, 2 bytes past, 16 bytes past, 6 bytes past.
    inputs = [flat[offset : offset + 64 * 256].reshape(64, 256) for offset in (0, 1, 8, 3)]
    for x in inputs:
        quantizer.quantize(x)  # the first launch of each key compiles and keeps the kernel
    not_direct = AssertionError("a warm launch went through kernel[grid]")
    with mock.patch.object(float8_kernels._cast_kernel, "run", side_effect=not_direct), \
            mock.patch.object(float8_kernels._amax_partials_kernel, "run", side_effect=not_direct):
        direct = [raw(quantizer.quantize(x)) for x in inputs * 2]
    with mock.patch.object(launch_module, "_hooked", lambda: True):
        through_triton = [raw(quantizer.quantize(x)) for x in inputs * 2]
    for a, b in zip(direct, through_triton):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- FP8 with block scales (row-wise, 1x128, 128x128) on the FP8 tensor cores ------------------------
BLOCK_PAIRS = {
    # recipe: (activation and gradient quantizer, weight quantizer)
    "float8_rowwise": (lambda: qtensor.Float8BlockQuantizer(block_rows=1, block_cols=None, pow2_scales=True),) * 2,
    "float8_blockwise": (lambda: qtensor.Float8BlockQuantizer(block_rows=1, block_cols=128),
                         lambda: qtensor.Float8BlockQuantizer(block_rows=128, block_cols=128)),
}


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("recipe", list(BLOCK_PAIRS))
def test_block_scaled_fp8_gemms_run_on_the_fp8_tensor_cores_within_the_bound(recipe, out_dtype):
    """fprop (X·Wᵀ), dgrad (dY·W) and wgrad (dYᵀ·X) of block-scaled operands on `_scaled_mm`'s
    row-wise or block scaling, each within the split accumulator's bound of the fp64 product of the
    operands' exact values (docs/numerics.md, FP8 GEMMs)."""
    activation, weight = BLOCK_PAIRS[recipe]
    x, w, dy = (q().quantize(t) for q, t in ((activation, varied(256, 512, 1)), (weight, varied(384, 512, 2)), (activation, varied(256, 384, 3))))
    values = {name: t.dequantize(torch.float32, d) for name, t, d in [
        ("x", x, "rowwise"), ("x_col", x, "columnwise"), ("w", w, "rowwise"), ("w_col", w, "columnwise"),
        ("dy", dy, "rowwise"), ("dy_col", dy, "columnwise")]}
    gemm.backend_counts(reset=True)
    y, dx, dw = gemm.fprop(x, w, None, out_dtype), gemm.dgrad(dy, w, out_dtype), gemm.wgrad(dy, x, out_dtype)
    assert gemm.backend_counts() == {"float8_block_scaled_mm": 3}
    assert_close_to_reference(y, values["x"], values["w"].t(), out_dtype)
    assert_close_to_reference(dx, values["dy"], values["w_col"], out_dtype)
    assert_close_to_reference(dw, values["dy_col"].t(), values["x_col"], out_dtype)


@pytest.mark.parametrize("recipe", ["float8_rowwise", "float8_rowwise_gw_hp", "float8_blockwise"])
def test_the_block_scaled_recipes_train_a_layer_on_the_gpu_like_the_cpu_reference(recipe):
    """A training step of a bf16 layer under autocast: every GEMM on the FP8 tensor cores (the
    weight gradient of gw_hp on the bf16 ones), the gradients within the FP8 GEMMs' bound of the same
    step on the CPU reference."""
    torch.manual_seed(0)
    layers = {}
    for device in ("cpu", "cuda"):
        layer = nn.Linear(512, 256, device=device)
        qtensor.quantize_(layer, getattr(qtensor.recipes, recipe)(), strict=True)
        layers[device] = layer
    layers["cuda"].load_state_dict(layers["cpu"].state_dict())
    x = varied(256, 512, 4)
    grads = {}
    gemm.backend_counts(reset=True)
    for device, layer in layers.items():
        xd = x.to(device).requires_grad_()
        layer(xd).square().sum().backward()
        grads[device] = (xd.grad, layer.weight.grad)
    counts = gemm.backend_counts()
    assert counts.get("float8_block_scaled_mm") == (2 if recipe.endswith("gw_hp") else 3), counts
    for got, expected in zip(grads["cuda"], grads["cpu"]):
        error = ((got.cpu() - expected).norm() / expected.norm()).item()
        assert error < 2.0**-7, error


@pytest.mark.parametrize("shape", [(256, 384), (300, 130), (128, 128), (17, 700)])
@pytest.mark.parametrize("options", [
    dict(block_rows=1, block_cols=None, pow2_scales=True), dict(block_rows=1, block_cols=None, amax_epsilon=1e-3),
    dict(block_rows=1, block_cols=128), dict(block_rows=1, block_cols=128, fp8_dtype=torch.float8_e5m2, pow2_scales=True),
    dict(block_rows=128, block_cols=128), dict(block_rows=128, block_cols=128, fp8_dtype=torch.float8_e5m2),
], ids=["rowwise_pow2", "rowwise_eps", "1x128", "1x128_e5m2_pow2", "128x128", "128x128_e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_float8_block_cast_kernel_writes_the_references_bytes(dtype, options, shape):
    """Both copies from one read, bit for bit the pure-torch reference: codes where the input is
    finite (NaN's code too), scales, on data with NaN, ±Inf, zero blocks and partial blocks."""
    x = varied(*shape, 7)
    x[0, :64] = 0.0
    x[shape[0] // 2, 3], x[-1, -1], x[1, shape[1] // 2] = float("nan"), float("inf"), -float("inf")
    x = x.to(dtype)
    quantizer = qtensor.Float8BlockQuantizer(**options)
    fast = quantizer.quantize(x)
    with kernels.reference_kernels():
        reference = quantizer.quantize(x)
    for direction in ("rowwise", "columnwise"):
        got, expected = fast.storage_for(direction), reference.storage_for(direction)
        assert torch.equal(got.data.view(torch.uint8), expected.data.view(torch.uint8)), direction
        assert torch.equal(got.scale_inv, expected.scale_inv), direction
    for rowwise, columnwise in ((True, False), (False, True)):  # one copy alone: a kernel compiled apart
        direction = "rowwise" if rowwise else "columnwise"
        got, expected = quantizer.quantize(x, rowwise=rowwise, columnwise=columnwise).storage_for(direction), reference.storage_for(direction)
        assert torch.equal(got.data.view(torch.uint8), expected.data.view(torch.uint8)), direction
        assert torch.equal(got.scale_inv, expected.scale_inv), direction


@pytest.mark.parametrize("shape", [(256, 384), (300, 130), (4096, 1024)])
@pytest.mark.parametrize("block", [(1, None), (1, 128), (128, 128)], ids=["rowwise", "1x128", "128x128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_float8_block_cast_kernel_rounds_full_precision_inputs_as_the_reference(dtype, block, shape):
    """Inputs with every mantissa bit in use (an fp32 weight, a gradient) and magnitudes over 2^±8:
    each copy alone and both together equal the reference bit for bit."""
    torch.manual_seed(3)
    x = (torch.randn(shape) * torch.exp2(torch.randint(-8, 8, shape).float())).to(dtype)
    quantizer = qtensor.Float8BlockQuantizer(block_rows=block[0], block_cols=block[1])
    reference = quantizer.quantize(x)  # on the CPU: the pure-torch reference
    for rowwise, columnwise in ((True, True), (True, False), (False, True)):
        fast = quantizer.quantize(x.cuda(), rowwise=rowwise, columnwise=columnwise)
        for direction, wanted in (("rowwise", rowwise), ("columnwise", columnwise)):
            if wanted:
                got, expected = fast.storage_for(direction), reference.storage_for(direction)
                assert torch.equal(got.data.cpu().view(torch.uint8), expected.data.view(torch.uint8)), (direction, rowwise, columnwise)
                assert torch.equal(got.scale_inv.cpu(), expected.scale_inv), (direction, rowwise, columnwise)


@pytest.mark.parametrize("shape", [(0, 256), (256, 0), (0, 0)])
@pytest.mark.parametrize("block", [(1, None), (1, 128), (128, 128)], ids=["rowwise", "1x128", "128x128"])
def test_the_float8_block_cast_kernel_takes_empty_tensors_as_the_reference_does(block, shape):
    """No kernel runs on zero elements, and an empty copy's scales (one per row of the layout, 1 for
    an empty row) equal the reference's."""
    quantizer = qtensor.Float8BlockQuantizer(block_rows=block[0], block_cols=block[1])
    x = torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
    fast = quantizer.quantize(x)
    with kernels.reference_kernels():
        reference = quantizer.quantize(x)
    for direction in ("rowwise", "columnwise"):
        got, expected = fast.storage_for(direction), reference.storage_for(direction)
        assert got.data.shape == expected.data.shape and got.scale_inv.shape == expected.scale_inv.shape, direction
        assert torch.equal(got.scale_inv, expected.scale_inv), direction


GROUPED_QUANTIZERS = {
    "e4m3": lambda: qtensor.Float8Quantizer(),
    "e5m2_pow2_eps": lambda: qtensor.Float8Quantizer(torch.float8_e5m2, force_pow_2_scales=True, amax_epsilon=1e-3),
    "rowwise_pow2": lambda: qtensor.Float8BlockQuantizer(block_rows=1, block_cols=None, pow2_scales=True),
    "rowwise_e5m2": lambda: qtensor.Float8BlockQuantizer(torch.float8_e5m2, block_rows=1, block_cols=None),
}


def assert_same_grouped(actual, expected, what):
    for a, b in zip(actual, expected):
        assert (a is None) == (b is None), what
        if a is not None:
            assert torch.equal(a.data.view(torch.uint8).cpu(), b.data.view(torch.uint8).cpu()), f"{what}: codes"
            assert torch.equal(a.scale_inv.cpu(), b.scale_inv.cpu()), f"{what}: factors"
            assert (a.groups is None) == (b.groups is None) and (a.groups is None or a.lengths == b.lengths), f"{what}: groups"


@pytest.mark.parametrize("name", list(GROUPED_QUANTIZERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_float8_cast_kernels_are_bitwise_the_reference(name, dtype):
    """Every group of routed rows (empty groups, groups of any length, NaN and ±Inf among the values)
    and every expert of a stack (experts of 48 rows, whose columnwise codes the kernel writes, and of
    40, transposed after): codes, factors and lengths bit for bit as the pure-torch reference."""
    quantizer = GROUPED_QUANTIZERS[name]()
    lengths = (0, 37, 64, 5, 0, 130)
    groups = RowGroups(lengths, torch.tensor(lengths).cumsum(0).cuda())
    x = hard_input(sum(lengths), 96, dtype, seed=4)
    with reference_kernels():
        expected = quantizer.quantize_groups(x, groups, True, True)
    assert_same_grouped(quantizer.quantize_groups(x, groups, True, True), expected, "routed rows")
    for rows in (48, 40):
        stack = torch.stack([hard_input(rows, 80, dtype, seed=5 + e) for e in range(3)])
        with reference_kernels():
            expected = quantizer.quantize_stack(stack, True, True)
        assert_same_grouped(quantizer.quantize_stack(stack, True, True), expected, f"stack of {rows}-row experts")


@pytest.mark.parametrize("name", list(GROUPED_QUANTIZERS))
def test_grouped_float8_scales_kernel_is_bitwise_the_reference(name):
    """The scales of amaxes at every edge (0, subnormal, around amax_epsilon, normal, at and near
    FLT_MAX, where fp8_max / amax overflows or underflows) and their inverses, bit for bit as
    `numerics.current_scale` and `exact_quotient(1.0, ·)` compute them, per group and per column."""
    quantizer = GROUPED_QUANTIZERS[name]()
    edges = torch.tensor([0.0, 1e-45, 1e-39, 1e-30, 1e-3, 0.99e-3, 1.5, 448.0, 3.0e4, 1e38, 3.4028234663852886e38, 2.0**-126])
    amax = torch.cat([edges, torch.rand(84) * torch.exp2(torch.randint(-100, 100, (84,)).float())]).reshape(8, 12).cuda()
    with reference_kernels():
        expected = quantizer.group_scales_and_inverses(amax)
    actual = quantizer.group_scales_and_inverses(amax)
    for a, b in zip(actual, expected):
        assert torch.equal(a.view(torch.int32).cpu(), b.view(torch.int32).cpu())
