"""Fast accumulation reaches the forward GEMM by default: the Float8 recipes ask for it in fprop,
dgrad and wgrad only where `qtensor.Recipe(..., backward_fast_accumulation=True)` opts in, and a
recipe or `qtensor.Recipe` turns fprop's off.

The FP8 tensor-core GEMM is replaced here by a recorder that computes the product in float64 from the
codes and scales it is given, so the test runs on the CPU and checks what reaches `torch._scaled_mm`.
How far fast accumulation moves a product is measured on the GPU (tests/test_cuda_kernels.py).
"""

import dataclasses
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

import oracle
import qtensor
from qtensor.gemm import backends as gemm_backends


def recording_scaled_mm(calls):
    def scaled_mm(a, b, *, scale_a, scale_b, bias=None, out_dtype, use_fast_accum=False):
        calls.append(use_fast_accum)
        product = (a.double() * scale_a.double()) @ (b.double() * scale_b.double())
        if bias is not None:
            product = product + bias.double()
        return product.to(out_dtype)

    return scaled_mm


def gemm_calls(recipe, **quantize_options):
    """(fast-accumulation flag of each _scaled_mm call of one training step, the layer, its input)."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 32, bias=False)
    qtensor.quantize_(layer, recipe, **quantize_options)
    x = torch.randn(16, 64, requires_grad=True)
    calls = []
    # The FP8 tensor-core backend alone, taken as capable on this device.
    backends = tuple(dataclasses.replace(b, capable=lambda device: True) for b in gemm_backends.BACKENDS if b.name == "float8_scaled_mm")
    with mock.patch.object(gemm_backends, "BACKENDS", backends), mock.patch.object(torch, "_scaled_mm", recording_scaled_mm(calls)):
        y = layer(x)
        forward_calls = list(calls)
        y.backward(torch.randn(16, 32))
    return forward_calls, calls[len(forward_calls):], layer, x, y


@pytest.mark.parametrize("recipe", ["float8_current", "float8_delayed"])
def test_float8_recipes_use_fast_accumulation_in_fprop_only(recipe):
    forward, backward = gemm_calls(getattr(qtensor.recipes, recipe)())[:2]
    assert forward == [True]
    assert backward == [False, False]  # dgrad and wgrad keep the split fp32 accumulator


@pytest.mark.parametrize(
    "recipe",
    [
        qtensor.recipes.float8_current(fprop_fast_accumulation=False),
        qtensor.Recipe(qtensor.recipes.float8_current(), fprop_fast_accumulation=False),
    ],
    ids=["recipe_option", "Recipe"],
)
def test_fast_accumulation_can_be_turned_off(recipe):
    forward, backward = gemm_calls(recipe)[:2]
    assert forward == [False] and backward == [False, False]


def test_a_plain_factory_turns_it_on_through_Recipe():
    factory = lambda role: qtensor.Float8Quantizer() if role.tensor_type != "grad_output" else qtensor.Float8Quantizer(torch.float8_e5m2)
    assert gemm_calls(factory)[0] == [False]
    assert gemm_calls(qtensor.Recipe(factory, fprop_fast_accumulation=True))[0] == [True]


def test_the_forward_still_multiplies_the_quantized_operands():
    """The flag changes how the tensor cores accumulate, not what they multiply: the recorded GEMM
    (exact in float64) gives the oracle's product of the E4M3-quantized input and weight."""
    _, _, layer, x, y = gemm_calls(qtensor.recipes.float8_current())
    weight = layer.weight.detach().plain().float().numpy()
    expected = oracle.float8_current(x.detach().numpy(), "e4m3").deq @ oracle.float8_current(weight, "e4m3").deq.T
    np.testing.assert_allclose(y.detach().double().numpy(), expected, rtol=1e-6, atol=1e-6)


def test_the_report_and_the_recipe_say_so():
    layer = nn.Linear(64, 32)
    qtensor.quantize_(layer, qtensor.recipes.float8_current())
    assert layer.weight.linear_quantizers.fprop_fast_accumulation
    assert "fprop fast accumulation" in layer.weight.linear_quantizers.describe()
    assert repr(qtensor.recipes.float8_current(fprop_fast_accumulation=False)) == (
        "qtensor.recipes.float8_current(fprop_fast_accumulation=False)"
    )
    assert not qtensor.recipes.mxfp8().fprop_fast_accumulation
    with pytest.raises(ValueError, match="fprop_fast_accumulation must be True, False or None"):
        qtensor.Recipe(qtensor.recipes.float8_current(), fprop_fast_accumulation="yes")


def test_backward_fast_accumulation_is_opt_in_and_reaches_dgrad_and_wgrad():
    recipe = qtensor.Recipe(qtensor.recipes.float8_current(), backward_fast_accumulation=True)
    forward, backward, layer, _, _ = gemm_calls(recipe)
    assert forward == [True] and backward == [True, True]
    assert "backward fast accumulation" in layer.weight.linear_quantizers.describe()
    assert not qtensor.Recipe(qtensor.recipes.float8_current()).backward_fast_accumulation
    with pytest.raises(ValueError, match="backward_fast_accumulation must be True or False"):
        qtensor.Recipe(qtensor.recipes.float8_current(), backward_fast_accumulation=None)
