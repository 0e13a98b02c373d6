"""A quantized nn.Linear runs fprop, dgrad and wgrad on the operands docs/design.md, The three GEMMs, names.

The reference dequantizes each operand with the independent numpy oracle (tests/oracle.py) and
multiplies in float64; the library's emulated GEMM multiplies in fp32, so results must agree to
fp32 accumulation-order tolerance: |actual - expected| <= 1e-5 * (|A| @ |B|) element by element.
"""

from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

import oracle
import qtensor
from qtensor import Float8Quantizer, HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer

M_SHAPE, K, N = (2, 24), 80, 40  # 48 rows: partial MXFP8 blocks along M and K


def float8_deq(fp8):
    return lambda x, direction: oracle.float8_current(x, fp8).deq


def mxfp8_deq(x, direction):
    return oracle.mxfp8(x, direction).deq


def nvfp4_deq(block_2d=False, rht=False):
    return lambda x, direction: oracle.nvfp4(x, direction, block_2d=block_2d, rht=rht).deq


def hybrid_deq(columnwise):
    return lambda x, direction: mxfp8_deq(x, direction) if direction == "rowwise" else columnwise(x, direction)


# case -> (fresh quantizer per tensor type, oracle dequantization per tensor type)
CASES = {
    "float8": (
        {"input": lambda: Float8Quantizer(), "weight": lambda: Float8Quantizer(), "grad_output": lambda: Float8Quantizer(torch.float8_e5m2)},
        {"input": float8_deq("e4m3"), "weight": float8_deq("e4m3"), "grad_output": float8_deq("e5m2")},
    ),
    "mxfp8": (
        {"input": MXFP8Quantizer, "weight": MXFP8Quantizer, "grad_output": MXFP8Quantizer},
        {"input": mxfp8_deq, "weight": mxfp8_deq, "grad_output": mxfp8_deq},
    ),
    "nvfp4": (
        {"input": lambda: NVFP4Quantizer(rht=True), "weight": lambda: NVFP4Quantizer(block_2d=True), "grad_output": lambda: NVFP4Quantizer(rht=True)},
        {"input": nvfp4_deq(rht=True), "weight": nvfp4_deq(block_2d=True), "grad_output": nvfp4_deq(rht=True)},
    ),
    "hybrid": (
        {
            "input": lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(rht=True)),
            "weight": lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer()),
            "grad_output": lambda: NVFP4Quantizer(rht=True),
        },
        {"input": hybrid_deq(nvfp4_deq(rht=True)), "weight": hybrid_deq(nvfp4_deq()), "grad_output": nvfp4_deq(rht=True)},
    ),
}


def factory_for(case):
    makers = CASES[case][0]
    return lambda role: makers[role.tensor_type]()


def varied(*shape, seed):
    """Magnitudes that change every few elements, so block scales differ."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator) * torch.exp2(torch.randint(-3, 4, shape, generator=generator).float())


def assert_gemm_matches(actual, a, b):
    """actual ≈ a @ b (float64 reference) within fp32 accumulation-order tolerance."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    expected = a @ b
    bound = 1e-5 * (np.abs(a) @ np.abs(b)) + 1e-30
    error = np.abs(actual.detach().double().numpy() - expected)
    assert np.all(error <= bound), f"max error/bound {np.max(error / bound):.3g}"


