"""Switches a user of TransformerEngine or torchao expects: ready recipes with options, layers kept
in high precision by name, quantization off for a block of code, the dtype rules of nn.Linear."""

import copy
import os

import pytest
import torch
from torch import nn

import qtensor
from qtensor import Role

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def quantizers_of(recipe) -> dict:
    return {role: recipe(Role("linear", role, "layer")) for role in ("input", "weight", "grad_output")}


def test_ready_recipes_take_the_options_of_the_quantizers_they_build():
    delayed = quantizers_of(qtensor.recipes.float8_delayed(margin=2, amax_history_len=16, amax_compute_algo="most_recent"))
    for quantizer in delayed.values():
        assert (quantizer.scaling, quantizer.margin, quantizer.amax_history_len, quantizer.amax_compute_algo) == ("delayed", 2, 16, "most_recent")
        assert quantizer.amax_history.shape == (16,)
    current = quantizers_of(qtensor.recipes.float8_current(fp8_dtype=E5M2, grad_fp8_dtype=E4M3, force_pow_2_scales=True))
    assert [q.fp8_dtype for q in current.values()] == [E5M2, E5M2, E4M3] and all(q.force_pow_2_scales for q in current.values())
    mx = quantizers_of(qtensor.recipes.mxfp8(scale_rounding="floor", grad_fp8_dtype=E5M2))
    assert [(q.scale_rounding, q.fp8_dtype) for q in mx.values()] == [("floor", E4M3), ("floor", E4M3), ("floor", E5M2)]
    nv = quantizers_of(qtensor.recipes.nvfp4(rht=False, stochastic_rounding=False, weight_block_2d=False))
    assert not any(q.rht or q.stochastic_rounding or q.block_2d for q in nv.values())
    weight_only = quantizers_of(qtensor.recipes.nvfp4(weight_only=True, weight_block_2d=False))
    assert [type(q).__name__ for q in weight_only.values()] == ["IdentityQuantizer", "NVFP4Quantizer", "IdentityQuantizer"]
    assert weight_only["input"].dtype == weight_only["grad_output"].dtype == "autocast" and not weight_only["weight"].block_2d
    hybrid = quantizers_of(qtensor.recipes.mxfp8_fwd_nvfp4_bwd(scale_rounding="floor", rht=False, seed=7))
    assert hybrid["input"].rowwise.scale_rounding == "floor" and not hybrid["input"].columnwise.rht
    assert hybrid["grad_output"].stochastic_rounding and hybrid["grad_output"].seed == 7
    # Defaults are the recipes as documented; the repr shows what a call changed.
    assert [q.fp8_dtype for q in quantizers_of(qtensor.recipes.float8_current()).values()] == [E4M3, E4M3, E5M2]
    assert repr(qtensor.recipes.float8_delayed(margin=2)) == "qtensor.recipes.float8_delayed(margin=2)"


def test_a_bad_recipe_option_raises_when_the_recipe_is_made():
    with pytest.raises(ValueError, match="scale_rounding"):
        qtensor.recipes.mxfp8(scale_rounding="up")
    with pytest.raises(ValueError, match="margin"):
        qtensor.recipes.float8_delayed(margin=-1)
    with pytest.raises(TypeError):
        qtensor.recipes.nvfp4(block_2d=True)  # the recipe's option is weight_block_2d
    with pytest.raises(ValueError, match="seed"):
        qtensor.recipes.nvfp4(weight_only=True, seed=3)  # no gradient is rounded
    with pytest.raises(ValueError, match="rht"):
        qtensor.recipes.nvfp4(weight_only=True, rht=False)  # no input or gradient is transformed


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"attn": nn.MultiheadAttention(32, 4, batch_first=True), "mlp": nn.Linear(32, 32)}) for _ in range(2)])
        self.lm_head = nn.Linear(32, 10)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer["attn"](x, x, x, need_weights=False)[0]
            x = x + layer["mlp"](x)
        return self.lm_head(x)


