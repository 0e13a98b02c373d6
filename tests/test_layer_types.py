"""Layers that are linear in all but name train through the same quantized linear as nn.Linear.

Hugging Face Conv1D keeps its weight as [in, out] and calls torch.addmm(bias, x, weight);
nn.MultiheadAttention keeps its q/k/v projections in in_proj_weight and hands them to
F.multi_head_attention_forward. Each must give, bit for bit, what the equivalent nn.Linear layers
give (those are checked against the numpy oracle in test_linear.py), and quantize_'s report must
name every weight matrix it leaves in high precision.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtensor
from test_linear import CASES, factory_for, varied

transformers = pytest.importorskip("transformers")
Conv1D = transformers.pytorch_utils.Conv1D

IN, OUT = 80, 48


def linear_twin(conv):
    """The nn.Linear that computes what `conv` computes: weight = conv.weight.T."""
    linear = nn.Linear(conv.nx, conv.nf)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    return linear


def run(layer, x, grad):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(grad)
    return y, x.grad


@pytest.mark.parametrize("override", [None, "high_precision", "dequantized"])
@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("case", list(CASES))
def test_conv1d_equals_the_linear_with_the_transposed_weight(case, weights, override):
    torch.manual_seed(0)
    conv = Conv1D(OUT, IN)
    with torch.no_grad():
        conv.weight.copy_(varied(IN, OUT, seed=1))
    linear = linear_twin(conv)
    recipe = qtensor.Recipe(factory_for(case), backward_override=override)
    report = qtensor.quantize_(conv, recipe, weights=weights)
    qtensor.quantize_(linear, recipe, weights=weights)
    assert list(report.quantized) == [""] and not report.skipped
    x, grad = varied(3, 16, IN, seed=2), varied(3, 16, OUT, seed=3)

    y_conv, dx_conv = run(conv, x, grad)
    y_linear, dx_linear = run(linear, x, grad)
    assert torch.equal(y_conv, y_linear) and torch.equal(dx_conv, dx_linear)
    assert torch.equal(conv.bias.grad, linear.bias.grad)
    if weights == "dynamic":  # the parameter keeps Conv1D's [in, out] layout, and so does its gradient
        assert conv.weight.shape == (IN, OUT) and torch.equal(conv.weight.grad, linear.weight.grad.t())
    else:  # held as the [out, in] matrix the GEMMs read
        assert conv.weight.shape == (OUT, IN) and torch.equal(conv.weight.grad, linear.weight.grad)
        assert torch.equal(conv.weight.dequantize(), linear.weight.dequantize())


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_conv1d_plain_state_dict_and_dequantize_keep_the_in_out_layout(weights):
    torch.manual_seed(0)
    plain = Conv1D(OUT, IN)
    conv = copy.deepcopy(plain)
    qtensor.quantize_(conv, qtensor.recipes.mxfp8(), weights=weights)
    # A Hugging Face checkpoint (plain, [in, out]) loads into the quantized layer.
    fresh = Conv1D(OUT, IN)
    conv.load_state_dict(fresh.state_dict())
    expected = qtensor.MXFP8Quantizer().quantize(fresh.weight.detach().t().contiguous()).dequantize()
    linear = linear_twin(fresh)
    qtensor.quantize_(linear, qtensor.recipes.mxfp8(), weights=weights)
    x = varied(32, IN, seed=4)
    assert torch.equal(conv(x), linear(x))
    if weights == "quantized":
        assert torch.equal(conv.weight.dequantize(), expected)
    else:  # its own state dict is what an unquantized Conv1D loads
        plain.load_state_dict(conv.state_dict())
        assert torch.equal(plain.weight, fresh.weight)
    qtensor.dequantize_(conv)
    assert type(conv.weight) is nn.Parameter and conv.weight.shape == (IN, OUT)
    reference = expected.t() if weights == "quantized" else fresh.weight
    assert torch.equal(conv.weight, reference)


# ---- nn.MultiheadAttention -----------------------------------------------------------------
E, HEADS = 64, 4


class AttentionFromLinears(nn.Module):
    """What a quantized nn.MultiheadAttention must compute: its projections as nn.Linear layers
    around torch's own attention body (given identity projections, which are exact)."""

    def __init__(self, mha: nn.MultiheadAttention):
        super().__init__()
        packed = mha.in_proj_weight is not None
        weights = mha.in_proj_weight.chunk(3) if packed else (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
        biases = mha.in_proj_bias.chunk(3)
        self.packed = nn.Linear(E, 3 * E) if packed else None
        self.q, self.k, self.v = (nn.Linear(w.shape[1], w.shape[0]) for w in weights)
        with torch.no_grad():
            if packed:
                self.packed.weight.copy_(mha.in_proj_weight)
                self.packed.bias.copy_(mha.in_proj_bias)
        self.kv = nn.Linear(E, 2 * E) if packed else None
        with torch.no_grad():
            if packed:
                self.kv.weight.copy_(torch.cat(weights[1:]))
                self.kv.bias.copy_(torch.cat(biases[1:]))
            for linear, w, b in zip((self.q, self.k, self.v), weights, biases):
                linear.weight.copy_(w)
                linear.bias.copy_(b)
        self.out = copy.deepcopy(mha.out_proj)

    def forward(self, query, key, value):
        # nn.MultiheadAttention(batch_first=True) projects sequence-first tensors: the same rows, in
        # the order the columnwise (wgrad) blocks see them.
        same_kv, same_qk = key is value, query is key
        query = query.transpose(0, 1)
        key = query if same_qk else key.transpose(0, 1)
        value = key if same_kv else value.transpose(0, 1)
        if self.packed is not None and query is key and key is value:
            q, k, v = (p.contiguous() for p in self.packed(query).chunk(3, dim=-1))
        elif self.packed is not None and key is value:
            q = self.q(query)
            k, v = (p.contiguous() for p in self.kv(key).chunk(2, dim=-1))
        else:
            q, k, v = self.q(query), self.k(key), self.v(value)
        eye = torch.eye(E, device=q.device)
        attention, _ = F.multi_head_attention_forward(
            q, k, v, E, HEADS, None, None, None, None, False, 0.0,
            eye, None, training=True, need_weights=True, use_separate_proj_weight=True,
            q_proj_weight=eye, k_proj_weight=eye, v_proj_weight=eye,
        )
        return self.out(attention).transpose(0, 1)


def attention_grads(model, query, key, value):
    out = model(query, key, value)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(varied(*out.shape, seed=9))
    return out


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("attention", ["self", "cross_kv", "separate_weights"])
@pytest.mark.parametrize("case", ["mxfp8", "hybrid", "float8"])
def test_multihead_attention_projections_equal_nn_linear_layers(case, attention, weights):
    torch.manual_seed(0)
    kdim = 32 if attention == "separate_weights" else None
    mha = nn.MultiheadAttention(E, HEADS, batch_first=True, kdim=kdim, vdim=kdim)
    with torch.no_grad():
        for name, param in mha.named_parameters():
            param.copy_(varied(*param.shape, seed=hash(name) % 1000) * 0.1)
    reference = AttentionFromLinears(mha)
    report = qtensor.quantize_(mha, factory_for(case), weights=weights)
    qtensor.quantize_(reference, factory_for(case), weights=weights)
    if attention == "cross_kv" and weights == "quantized":
        # A quantized in_proj_weight is one tensor (one tensor-wide scale); its pieces are row slices of it.
        packed = reference.packed.weight.detach()
        for linear, piece in ((reference.q, packed[:E]), (reference.kv, packed[E:])):
            piece.linear_quantizers = linear.weight.linear_quantizers
            linear.weight = nn.Parameter(piece)
    projections = ["in_proj"] if attention != "separate_weights" else ["q_proj", "k_proj", "v_proj"]
    assert list(report.quantized) == projections + ["out_proj"] and not report.skipped

    query = varied(2, 32, E, seed=5)
    key = query if attention == "self" else varied(2, 32, kdim or E, seed=6)
    got = attention_grads(mha, query, key, query if attention == "self" else key)
    expected = attention_grads(reference, query, key, query if attention == "self" else key)
    assert torch.equal(got, expected)
    assert torch.equal(mha.out_proj.weight.grad, reference.out.weight.grad)
    if attention == "self":
        assert torch.equal(mha.in_proj_weight.grad, reference.packed.weight.grad)
    elif attention == "cross_kv":  # q and the k/v pieces are each quantized as a layer of their own
        assert torch.equal(mha.in_proj_weight.grad, torch.cat([reference.q.weight.grad, reference.kv.weight.grad]))
    else:
        for name in "qkv":
            assert torch.equal(getattr(mha, f"{name}_proj_weight").grad, getattr(reference, name).weight.grad)


def test_cross_attention_with_delayed_scaling_of_the_packed_weight_is_refused():
    mha = nn.MultiheadAttention(E, HEADS, batch_first=True)
    qtensor.quantize_(mha, qtensor.recipes.float8_delayed())
    query, memory = torch.randn(2, 16, E), torch.randn(2, 16, E)
    mha(query, query, query)  # self-attention projects with the whole weight: one history entry a step
    with pytest.raises(ValueError, match="in_proj_weight: cross-attention.*delayed-scaling"):
        mha(query, memory, memory)


def test_attention_running_state_round_trips_under_its_own_keys():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, batch_first=True)
    qtensor.quantize_(mha, qtensor.recipes.float8_delayed())
    x = torch.randn(2, 16, E)
    mha(x, x, x)[0].sum().backward()  # a training step records (docs/running-state.md)
    state = mha.state_dict()
    assert {"in_proj_input_quantizer.amax_history", "out_proj.input_quantizer.amax_history"} <= set(state)
    assert state["in_proj_input_quantizer.amax_history"][-1] == x.abs().max()
    other = nn.MultiheadAttention(E, HEADS, batch_first=True)
    qtensor.quantize_(other, qtensor.recipes.float8_delayed())
    other.load_state_dict(state)
    mha.load_state_dict(state)  # the same state on both (mha's own weight cast of this step is dropped)
    assert torch.equal(other(x, x, x)[0], mha(x, x, x)[0])