def build(case, weights, override, frozen, seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(K, N)
    with torch.no_grad():
        layer.weight.copy_(varied(N, K, seed=seed + 1))
    original_weight = layer.weight.detach().clone()
    if frozen == "weight":
        layer.weight.requires_grad_(False)
    qtensor.quantize_(layer, qtensor.Recipe(factory_for(case), backward_override=override), weights=weights)
    x = varied(*M_SHAPE, K, seed=seed + 2).requires_grad_(frozen != "input")
    return layer, x, original_weight


@pytest.mark.parametrize("frozen", ["nothing", "weight", "input"])
@pytest.mark.parametrize("override", [None, "high_precision", "dequantized"])
@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("case", list(CASES))
def test_three_gemms_match_the_oracle_reference(case, weights, override, frozen):
    layer, x, w = build(case, weights, override, frozen)
    deq = CASES[case][1]
    x2d, w2d = x.detach().reshape(-1, K).numpy(), w.numpy()
    grad = varied(*M_SHAPE, N, seed=7)
    g2d = grad.reshape(-1, N).numpy()

    y = layer(x)
    assert y.shape == (*M_SHAPE, N) and y.dtype == torch.float32
    assert_gemm_matches(y.reshape(-1, N) - layer.bias.detach(), deq["input"](x2d, "rowwise"), deq["weight"](w2d, "rowwise").T)
    y.backward(grad)

    # weights="quantized" holds no higher precision than its own (rowwise) values.
    w_original = deq["weight"](w2d, "rowwise") if weights == "quantized" else w2d
    if override is None:
        dgrad_operands = (deq["grad_output"](g2d, "rowwise"), deq["weight"](w2d, "columnwise"))
        wgrad_operands = (deq["grad_output"](g2d, "columnwise").T, deq["input"](x2d, "columnwise"))
    elif override == "high_precision":
        dgrad_operands, wgrad_operands = (g2d, w_original), (g2d.T, x2d)
    else:
        dgrad_operands = (g2d, deq["weight"](w2d, "rowwise"))
        wgrad_operands = (g2d.T, deq["input"](x2d, "rowwise"))

    if frozen == "input":
        assert x.grad is None
    else:
        assert_gemm_matches(x.grad.reshape(-1, K), *dgrad_operands)
    if frozen == "weight":
        assert layer.weight.grad is None
    else:
        assert layer.weight.grad.dtype == torch.float32 and type(layer.weight.grad) is torch.Tensor
        assert_gemm_matches(layer.weight.grad, *wgrad_operands)
    np.testing.assert_allclose(layer.bias.grad.numpy(), g2d.astype(np.float64).sum(0), rtol=1e-6, atol=1e-5)


def saved_by_forward(layer, x):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x)
    return saved


@pytest.mark.parametrize("override,direction", [(None, "columnwise"), ("dequantized", "rowwise")])
def test_only_what_the_backward_reads_is_saved(override, direction):
    # A frozen weight saves no input; an input that needs no gradient saves no weight. A quantized
    # operand is saved as the buffers of the one direction the backward reads.
    for frozen, expected in (("nothing", {"x", "w"}), ("weight", {"w"}), ("input", {"x"})):
        layer, x, _ = build("mxfp8", "dynamic", override, frozen)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # the hooks see plain tensors only
            grad_fn = layer(x).grad_fn
        rebuilds = dict(zip("xw", grad_fn.rebuild))
        assert {name for name, rebuild in rebuilds.items() if rebuild is not None} == expected, frozen
        for rebuild in filter(None, rebuilds.values()):
            assert rebuild.cls is qtensor.MXFP8Tensor and rebuild.direction == direction
            assert sorted(rebuild.names) == ["data", "scale_inv"]
        assert all(type(t) is torch.Tensor for t in grad_fn.saved_tensors if t is not None)


def test_high_precision_override_saves_the_original_operands():
    layer, x, w = build("mxfp8", "dynamic", "high_precision", "nothing")
    saved = saved_by_forward(layer, x)
    assert len(saved) == 2 and not any(isinstance(t, qtensor.QuantizedTensor) for t in saved)
    assert any(torch.equal(t, x.detach().reshape(-1, K)) for t in saved)
    assert any(torch.equal(t, w) for t in saved)


def test_each_tensor_is_quantized_once_per_step():
    layer, x, _ = build("hybrid", "dynamic", None, "nothing")
    linear = layer.weight.linear_quantizers
    spies = {role: mock.patch.object(q, "quantize", wraps=q.quantize) for role, q in linear.roles().items()}
    with spies["input"] as input_spy, spies["weight"] as weight_spy, spies["grad_output"] as grad_spy:
        layer(x).sum().backward()
    assert (input_spy.call_count, weight_spy.call_count, grad_spy.call_count) == (1, 1, 1)
    assert input_spy.call_args.kwargs == {"rowwise": True, "columnwise": True}
    assert grad_spy.call_args.kwargs == {"rowwise": True, "columnwise": True}


