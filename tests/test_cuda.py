"""The same numerics on a CUDA GPU: every format quantizes bit for bit as on the CPU (which the oracle
tests pin to docs/numerics.md), and a quantized nn.Linear on the GPU matches the oracle reference.

Skipped without a GPU; run on the device machine (see benchmarks/README.md).
"""

import io

import numpy as np
import pytest
import torch
from torch import nn

import qtensor
from qtensor import Float8Quantizer, HybridQuantizer, IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QUANTIZERS = {
    "float8_e4m3": lambda: Float8Quantizer(),
    "float8_e5m2_pow2": lambda: Float8Quantizer(torch.float8_e5m2, force_pow_2_scales=True),
    "mxfp8_rceil": lambda: MXFP8Quantizer(),
    "mxfp8_floor_e5m2": lambda: MXFP8Quantizer(torch.float8_e5m2, scale_rounding="floor"),
    "nvfp4": lambda: NVFP4Quantizer(),
    "nvfp4_rht": lambda: NVFP4Quantizer(rht=True),
    "nvfp4_2d": lambda: NVFP4Quantizer(block_2d=True),
    "identity_bf16": lambda: IdentityQuantizer(torch.bfloat16),
    "hybrid": lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(rht=True), columnwise_source="rowwise_dequantized"),
}


