"""Tensor parallelism is not supported yet: a quantized layer under a tensor-parallel style fails
with a message that names the layer, and never trains silently in high precision.

One rank of a gloo group on the CPU (a mesh of one device) is enough: the parallel styles shard the
weight into a DTensor all the same, which is what the quantized layer must refuse.
"""

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import qtensor

STYLES = {"ColwiseParallel": ColwiseParallel, "RowwiseParallel": RowwiseParallel}
RECIPES = ["float8_current", "mxfp8"]
WEIGHTS = ["dynamic", "quantized"]


@pytest.fixture(scope="module")
def mesh():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def one_layer() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64))


def forward_and_backward(model: nn.Module) -> torch.Tensor:
    x = torch.randn(4, 64, requires_grad=True)
    y = model(x)
    y = y.full_tensor() if hasattr(y, "full_tensor") else y
    y.float().square().sum().backward()
    return y


def names_the_layer(message: str) -> bool:
    return "'0'" in message or "0.weight" in message or re.search(r"\blayer 0\b", message) is not None


def mentions_tensor_parallelism(message: str) -> bool:
    return re.search(r"tensor[ -]?parallel", message, flags=re.IGNORECASE) is not None


def test_the_message_checks_tell_a_naming_message_from_others():
    assert names_the_layer("layer '0' (0.weight) is sharded by ColwiseParallel")
    assert not names_the_layer("layer 10 is sharded")
    assert mentions_tensor_parallelism("Tensor parallelism is not supported") and mentions_tensor_parallelism("tensor-parallel style")
    assert not mentions_tensor_parallelism("FSDP2 sharding")


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("style", STYLES)
def test_a_tensor_parallel_quantized_layer_raises_naming_the_layer(mesh, style, weights, recipe):
    model = one_layer()
    qtensor.quantize_(model, getattr(qtensor.recipes, recipe)(), weights=weights)
    # At parallelize_module or at the first forward/backward; running to the end is the failure.
    with pytest.raises((ValueError, NotImplementedError, RuntimeError)) as raised:
        parallelize_module(model, mesh, {"0": STYLES[style]()})
        forward_and_backward(model)
    message = str(raised.value)
    assert names_the_layer(message), message
    assert mentions_tensor_parallelism(message), message


@pytest.mark.parametrize("style", STYLES)
def test_the_same_layer_without_quantize_parallelizes_and_trains(mesh, style):
    """The control: the refusal above is about quantization, not a broken tensor-parallel setup."""
    model = one_layer()
    reference = one_layer()
    parallelize_module(model, mesh, {"0": STYLES[style]()})
    assert type(model[0].weight).__name__ == "DTensor"
    torch.manual_seed(1)
    y = forward_and_backward(model)
    torch.manual_seed(1)
    expected = forward_and_backward(reference)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(model[0].weight.grad.full_tensor(), reference[0].weight.grad)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_a_row_slice_of_a_layer_weight_is_allowed_and_a_column_slice_is_refused(weights):
    """The guard reads each op's dim argument: a row slice at any start (FSDP2's pieces) passes."""
    layer = nn.Linear(64, 64)
    qtensor.quantize_(layer, qtensor.recipes.float8_current(), weights=weights)
    weight = layer.weight.detach()
    assert weight[31:].shape == (33, 64) and weight.narrow(0, 3, 5).shape == (5, 64)
    for column_piece in (lambda w: w[:, 8:], lambda w: w.narrow(1, 0, 32), lambda w: w.split(32, dim=1)):
        with pytest.raises(NotImplementedError, match="0.weight|weight: a quantized layer's weight is split along dim 1"):
            column_piece(weight)