def test_none_role_stays_in_high_precision():
    layer = nn.Linear(K, N)
    weight = layer.weight.detach().clone()
    factory = lambda role: MXFP8Quantizer() if role.tensor_type == "weight" else None  # noqa: E731
    report = qtensor.quantize_(layer, factory)
    assert "input=high precision" in report.quantized[""]
    x = varied(4, K, seed=3)
    assert_gemm_matches(layer(x) - layer.bias.detach(), x.numpy(), oracle.mxfp8(weight.numpy(), "rowwise").deq.T)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_matmul_mm_and_addmm_on_the_weight_give_the_linear_forward(weights):
    layer, x, _ = build("mxfp8", weights, None, "nothing")
    x2d = x.detach().reshape(-1, K)
    expected = layer(x2d)
    bias = layer.bias
    assert torch.equal(x2d @ layer.weight.t() + bias, expected)
    assert torch.equal(torch.matmul(x2d, layer.weight.T) + bias, expected)
    assert torch.equal(torch.mm(x2d, layer.weight.transpose(0, 1)) + bias, expected)
    assert torch.equal(torch.addmm(bias, x2d, layer.weight.t()), expected)
    # Any other use of the transpose sees the plain values.
    transposed = layer.weight.t()
    reference = layer.weight.dequantize() if weights == "quantized" else layer.weight.plain()
    assert torch.equal(transposed + 0, reference.t())


def test_nan_in_the_input_reaches_only_the_rows_it_touches():
    for case in CASES:
        layer, x, _ = build(case, "dynamic", None, "nothing")
        x = x.detach().reshape(-1, K).clone()
        x[5, 17] = float("nan")
        y = layer(x)
        assert torch.isnan(y[5]).all(), case
        assert not torch.isnan(torch.cat([y[:5], y[6:]])).any(), case


def test_no_grad_inference_mode_and_eval_use_the_forward_path_only():
    layer, x, _ = build("hybrid", "dynamic", None, "nothing")
    with torch.no_grad():
        expected = layer(x)
    with torch.inference_mode():
        assert torch.equal(layer(x), expected)
    layer.eval()
    assert torch.equal(layer(x).detach(), expected)
    quantized_layer, _, _ = build("hybrid", "quantized", None, "nothing")
    with torch.inference_mode():
        assert torch.equal(quantized_layer(x), expected)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_activation_checkpointing_gives_identical_gradients(weights):
    def run(use_checkpoint):
        layer, x, _ = build("hybrid", weights, None, "nothing")
        model = nn.Sequential(layer, nn.GELU(), nn.Linear(N, 8))
        qtensor.quantize_(model[2], factory_for("mxfp8"), weights=weights)
        if use_checkpoint:
            y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
        else:
            y = model(x)
        y.square().sum().backward()
        return y.detach(), x.grad, [p.grad for p in model.parameters()]

    plain, checkpointed = run(False), run(True)
    assert torch.equal(plain[0], checkpointed[0]) and torch.equal(plain[1], checkpointed[1])
    for a, b in zip(plain[2], checkpointed[2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_autograd_grad_through_a_checkpoint_matches_the_plain_run(weights):
    layer, x, _ = build("mxfp8", weights, None, "nothing")
    weights_of_output = varied(*M_SHAPE, N, seed=9)
    expected = torch.autograd.grad((layer(x) * weights_of_output).sum(), [x, layer.weight])
    out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    actual = torch.autograd.grad((out * weights_of_output).sum(), [x, layer.weight])
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))


def test_activation_checkpointing_with_delayed_scaling_replays_the_original_scales():
    def run(use_checkpoint):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(K, 32), nn.GELU(), nn.Linear(32, 8))
        qtensor.quantize_(model, qtensor.recipes.float8_delayed())
        x = varied(16, K, seed=4).requires_grad_(True)
        grads = []
        for step in range(3):
            inputs = x * (step + 1)
            y = torch.utils.checkpoint.checkpoint(model, inputs, use_reentrant=False) if use_checkpoint else model(inputs)
            y.square().sum().backward()
            grads += [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
        return grads, [model[0].weight.linear_quantizers.roles()[r].amax_history for r in ("input", "weight", "grad_output")]

    (plain_grads, plain_history), (checkpointed_grads, checkpointed_history) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, checkpointed_grads))
    assert all(torch.equal(a, b) for a, b in zip(plain_history, checkpointed_history))
    assert int((plain_history[0] >= 0).sum()) == 3  # one cast per step, recomputation recorded nothing


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_alternating_train_and_eval_steps_leave_no_stale_data(weights):
    def train(alternate):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(K, 64), nn.GELU(), nn.Linear(64, N))
        qtensor.quantize_(model, factory_for("hybrid"), weights=weights)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        if weights == "quantized":
            optimizer = qtensor.optim.MasterWeights(optimizer)
        losses = []
        for step in range(4):
            x = varied(16, K, seed=100 + step)
            if alternate:
                model.eval()
                with torch.inference_mode():
                    model(x)
                with torch.no_grad():
                    model(x)
                model.train()
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, [p.detach().clone() if not isinstance(p, qtensor.QuantizedTensor) else p.dequantize() for p in model.parameters()]

    steady, alternating = train(False), train(True)
    assert steady[0] == alternating[0]
    for a, b in zip(steady[1], alternating[1]):
        assert torch.equal(a, b)