def hard_input(rows, cols, dtype, seed=0):
    """Block-varying magnitudes, exact ties, zeros, subnormal-range and huge values, NaN and ±Inf."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-30, 30, (rows // 8 + 1, cols // 8 + 1), generator=generator).float())
    x = torch.randn(rows, cols, generator=generator) * scale.repeat_interleave(8, 0)[:rows].repeat_interleave(8, 1)[:, :cols]
    x[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 1.0625] * 2) * 2.0 ** torch.arange(16).float()
    x[1, :40] = 0.0
    x[2, 3] = float("nan")
    x[3, 50] = float("inf")
    x[4, 7] = float("-inf")
    x[5, :] *= 1e-30
    x[6, 0] = 3.0e38 if dtype != torch.float16 else 6.0e4
    return x.to(dtype)


def buffers_of(q):
    """Every buffer as comparable CPU values: raw bytes for codes; for a high-precision buffer
    (identity) the values with NaN replaced, since devices write different NaN payloads."""
    buffers = {}
    for direction in ("rowwise", "columnwise"):
        if getattr(q, direction) is not None:
            for name, buffer in getattr(q, direction).buffers.items():
                buffer = buffer.reshape(-1).cpu()
                if buffer.dtype in (torch.float32, torch.bfloat16, torch.float16) and buffer.numel() > 1:
                    buffer = torch.cat([torch.isnan(buffer).view(torch.uint8), buffer.nan_to_num(0.5).view(torch.uint8)])
                buffers[f"{direction}.{name}"] = buffer.view(torch.uint8)
    return buffers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_quantize_on_cuda_is_bitwise_the_cpu_result(name, dtype):
    x = hard_input(96, 80, dtype)
    on_cpu = QUANTIZERS[name]().quantize(x)
    on_gpu = QUANTIZERS[name]().quantize(x.cuda())
    assert on_gpu.device.type == "cuda"
    cpu_buffers, gpu_buffers = buffers_of(on_cpu), buffers_of(on_gpu)
    assert cpu_buffers.keys() == gpu_buffers.keys()
    for key in cpu_buffers:
        assert torch.equal(cpu_buffers[key], gpu_buffers[key]), key
    for direction in ("rowwise", "columnwise"):
        expected = on_cpu.dequantize(torch.float32, direction).view(torch.int32)
        actual = on_gpu.dequantize(torch.float32, direction).cpu().view(torch.int32)
        nan = torch.isnan(on_cpu.dequantize(torch.float32, direction))
        assert torch.equal(torch.where(nan, 0, actual), torch.where(nan, 0, expected)), direction


def test_delayed_scaling_history_on_cuda_matches_cpu():
    cpu, gpu = Float8Quantizer(scaling="delayed", amax_history_len=2), Float8Quantizer(scaling="delayed", amax_history_len=2)
    for seed, magnitude in enumerate((1.0, 40.0, 0.01, 3.0)):
        x = hard_input(64, 64, torch.float32, seed) * magnitude
        a, b = cpu.quantize(x), gpu.quantize(x.cuda())
        assert torch.equal(a.rowwise.data.view(torch.uint8), b.rowwise.data.view(torch.uint8).cpu())
    assert torch.equal(cpu.amax_history, gpu.amax_history.cpu())


def test_dispatch_ops_and_pickling_on_cuda():
    q = qtensor.HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer()).quantize(hard_input(64, 64, torch.bfloat16).cuda())
    moved = q.to("cpu")
    assert type(moved) is type(q) and moved.device.type == "cpu"
    assert torch.equal(moved.dequantize().float().nan_to_num(), q.dequantize().cpu().float().nan_to_num())
    top, bottom = q.split(32)
    assert bottom.device.type == "cuda" and torch.equal(
        bottom.dequantize().nan_to_num(), q.dequantize()[32:].nan_to_num()
    )
    buffer = io.BytesIO()
    torch.save(q, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded.device.type == "cuda" and buffers_of(loaded).keys() == buffers_of(q).keys()


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("case", ["float8", "mxfp8", "nvfp4", "hybrid"])
def test_linear_on_cuda_matches_the_oracle_reference(case, weights):
    from test_linear import CASES, K, M_SHAPE, N, assert_gemm_matches, factory_for, varied

    deq = CASES[case][1]
    torch.manual_seed(0)
    layer = nn.Linear(K, N)
    with torch.no_grad():
        layer.weight.copy_(varied(N, K, seed=1))
    w2d = layer.weight.detach().numpy().copy()
    layer.cuda()
    qtensor.quantize_(layer, factory_for(case), weights=weights)
    x = varied(*M_SHAPE, K, seed=2).cuda().requires_grad_(True)
    grad = varied(*M_SHAPE, N, seed=7)
    y = layer(x)
    y.backward(grad.cuda())
    x2d, g2d = x.detach().reshape(-1, K).cpu().numpy(), grad.reshape(-1, N).numpy()
    assert_gemm_matches((y - layer.bias).reshape(-1, N).cpu(), deq["input"](x2d, "rowwise"), deq["weight"](w2d, "rowwise").T)
    assert_gemm_matches(x.grad.reshape(-1, K).cpu(), deq["grad_output"](g2d, "rowwise"), deq["weight"](w2d, "columnwise"))
    assert_gemm_matches(layer.weight.grad.cpu(), deq["grad_output"](g2d, "columnwise").T, deq["input"](x2d, "columnwise"))
    np.testing.assert_allclose(layer.bias.grad.cpu().numpy(), g2d.sum(0), rtol=1e-5, atol=1e-5)


def test_stock_transformer_trains_on_cuda_under_the_hybrid_recipe():
    from qtensor.demo import VOCABULARY, TinyLM, sums_stream, train_step

    torch.manual_seed(0)
    model = TinyLM(len(VOCABULARY), 64, 2, 4, 32).cuda()
    report = qtensor.quantize_(model, qtensor.recipes.mxfp8_fwd_nvfp4_bwd())
    assert len(report.quantized) == 9  # per layer: in_proj, out_proj, linear1, linear2; and the head
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        loss = train_step(model, optimizer, sums_stream(8, 32, generator).cuda())
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:3]) / 3


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_moving_a_quantized_model_to_the_gpu_moves_every_buffer(weights):
    layer = nn.Linear(64, 32)
    qtensor.quantize_(layer, qtensor.recipes.mxfp8_fwd_nvfp4_bwd(), weights=weights)
    x = torch.randn(8, 64)
    expected = layer(x)
    layer.cuda()
    weight = layer.weight
    assert weight.device.type == "cuda"
    if isinstance(weight, qtensor.QuantizedTensor):
        for storage in (weight.rowwise, weight.columnwise):
            assert all(b.device.type == "cuda" for b in storage.buffers.values())
    y = layer(x.cuda())
    y.sum().backward()
    torch.testing.assert_close(y.cpu(), expected, rtol=1e-5, atol=1e-5)
    assert layer.weight.grad.device.type == "cuda"


def test_the_reference_gemm_stays_full_fp32_when_tf32_is_allowed():
    from test_linear import CASES, K, N, assert_gemm_matches, factory_for, varied

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 for ordinary fp32 matmuls
    try:
        layer = nn.Linear(K, N, bias=False)
        with torch.no_grad():
            layer.weight.copy_(varied(N, K, seed=1))
        w2d = layer.weight.detach().numpy().copy()
        layer.cuda()
        qtensor.quantize_(layer, factory_for("mxfp8"))
        x = varied(256, K, seed=2)
        y = layer(x.cuda())
        deq = CASES["mxfp8"][1]
        assert_gemm_matches(y.cpu(), deq["input"](x.numpy(), "rowwise"), deq["weight"](w2d, "rowwise").T)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(previous)


def _same_buffers(a, b):
    mine, metadata = a.to_buffers()
    theirs, other_metadata = b.to_buffers()
    assert metadata == other_metadata and mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name].cpu().reshape(-1).view(torch.uint8), theirs[name].cpu().reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_checkpoint_of_gpu_tensors_round_trips_to_either_device(tmp_path, name):
    q = QUANTIZERS[name]().quantize(hard_input(96, 80, torch.bfloat16).cuda())
    qtensor.save_file({"w": q}, tmp_path / "gpu.safetensors")
    on_gpu = qtensor.load_file(tmp_path / "gpu.safetensors", device="cuda")["w"]
    on_cpu = qtensor.load_file(tmp_path / "gpu.safetensors")["w"]
    assert on_gpu.device.type == "cuda" and on_cpu.device.type == "cpu"
    _same_buffers(on_gpu, q)
    _same_buffers(on_cpu, q)


@pytest.mark.parametrize("recipe, weights", [("mxfp8_fwd_nvfp4_bwd", "quantized"), ("float8_delayed", "dynamic")])
def test_a_gpu_model_saves_and_reloads_with_identical_logits(tmp_path, recipe, weights):
    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).cuda()
        qtensor.quantize_(model, getattr(qtensor.recipes, recipe)(), weights=weights)
        return model

    model = build(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if weights == "quantized":
        optimizer = qtensor.optim.MasterWeights(optimizer)
    x = torch.randn(32, 64, device="cuda")
    for _ in range(3):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    qtensor.save_model(model, tmp_path / "model.safetensors")
    fresh = build(1)
    qtensor.load_model(fresh, tmp_path / "model.safetensors")
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))
    for key, value in model.state_dict().items():
        loaded = fresh.state_dict()[key]
        if isinstance(value, qtensor.QuantizedTensor):
            _same_buffers(loaded, value)
        else:
            assert torch.equal(loaded, value), key


@pytest.mark.parametrize("name", ["float8_e4m3", "mxfp8_rceil", "nvfp4_rht", "identity_bf16", "hybrid"])
def test_dequantize_compiles_with_inductor_on_the_gpu_without_recompiling(name):
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda q: q.dequantize(torch.float32) * 2, fullgraph=True, backend=counter)
    quantizer = QUANTIZERS[name]()
    for seed in range(2):
        q = quantizer.quantize(hard_input(128, 96, torch.bfloat16, seed=seed).cuda())
        assert torch.equal(compiled(q).nan_to_num(), (q.dequantize(torch.float32) * 2).nan_to_num())
    assert counter.frame_count == 1


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_attention_and_conv1d_under_bf16_autocast_equal_their_nn_linear_twins(weights):
    """The identity projections inside nn.MultiheadAttention meet autocast's casts on the GPU."""
    import copy

    from test_layer_types import E, AttentionFromLinears, linear_twin, varied

    Conv1D = pytest.importorskip("transformers").pytorch_utils.Conv1D
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, 4, batch_first=True)
    reference = AttentionFromLinears(mha).cuda()
    mha = mha.cuda()
    conv = Conv1D(96, E)
    conv_twin = linear_twin(conv).cuda()
    conv = conv.cuda()
    for model in (mha, reference, conv, conv_twin):
        qtensor.quantize_(model, qtensor.recipes.mxfp8(), weights=weights)
    x = varied(2, 32, E, seed=1).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, expected = mha(x, x, x)[0], reference(x, x, x)
        assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
        assert torch.equal(conv(x), conv_twin(x))
    got.float().sum().backward()
    expected.float().sum().backward()
    assert torch.equal(mha.in_proj_weight.grad, reference.packed.weight.grad)


def test_grad_scaler_on_cuda_unscales_the_master_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).cuda()
    qtensor.quantize_(model, qtensor.recipes.mxfp8(), weights="quantized")
    optimizer = qtensor.optim.MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**14)
    x = torch.randn(32, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
    scaler.scale(loss).backward()
    grads = [(m, p.grad.detach().double() / 2.0**14, m.detach().double()) for p, m in optimizer.pairs]
    scaler.step(optimizer)
    scaler.update()
    for master, grad, before in grads:
        torch.testing.assert_close(master.detach().double(), before - 0.1 * grad, rtol=1e-6, atol=1e-7)
