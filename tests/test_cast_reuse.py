"""Casts made once and reused, never stale: a dynamic weight is quantized once per optimizer step
(gradient accumulation shares the cast), and an input read by several layers (q, k, v) is cast once."""

import copy

import pytest
import torch
from torch import nn

import qtensor

STATELESS_RECIPES = ["float8_current", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd", "float8_rowwise", "float8_blockwise"]


def two_layers(recipe, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))
    qtensor.quantize_(model, getattr(qtensor.recipes, recipe)())
    return model


def count_weight_casts(model) -> list[int]:
    """Wrap each layer's weight quantizer so that its casts are counted (one counter per layer)."""
    counts = []
    for layer in (model[0], model[2]):
        quantizer = layer.weight.linear_quantizers.weight
        counts.append(0)
        index, original = len(counts) - 1, quantizer.quantize

        def counting(*args, _index=index, _original=original, **kwargs):
            counts[_index] += 1
            return _original(*args, **kwargs)

        quantizer.quantize = counting
    return counts


def micro_batches(step, n=4):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(8, 64, generator=generator) for _ in range(n)]


@pytest.mark.parametrize("recipe", STATELESS_RECIPES + ["float8_delayed"])
def test_gradient_accumulation_casts_each_weight_twice_per_optimizer_step(recipe):
    """The first micro-batch's cast is not kept (nothing is held past a step without accumulation);
    the second's is, and serves the third and fourth."""
    model = two_layers(recipe)
    counts = count_weight_casts(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        for x in micro_batches(step):
            model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert counts == [2 * (step + 1)] * 2
    if recipe == "float8_delayed":  # one recorded amax per version of the weight: one per step
        history = model[0].weight.linear_quantizers.weight.amax_history
        assert int((history >= 0).sum()) == 3


def test_a_step_without_accumulation_holds_no_weight_cast_after_backward():
    model = two_layers("mxfp8")
    model(torch.randn(8, 64)).square().mean().backward()
    for layer in (model[0], model[2]):
        assert all(entry.quantized is None for entry in layer.weight._writes.quantized.values())


@pytest.mark.parametrize("recipe", STATELESS_RECIPES)
def test_accumulated_gradients_equal_casting_at_every_micro_batch(recipe):
    """Reference: every micro-batch on its own copy of the model (its own fresh cast), the weight
    gradients summed in the same order in fp32."""
    model = two_layers(recipe)
    batches = micro_batches(0)
    copies = [copy.deepcopy(model) for _ in batches]
    torch.manual_seed(7)  # stochastic rounding of the gradients draws from torch's generator
    for x in batches:
        model(x).square().mean().backward()
    torch.manual_seed(7)
    expected = [None, None]
    for twin, x in zip(copies, batches):
        twin(x).square().mean().backward()
        for i, layer in enumerate((twin[0], twin[2])):
            expected[i] = layer.weight.grad.clone() if expected[i] is None else expected[i] + layer.weight.grad
    for i, layer in enumerate((model[0], model[2])):
        assert torch.equal(layer.weight.grad, expected[i])


def optimizer_step(make):
    def write(model):
        model(torch.randn(8, 64)).square().mean().backward()
        make(model.parameters()).step()

    return write


WRITES = {
    "SGD step": optimizer_step(lambda params: torch.optim.SGD(params, lr=0.5)),
    "AdamW foreach step": optimizer_step(lambda params: torch.optim.AdamW(params, lr=0.1, foreach=True)),
    "AdamW fused step": optimizer_step(lambda params: torch.optim.AdamW(params, lr=0.1, fused=True)),
    "copy_": lambda model: model[0].weight.data.copy_(torch.randn(96, 64)),
    "load_state_dict": lambda model: model.load_state_dict(
        {**model.state_dict(), "0.weight": torch.randn(96, 64)}
    ),
    "nn.init": lambda model: nn.init.normal_(model[0].weight),
    "mul_ under no_grad": lambda model: torch.no_grad()(model[0].weight.mul_)(3.0),
    "an alias (detach)": lambda model: model[0].weight.detach().add_(1.0),
    "a slice": lambda model: model[0].weight.detach()[5].fill_(7.0),
    "a transposed view": lambda model: model[0].weight.detach().t()[3].add_(2.0),
    "the plain values": lambda model: model[0].weight.plain().mul_(-2.0),
}


@pytest.mark.parametrize("write", WRITES)
def test_a_cached_cast_is_never_read_after_the_values_change(write):
    model = two_layers("float8_current")
    x = torch.randn(8, 64)
    model(x)
    before = model(x)  # the second training forward over the same values: its cast is kept
    assert model[0].weight._writes.quantized and all(entry.quantized is not None for entry in model[0].weight._writes.quantized.values())
    WRITES[write](model)
    after = model(x)
    fresh = copy.deepcopy(model)  # same values, no cache
    assert not torch.equal(after, before), "the write did not change the layer: the test would prove nothing"
    assert torch.equal(after, fresh(x))


def test_loading_a_delayed_scaling_history_recasts_the_weight():
    model = two_layers("float8_delayed")
    x = torch.randn(8, 64)
    model(x)
    model(x)  # now the weight's history holds an amax, and the cached cast used scale 1
    state = model.state_dict()
    state["0.weight_quantizer.amax_history"] = torch.full_like(state["0.weight_quantizer.amax_history"], 1000.0)
    model.load_state_dict(state)
    fresh = copy.deepcopy(model)
    assert torch.equal(model(x), fresh(x))


def test_inference_forwards_do_not_use_the_training_cast():
    """Under no_grad every forward casts afresh (what a model restored from a checkpoint does)."""
    model = two_layers("float8_current")
    counts = count_weight_casts(model)
    x = torch.randn(8, 64)
    model(x)
    model(x)
    model(x)  # reads the second forward's cast
    assert counts == [2, 2]
    with torch.no_grad():
        model(x)
        model(x)
    assert counts == [4, 4]


# ---- one cast of an input read by several layers -----------------------------------------------
class ThreeReaders(nn.Module):
    """q, k and v projections of one input, as in attention."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(64, 32), nn.Linear(64, 32), nn.Linear(64, 16)

    def forward(self, x):
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def count_input_casts(model) -> list[int]:
    counts = [0]
    for layer in (model.q, model.k, model.v):
        quantizer = layer.weight.linear_quantizers.input
        original = quantizer.quantize

        def counting(*args, _original=original, **kwargs):
            counts[0] += 1
            return _original(*args, **kwargs)

        quantizer.quantize = counting
    return counts


@pytest.mark.parametrize("recipe", STATELESS_RECIPES)
def test_an_input_read_by_three_layers_is_cast_once_and_gives_the_same_result(recipe):
    torch.manual_seed(0)
    model = ThreeReaders()
    qtensor.quantize_(model, getattr(qtensor.recipes, recipe)())
    twins = [copy.deepcopy(model) for _ in range(3)]
    counts = count_input_casts(model)
    x = torch.randn(4, 8, 64, requires_grad=True)
    torch.manual_seed(5)
    out = model(x)
    out.square().sum().backward()
    assert counts == [1]
    # Reference: each layer of the twin on its own view of x (a new tensor each: its own cast),
    # the three input gradients summed by autograd as in the model.
    twin_counts = [count_input_casts(twin) for twin in twins]
    torch.manual_seed(5)
    x_twin = x.detach().clone().requires_grad_(True)
    pieces = [getattr(twin, name)(x_twin.view_as(x_twin)) for twin, name in zip(twins, "qkv")]
    torch.cat(pieces, dim=-1).square().sum().backward()
    assert twin_counts == [[1], [1], [1]]
    assert torch.equal(out, torch.cat(pieces, dim=-1))
    assert torch.equal(x.grad, x_twin.grad)
    for twin, name in zip(twins, "qkv"):
        assert torch.equal(getattr(model, name).weight.grad, getattr(twin, name).weight.grad)


def test_an_input_written_between_layers_is_cast_again():
    torch.manual_seed(0)
    model = ThreeReaders()
    qtensor.quantize_(model, qtensor.recipes.float8_current())
    counts = count_input_casts(model)
    x = torch.randn(8, 64)
    a = model.q(x)
    x.mul_(4.0)
    b = model.k(x)
    assert counts == [2]
    fresh = copy.deepcopy(model)
    assert torch.equal(b, fresh.k(x.clone()))
    assert not torch.equal(a, model.q(x))


@pytest.mark.parametrize("recipe", ["float8_delayed", "nvfp4_stochastic_inputs"])
def test_inputs_are_not_shared_by_quantizers_with_state_or_random_draws(recipe):
    """Delayed scaling records each cast in its own history; stochastic rounding draws anew."""
    torch.manual_seed(0)
    model = ThreeReaders()
    if recipe == "float8_delayed":
        qtensor.quantize_(model, qtensor.recipes.float8_delayed())
    else:
        factory = lambda role: qtensor.NVFP4Quantizer(stochastic_rounding=True) if role.tensor_type == "input" else None
        qtensor.quantize_(model, factory)
    counts = count_input_casts(model)
    model(torch.randn(8, 64))
    assert counts == [3]


def test_layers_with_different_input_formats_each_cast():
    torch.manual_seed(0)
    model = ThreeReaders()
    formats = iter([qtensor.Float8Quantizer(), qtensor.MXFP8Quantizer(), qtensor.Float8Quantizer(torch.float8_e5m2)])
    qtensor.quantize_(model, lambda role: next(formats) if role.tensor_type == "input" else None)
    counts = count_input_casts(model)
    model(torch.randn(8, 64))
    assert counts == [3]