def test_dynamic_weight_picks_up_new_values_after_each_optimizer_step():
    layer, x, _ = build("mxfp8", "dynamic", None, "nothing")
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    for _ in range(2):
        layer(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        current = layer.weight.plain().detach().numpy()
        with torch.no_grad():
            y = layer(x.detach().reshape(-1, K)) - layer.bias
        assert_gemm_matches(y, oracle.mxfp8(x.detach().reshape(-1, K).numpy(), "rowwise").deq, oracle.mxfp8(current, "rowwise").deq.T)


def test_bf16_autocast_gives_bf16_output_from_the_same_fp32_reference():
    layer, x, w = build("mxfp8", "dynamic", None, "nothing")
    with torch.no_grad():
        expected = layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, expected.to(torch.bfloat16))


def test_dequantized_backward_uses_the_exact_fp32_forward_operands_of_a_bf16_layer():
    layer, x, w = build("nvfp4", "dynamic", "dequantized", "nothing")
    layer.to(torch.bfloat16)
    x = x.detach().to(torch.bfloat16).requires_grad_(True)
    seen = {}

    def recording(name, real):
        def gemm_op(grad, operand, *rest, **options):
            seen[name] = operand
            return real(grad, operand, *rest, **options)

        return gemm_op

    with mock.patch.object(qtensor.gemm, "dgrad", recording("w", qtensor.gemm.dgrad)), mock.patch.object(
        qtensor.gemm, "wgrad", recording("x", qtensor.gemm.wgrad)
    ):
        layer(x).sum().backward()
    x2d = x.detach().float().reshape(-1, K).numpy()
    w2d = layer.weight.plain().detach().float().numpy()
    assert seen["w"].dtype == torch.float32 and seen["x"].dtype == torch.float32
    oracle.assert_same_bits(seen["w"].numpy(), oracle.nvfp4(w2d, "rowwise", block_2d=True).deq)
    oracle.assert_same_bits(seen["x"].numpy(), oracle.nvfp4(x2d, "rowwise").deq)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("shape", [(0, 4), (4, 0)], ids=["no_inputs", "no_outputs"])
def test_a_layer_with_nothing_to_multiply_gives_the_stock_output(shape, weights):
    """nn.Linear(0, 4) returns its bias, nn.Linear(4, 0) an empty output: the same values and
    gradients as the stock layer, in both weight modes."""
    torch.manual_seed(0)
    stock = nn.Linear(*shape)
    layer = nn.Linear(*shape)
    layer.load_state_dict(stock.state_dict())
    qtensor.quantize_(layer, qtensor.recipes.float8_current(), weights=weights)
    x = torch.randn(2, 3, shape[0], requires_grad=True)
    x_stock = x.detach().clone().requires_grad_()
    y, y_stock = layer(x), stock(x_stock)
    assert y.shape == y_stock.shape == (2, 3, shape[1]) and torch.equal(y, y_stock)
    (y * torch.arange(y.numel()).reshape(y.shape)).sum().backward()
    (y_stock * torch.arange(y.numel()).reshape(y.shape)).sum().backward()
    assert torch.equal(x.grad, x_stock.grad) and torch.equal(layer.bias.grad, stock.bias.grad)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_a_model_made_float64_after_quantize_refuses_its_input_by_name(weights):
    """docs/limitations.md: `.double()` goes through, the forward refuses float64 naming the layer."""
    model = nn.Sequential(nn.Linear(32, 32))
    qtensor.quantize_(model, qtensor.recipes.mxfp8(), weights=weights)
    model.double()
    with pytest.raises(TypeError, match="0: input is torch.float64; quantized layers take float32, bfloat16 or float16"):
        model(torch.randn(4, 32, dtype=torch.float64))
