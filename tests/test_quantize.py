"""quantize_, dequantize_, Role, Recipe and the ready recipes (docs/recipes.md)."""

import copy
import io

import pytest
import torch
from torch import nn

import qtensor
from qtensor import Float8Quantizer, HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(32, 64)
        self.down_proj = nn.Linear(64, 32, bias=False)
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        return x + self.down_proj(torch.relu(self.up_proj(self.norm(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(32, 10)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


LINEARS = ["layers.0.up_proj", "layers.0.down_proj", "layers.1.up_proj", "layers.1.down_proj", "lm_head"]


def test_factory_sees_every_linear_role_with_its_fully_qualified_name():
    seen = []

    def factory(role):
        seen.append(role)
        return MXFP8Quantizer()

    model = Model()
    report = qtensor.quantize_(model, factory)
    assert {(r.module_type, r.name) for r in seen} == {("linear", name) for name in LINEARS}
    assert sorted(r.tensor_type for r in seen if r.name == "lm_head") == ["grad_output", "input", "weight"]
    assert list(report.quantized) == LINEARS and report.skipped == {}
    assert qtensor.Role("linear", "weight", "lm_head") in seen
    with pytest.raises(AttributeError):
        seen[0].name = "other"  # frozen


def test_modules_stay_the_same_objects_with_their_own_forward():
    model = Model()
    before = dict(model.named_modules())
    qtensor.quantize_(model, qtensor.recipes.mxfp8())
    after = dict(model.named_modules())
    assert all(before[name] is after[name] for name in before)
    assert all(type(after[name]) is nn.Linear and "forward" not in vars(after[name]) for name in LINEARS)


def test_factory_can_keep_a_layer_in_high_precision_by_name():
    base = qtensor.recipes.mxfp8()
    model = Model()
    report = qtensor.quantize_(model, lambda role: None if role.name == "lm_head" else base(role))
    assert "lm_head" in report.skipped and "high precision" in report.skipped["lm_head"]
    assert type(model.lm_head.weight) is nn.Parameter
    assert isinstance(model.layers[0].up_proj.weight, qtensor.DynamicWeight)
    text = str(report)
    assert "lm_head" in text and "skipped" in text and "4 quantized, 1 skipped" in text


def test_filter_fn_selects_layers():
    model = Model()
    report = qtensor.quantize_(model, qtensor.recipes.mxfp8(), filter_fn=lambda module, name: name.endswith("up_proj"))
    assert list(report.quantized) == ["layers.0.up_proj", "layers.1.up_proj"]
    assert type(model.layers[0].down_proj.weight) is nn.Parameter


def test_linear_subclasses_are_included():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(MyLinear(16, 16))
    assert list(qtensor.quantize_(model, qtensor.recipes.mxfp8()).quantized) == ["0"]


def test_weights_modes_give_the_documented_parameters():
    dynamic, quantized = Model(), Model()
    quantized.load_state_dict(dynamic.state_dict())
    qtensor.quantize_(dynamic, qtensor.recipes.mxfp8(), weights="dynamic")
    qtensor.quantize_(quantized, qtensor.recipes.mxfp8(), weights="quantized")
    dynamic_weight, quantized_weight = dynamic.layers[0].up_proj.weight, quantized.layers[0].up_proj.weight
    assert isinstance(dynamic_weight, nn.Parameter) and isinstance(quantized_weight, nn.Parameter)
    assert isinstance(dynamic_weight, qtensor.DynamicWeight) and not isinstance(dynamic_weight, qtensor.QuantizedTensor)
    assert isinstance(quantized_weight, qtensor.MXFP8Tensor)
    assert quantized_weight.has_rowwise and quantized_weight.has_columnwise
    x = torch.randn(3, 32)
    assert torch.equal(dynamic(x), quantized(x))


def test_quantizing_twice_raises_and_dequantize_restores_plain_parameters():
    model = Model()
    reference = copy.deepcopy(model)
    qtensor.quantize_(model, qtensor.recipes.mxfp8())
    with pytest.raises(ValueError, match="already quantized"):
        qtensor.quantize_(model, qtensor.recipes.nvfp4())
    qtensor.dequantize_(model)
    assert all(type(p) is nn.Parameter for p in model.parameters())
    x = torch.randn(3, 32)
    assert torch.equal(model(x), reference(x))
    qtensor.quantize_(model, qtensor.recipes.nvfp4())  # allowed again


def test_dequantize_of_quantized_weights_keeps_their_quantized_values():
    model = Model()
    qtensor.quantize_(model, qtensor.recipes.nvfp4(), weights="quantized")
    values = model.lm_head.weight.dequantize()
    qtensor.dequantize_(model)
    assert type(model.lm_head.weight) is nn.Parameter and torch.equal(model.lm_head.weight.detach(), values)


class RowsOf64Only(MXFP8Quantizer):
    """A quantizer whose (hypothetical) kernel needs in_features % 64 == 0."""

    def unsupported_shape_reason(self, shape, role):
        if role != "grad_output" and shape[-1] % 64:
            return f"last dimension {shape[-1]} is not a multiple of 64"
        return None


def test_layers_a_format_cannot_take_are_skipped_with_the_reason():
    model = Model()
    report = qtensor.quantize_(model, lambda role: RowsOf64Only())
    assert list(report.quantized) == ["layers.0.down_proj", "layers.1.down_proj"]
    assert report.skipped["lm_head"] == "input: last dimension 32 is not a multiple of 64"


def test_strict_raises_naming_every_unsupported_layer_and_changes_nothing():
    model = Model()
    with pytest.raises(ValueError) as error:
        qtensor.quantize_(model, lambda role: RowsOf64Only(), strict=True)
    for name in ("layers.0.up_proj", "layers.1.up_proj", "lm_head"):
        assert name in str(error.value)
    assert all(type(p) is nn.Parameter for p in model.parameters())


def test_override_with_delayed_scaling_is_refused_at_quantize_time():
    for override in ("high_precision", "dequantized"):
        with pytest.raises(ValueError, match="delayed scaling"):
            qtensor.quantize_(Model(), qtensor.Recipe(qtensor.recipes.float8_delayed(), backward_override=override))
    hybrid_with_delayed = lambda role: HybridQuantizer(Float8Quantizer(scaling="delayed"), NVFP4Quantizer())  # noqa: E731
    with pytest.raises(ValueError, match="delayed scaling"):
        qtensor.quantize_(Model(), qtensor.Recipe(hybrid_with_delayed, backward_override="dequantized"))


def test_bad_arguments_get_clear_errors():
    with pytest.raises(ValueError, match="backward_override"):
        qtensor.Recipe(qtensor.recipes.mxfp8(), backward_override="fp64")
    with pytest.raises(ValueError, match="weights must be"):
        qtensor.quantize_(Model(), qtensor.recipes.mxfp8(), weights="static")
    with pytest.raises(TypeError, match="must return a qtensor quantizer or None"):
        qtensor.quantize_(Model(), lambda role: "mxfp8")
    with pytest.raises(TypeError, match="callable"):
        qtensor.Recipe("mxfp8")


def test_ready_recipes_pick_the_documented_quantizers():
    def chosen(recipe, tensor_type):
        return recipe(qtensor.Role("linear", tensor_type, "x"))

    float8 = qtensor.recipes.float8_current()
    assert chosen(float8, "input").fp8_dtype == torch.float8_e4m3fn and chosen(float8, "input").scaling == "current"
    assert chosen(float8, "grad_output").fp8_dtype == torch.float8_e5m2
    assert chosen(qtensor.recipes.float8_delayed(), "weight").scaling == "delayed"
    assert isinstance(chosen(qtensor.recipes.mxfp8(), "grad_output"), MXFP8Quantizer)
    nvfp4 = qtensor.recipes.nvfp4()
    assert chosen(nvfp4, "weight").block_2d and chosen(nvfp4, "input").rht
    assert chosen(nvfp4, "grad_output").stochastic_rounding
    hybrid = qtensor.recipes.mxfp8_fwd_nvfp4_bwd()
    for tensor_type in ("input", "weight"):
        quantizer = chosen(hybrid, tensor_type)
        assert isinstance(quantizer.rowwise, MXFP8Quantizer) and isinstance(quantizer.columnwise, NVFP4Quantizer)
    assert isinstance(chosen(hybrid, "grad_output"), NVFP4Quantizer)
    assert hybrid(qtensor.Role("embedding", "weight", "embed")) is None
    # every layer gets its own quantizers (delayed scaling keeps per-layer state)
    delayed = qtensor.recipes.float8_delayed()
    assert chosen(delayed, "input") is not chosen(delayed, "input")


def test_state_dict_of_a_dynamic_model_holds_plain_tensors_and_loads_back():
    model = Model()
    qtensor.quantize_(model, qtensor.recipes.mxfp8())
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert all(type(t) is torch.Tensor for t in state.values())
    fresh = Model()
    qtensor.quantize_(fresh, qtensor.recipes.mxfp8())
    fresh.load_state_dict(state)
    x = torch.randn(3, 32)
    assert torch.equal(fresh(x), model(x))
    assert isinstance(fresh.lm_head.weight, qtensor.DynamicWeight)


def test_deepcopy_and_dtype_moves_keep_quantized_layers():
    for weights in ("dynamic", "quantized"):
        model = Model()
        qtensor.quantize_(model, qtensor.recipes.mxfp8(), weights=weights)
        duplicate = copy.deepcopy(model)
        x = torch.randn(3, 32)
        assert torch.equal(duplicate(x), model(x))
        assert duplicate.lm_head.weight.linear_quantizers is not model.lm_head.weight.linear_quantizers
        model.to(torch.bfloat16)
        assert model.lm_head.weight.linear_quantizers is not None
        assert model(x.bfloat16()).dtype == torch.bfloat16


def test_a_weight_tied_to_another_module_is_skipped_not_silently_untied():
    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 32)
            self.body = nn.Linear(32, 32)
            self.head = nn.Linear(32, 10, bias=False)
            self.head.weight = self.embed.weight

    model = TiedLM()
    report = qtensor.quantize_(model, qtensor.recipes.mxfp8())
    assert list(report.quantized) == ["body"]
    assert "tied to embed.weight" in report.skipped["head"]
    assert model.head.weight is model.embed.weight
    with pytest.raises(ValueError, match="tied"):
        qtensor.quantize_(TiedLM(), qtensor.recipes.mxfp8(), strict=True)


def test_module_dtype_moves_keep_quantized_weight_storage():
    model = Model()
    qtensor.quantize_(model, qtensor.recipes.mxfp8(), weights="quantized")
    weight = model.lm_head.weight
    before = weight.dequantize(torch.float32)
    for move in (torch.nn.Module.double, torch.nn.Module.half, torch.nn.Module.float):
        move(model)
        assert model.lm_head.weight is weight  # the same parameter object, swapped in place
        assert torch.equal(weight.dequantize(torch.float32), before)
        assert weight.linear_quantizers is not None and isinstance(weight, nn.Parameter)
    assert model.lm_head.weight.rowwise.data.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_pickling_a_whole_model_keeps_its_quantized_parameters(weights):
    model = Model()
    qtensor.quantize_(model, qtensor.recipes.nvfp4(), weights=weights)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    weight = loaded.lm_head.weight
    assert isinstance(weight, nn.Parameter) and weight.requires_grad and weight.linear_quantizers is not None
    assert type(weight) is type(model.lm_head.weight)
    x = torch.randn(3, 32)
    assert torch.equal(loaded(x), model(x))


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_load_state_dict_with_assign_keeps_layers_quantized(weights):
    source = Model()
    state = source.state_dict()
    model = Model()
    qtensor.quantize_(model, qtensor.recipes.mxfp8(), weights=weights)
    model.load_state_dict(state, assign=True)
    assert model.lm_head.weight.linear_quantizers is not None
    reference = Model()
    reference.load_state_dict(state)
    qtensor.quantize_(reference, qtensor.recipes.mxfp8(), weights=weights)
    x = torch.randn(3, 32)
    assert torch.equal(model(x), reference(x))


def test_report_names_the_weight_mode_each_layer_really_has():
    keep_weight = lambda role: None if role.tensor_type == "weight" else MXFP8Quantizer()  # noqa: E731
    report = qtensor.quantize_(Model(), keep_weight, weights="quantized")
    assert all(text.endswith("weights=dynamic") for text in report.quantized.values())


def test_a_ready_recipe_passed_uncalled_gets_a_clear_error():
    with pytest.raises(TypeError, match=r"qtensor.recipes.mxfp8\(\)"):
        qtensor.quantize_(Model(), qtensor.recipes.mxfp8)


def test_one_delayed_scaling_quantizer_for_several_tensors_is_refused():
    shared = Float8Quantizer(scaling="delayed")
    with pytest.raises(ValueError, match="new quantizer on every call"):
        qtensor.quantize_(Model(), lambda role: shared)
    stateless = MXFP8Quantizer()
    qtensor.quantize_(Model(), lambda role: stateless)  # nothing to mix up: allowed


def test_bad_inputs_to_a_quantized_layer_name_the_layer():
    model = Model()
    qtensor.quantize_(model, qtensor.recipes.mxfp8())
    with pytest.raises(TypeError, match="lm_head: input is torch.float64"):
        model.lm_head(torch.randn(2, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="lm_head: input of shape"):
        model.lm_head(torch.randn(2, 31))


def test_transposes_that_are_not_the_matrix_transpose_stay_plain():
    model = Model()
    qtensor.quantize_(model, qtensor.recipes.mxfp8())
    weight = model.lm_head.weight
    same = weight.transpose(0, 0)
    assert type(same) is torch.Tensor and same.shape == weight.shape
    assert isinstance(weight.transpose(1, 0), qtensor.layers.routing.TransposedWeight)


def test_a_plain_optimizer_over_quantized_weights_raises_at_its_first_step():
    """Without MasterWeights, AdamW's state would be quantized too and the run diverges to NaN."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    qtensor.quantize_(model, qtensor.recipes.mxfp8(), weights="quantized")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 64)).square().mean().backward()
    before = model[0].weight.dequantize()
    with pytest.raises(TypeError, match=r"0\.weight.*MasterWeights"):
        optimizer.step()
    assert torch.equal(model[0].weight.dequantize(), before)  # nothing was stepped
    wrapped = qtensor.optim.MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2))
    wrapped.step()  # the supported way


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_an_optimizer_built_before_quantize_raises_naming_the_layer(weights):
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    qtensor.quantize_(model, qtensor.recipes.mxfp8(), weights=weights)
    model(torch.randn(8, 64)).square().mean().backward()
    with pytest.raises(ValueError, match=r"0\.weight.*after qtensor\.quantize_"):
        stale.step()


def test_misused_arguments_name_the_argument_and_the_fix():
    with pytest.raises(TypeError, match="takes an nn.Module, got Tensor.*quantize\\(x\\)"):
        qtensor.quantize_(torch.zeros(4, 4), qtensor.recipes.mxfp8())
    with pytest.raises(TypeError, match=r"filter_fn .* must take \(module, fqn\)"):
        qtensor.quantize_(Model(), qtensor.recipes.mxfp8(), filter_fn=lambda fqn: True)
    with pytest.raises(TypeError, match="must return a qtensor quantizer or None"):
        qtensor.quantize_(Model(), lambda role: torch.float8_e4m3fn)
