"""The one seam between the quantized linear and the parallel modes (core/placement.py,
docs/architecture.md): the linear asks the weight's `LayerPlacement` for its local operands and for
the placement of each of its three tensors, and a quantized input for its own placement. A mode
written here, outside the library, plugs in through it alone.

The reductions are seen through `torch.distributed.all_reduce`, replaced by a recorder: a tensor
placed over a group reduces exactly its tensor-wide amax (fp64 reference: the largest finite
magnitude) over that group, and nothing else is reduced.
"""

import ast
import os

import pytest
import torch

import qtensor
from qtensor import Float8Quantizer
from qtensor.core.placement import LayerPlacement, Placement, place, placement_of

ROLES = ("input", "weight", "grad_output")
GROUPS = {role: object() for role in ROLES}  # stand for process groups: all_reduce is replaced


class RecordingPlacement(LayerPlacement):
    """A parallel mode written outside the library: some of the layer's tensors placed over groups."""

    def __init__(self, placed):
        for role in placed:
            setattr(self, role, Placement(GROUPS[role]))
        self.calls = []

    def local_operands(self, x, bias):
        self.calls.append("local_operands")
        return x, bias

    def output(self, y, x, weight, bias):
        self.calls.append("output")
        return y


def layer_and_data(seed=0, weights="dynamic"):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(64, 32, bias=False)
    qtensor.quantize_(layer, qtensor.recipes.float8_current(), weights=weights)
    x = torch.randn(4, 16, 64, requires_grad=True)
    grad = torch.randn(4, 16, 32)
    return layer, x, grad


def largest_magnitude(t: torch.Tensor) -> float:
    return float(t.detach().double().abs().max())


def step(layer, x, grad):
    x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    y.backward(grad)
    return y.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("placed", [(), ("input",), ("weight", "grad_output"), ROLES], ids=lambda p: "+".join(p) or "none")
def test_a_mode_outside_the_library_places_the_layers_tensors_through_the_seam(placed, monkeypatch):
    reference_layer, x, grad = layer_and_data()
    expected = step(reference_layer, x, grad)

    layer, _, _ = layer_and_data()
    placement = RecordingPlacement(placed)
    layer.weight.placement = placement
    reduced = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None, group=None, **kw: reduced.append((group, t.clone())))
    got = step(layer, x, grad)

    # Every placed tensor reduced its tensor-wide amax over its group, once; nothing else was reduced.
    magnitudes = {"input": largest_magnitude(x), "weight": largest_magnitude(layer.weight), "grad_output": largest_magnitude(grad)}
    assert [group for group, _ in reduced] == [GROUPS[role] for role in ROLES if role in placed]
    for (_, amax), role in zip(reduced, [r for r in ROLES if r in placed]):
        assert float(amax) == magnitudes[role], role
    assert placement.calls == ["local_operands", "output"]
    # One process's values: a reduction over ranks holding the same amaxes changes nothing.
    for mine, theirs in zip(got, expected):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_an_input_that_arrived_quantized_is_read_as_its_placement_says(weights):
    """F.linear of a quantized input runs the layer's linear (not a GEMM of the dequantized input and
    the high-precision weight), which multiplies the input as it arrived."""
    layer, x, grad = layer_and_data(weights=weights)
    quantizer = layer.weight.linear_quantizers.input
    x_q = quantizer.quantize(x.detach())
    asked = []

    class Arrived(Placement):
        def arrived(self, quantizer, tensor, layer, role, *, directions):
            asked.append((role, directions))
            return super().arrived(quantizer, tensor, layer, role, directions=directions)

    place(x_q, Arrived())
    assert isinstance(placement_of(x_q), Arrived)
    with torch.no_grad():
        y = layer(x_q)
        expected = layer(x.detach())  # the layer's own cast of x: the same bytes
    assert asked == [("input", ("rowwise",))]
    assert torch.equal(y, expected)


def test_an_input_that_arrived_cast_by_another_quantizer_is_refused_naming_the_layer():
    layer, x, _ = layer_and_data()
    other = Float8Quantizer(torch.float8_e5m2).quantize(x.detach())
    with torch.no_grad(), pytest.raises(ValueError, match=r"layer '<root>': its input arrived quantized with .*e5m2"):
        layer(other)


def test_the_linear_names_no_parallel_mode():
    """The Function reaches every mode through core/placement.py: layers/linear.py imports nothing
    from qtensor/distributed/ and names no mode."""
    path = os.path.join(os.path.dirname(qtensor.__file__), "layers", "linear.py")
    tree = ast.parse(open(path).read())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not any("distributed" in module for module in imported), imported
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | {
        node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
    }
    assert not names & {"sequence_parallel", "tensor_parallel", "fsdp", "DTensor", "shards"}, names


def test_a_gathered_activation_is_refused_naming_the_style_and_what_to_use_instead():
    """Sequence parallelism's placement keeps the checks of every quantized arrival and names
    PrepareQuantizedModuleInput and its alternative in each refusal."""
    from qtensor.distributed.sequence_parallel import GatheredTokens

    layer, x, _ = layer_and_data()
    linear = layer.weight.linear_quantizers
    gathered = GatheredTokens(layout=None, local_columnwise=None)
    other = Float8Quantizer(torch.float8_e5m2).quantize(x.detach(), columnwise=False)
    with pytest.raises(ValueError, match=r"arrived quantized by PrepareQuantizedModuleInput with .*e5m2.*PrepareModuleInput"):
        gathered.arrived(linear.input, other, linear, "input", directions=("rowwise",))
    mine = linear.input.quantize(x.detach(), columnwise=False)
    with pytest.raises(ValueError, match="made for no gradient"):
        gathered.arrived(linear.input, mine, linear, "input", directions=("rowwise", "columnwise"))
    operand = gathered.arrived(linear.input, mine, linear, "input", directions=("rowwise",))
    assert operand.shape == (64, 64) and operand.columnwise is None and operand.rowwise is mine.rowwise