def test_layers_named_or_matched_by_a_pattern_stay_in_high_precision():
    model = Tiny()
    report = qtensor.quantize_(model, qtensor.recipes.mxfp8(), exclude=["lm_head", "layers.*.attn"])
    assert set(report.quantized) == {"layers.0.mlp", "layers.1.mlp"}
    assert report.skipped["lm_head"] == "kept in high precision by exclude='lm_head'"
    assert "exclude='layers.*.attn'" in report.skipped["layers.0.attn.in_proj"]
    assert "exclude='layers.*.attn'" in report.skipped["layers.1.attn.out_proj"]
    assert type(model.lm_head.weight) is nn.Parameter and not hasattr(model.lm_head.weight, "linear_quantizers")
    assert report.output_head == "lm_head" and "'lm_head', in high precision" in str(report)
    model(torch.randn(2, 4, 32)).sum().backward()


def test_a_name_that_matches_no_layer_raises_and_changes_nothing():
    model = Tiny()
    before = {name: type(p) for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"exclude=\['lm_haed'\] matches no linear layer"):
        qtensor.quantize_(model, qtensor.recipes.mxfp8(), exclude=["lm_haed"])
    assert {name: type(p) for name, p in model.named_parameters()} == before


def test_the_report_says_whether_the_output_head_is_quantized():
    report = qtensor.quantize_(Tiny(), qtensor.recipes.float8_current())
    assert report.output_head == "lm_head" and "lm_head" in report.quantized
    assert "output head (the last linear layer): 'lm_head', quantized; exclude=['lm_head']" in str(report)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_inside_high_precision_a_quantized_model_runs_as_the_stock_model(weights):
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    model = copy.deepcopy(stock)
    qtensor.quantize_(model, qtensor.recipes.float8_delayed(), weights=weights)
    if weights == "quantized":  # the stock model with the quantized weights' values
        with torch.no_grad():
            for plain, quantized in zip((stock[0], stock[2]), (model[0], model[2])):
                plain.weight.copy_(quantized.weight.dequantize())
    x = torch.randn(8, 64)
    histories = [q.amax_history for layer in (model[0], model[2]) for q in layer.weight.linear_quantizers.roles().values()]
    before = [history.clone() for history in histories]
    qtensor.gemm.backend_counts(reset=True)
    with qtensor.high_precision():
        y = model(x)
        y.square().sum().backward()
    expected = stock(x)
    expected.square().sum().backward()
    assert torch.equal(y, expected) and qtensor.gemm.backend_counts() == {}
    for quantized, plain in zip(model.parameters(), stock.parameters()):
        assert torch.equal(quantized.grad, plain.grad)
    assert all(torch.equal(history, kept) for history, kept in zip(histories, before))  # nothing recorded
    model(x)  # and quantized again outside
    assert qtensor.gemm.backend_counts() == {"reference": 2}


def test_high_precision_is_a_switch_of_the_thread_that_sets_it():
    import threading

    model = nn.Sequential(nn.Linear(64, 64))
    qtensor.quantize_(model, qtensor.recipes.mxfp8())
    seen = {}

    def other_thread():
        qtensor.gemm.backend_counts(reset=True)
        model(torch.randn(4, 64))
        seen["counts"] = qtensor.gemm.backend_counts()

    with qtensor.high_precision():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen["counts"] == {"reference": 1}


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_outside_autocast_a_quantized_layer_takes_one_dtype_as_nn_linear_does(weights):
    layer = nn.Linear(64, 32)
    with pytest.raises(RuntimeError):
        layer(torch.randn(4, 64, dtype=torch.bfloat16))  # what the stock module does
    qtensor.quantize_(layer, qtensor.recipes.mxfp8(), weights=weights)
    with pytest.raises(RuntimeError, match="the input is torch.bfloat16 but the weight torch.float32"):
        layer(torch.randn(4, 64, dtype=torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(4, 64)).dtype == torch.bfloat16
    layer.bias.data = layer.bias.data.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="the bias torch.bfloat16"):
        layer(torch.randn(4, 64))


def test_the_formats_page_says_what_float8_does_with_infinities():
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "formats.md")) as file:
        page = " ".join(file.read().split())
    assert "stays NaN or Inf" not in page
    assert "±Inf becomes NaN in E4M3" in page and "stays ±Inf in E5M2" in page
    x = torch.tensor([[float("inf"), -float("inf"), 1.0]])
    e4m3 = qtensor.Float8Quantizer(E4M3).quantize(x).dequantize()
    e5m2 = qtensor.Float8Quantizer(E5M2).quantize(x).dequantize()
    assert torch.isnan(e4m3[0, :2]).all() and e5m2[0, 0] == float("inf") and e5m2[0, 1] == -float("inf")