# ---- the report and strict=True ----------------------------------------------------------------
class OwnProjection(nn.Module):
    """A linear layer qtensor does not know: its weight matrix is multiplied, out of qtensor's sight."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 64))

    def forward(self, x):
        return x @ self.weight.t()


def mixed_model(own_projection=True):
    model = nn.Module()
    model.embed = nn.Embedding(10, 64)
    model.position = nn.Parameter(torch.zeros(16, 64))
    model.attention = nn.MultiheadAttention(64, 4)
    model.conv = Conv1D(64, 64)
    model.mlp = nn.Linear(64, 64)
    model.head = nn.Linear(64, 10)
    model.tied = nn.Linear(64, 10)
    model.tied.weight = model.embed.weight
    if own_projection:
        model.own = OwnProjection()
    return model


def test_report_names_every_weight_matrix_left_in_high_precision():
    model = mixed_model()
    report = qtensor.quantize_(model, qtensor.recipes.mxfp8(), filter_fn=lambda module, fqn: fqn != "head")
    assert set(report.quantized) == {"attention.in_proj", "attention.out_proj", "conv", "mlp"}
    assert set(report.skipped) == {"embed", "position", "head", "tied", "own"}
    assert report.skipped["head"] == "filtered out by filter_fn"
    assert "tied to embed.weight" in report.skipped["tied"]
    assert "embedding table" in report.skipped["embed"]
    assert "unsupported layer type OwnProjection" in report.skipped["own"]
    assert "5 skipped" in str(report)


def test_a_torch_convolution_is_no_expert_stack():
    """nn.Conv1d's weight is 3-D, like an expert stack, but the module convolves: it is reported as a
    convolution kept in high precision (which strict=True refuses), and it computes what it did."""
    model = nn.Sequential(nn.Conv1d(16, 32, 3), nn.Flatten(), nn.Linear(32 * 6, 16))
    x = torch.randn(2, 16, 8)
    expected = model[0](x)
    report = qtensor.quantize_(model, qtensor.recipes.float8_current())
    assert set(report.quantized) == {"2"}
    assert report.skipped["0.weight"].startswith("a convolution (Conv1d): its weight [32, 16, 3]")
    assert type(model[0].weight) is nn.Parameter
    torch.testing.assert_close(model[0](x), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="0.weight: a convolution"):
        qtensor.quantize_(nn.Sequential(nn.Conv1d(16, 32, 3)), qtensor.recipes.float8_current(), strict=True)


def test_strict_refuses_linear_layers_that_stay_in_high_precision_and_changes_nothing():
    model = mixed_model()
    before = {name: type(p) for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match="2 weight matrices") as error:
        qtensor.quantize_(model, qtensor.recipes.mxfp8(), strict=True)
    for name in ("tied", "own"):
        assert f"{name}:" in str(error.value)
    assert {name: type(p) for name, p in model.named_parameters()} == before
    # What remains in high precision by the user's choice or as a lookup passes.
    model = mixed_model(own_projection=False)
    report = qtensor.quantize_(model, qtensor.recipes.mxfp8(), strict=True, filter_fn=lambda module, fqn: fqn != "tied")
    assert set(report.skipped) == {"embed", "position", "tied"}
