"""QuantizeReport's counts: parameters and multiply-accumulates per token in and out of low precision,
checked against the arithmetic of each model's shapes written out here, and the warning when most
of a model stays in high precision."""

import pytest
import torch
import transformers
from torch import nn
from transformers.pytorch_utils import Conv1D

import qtensor
from qtensor.quantize import QuantizeReport


def expected_line(what: str, low: int, high: int) -> str:
    total = low + high
    return f"{what}: {round(100 * low / total)}% in low precision ({low:,} of {total:,}), {round(100 * high / total)}% in high precision ({high:,}"


class OwnProjection(nn.Module):
    """A layer type qtensor does not know, with a weight matrix."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 64))


def mixed_model():
    model = nn.Module()
    model.embed = nn.Embedding(100, 64)
    model.attention = nn.MultiheadAttention(64, 4)  # in_proj [192, 64] + bias 192; out_proj [64, 64] + bias 64
    model.conv = Conv1D(128, 64)  # weight [64, 128] + bias 128
    model.mlp = nn.Linear(128, 64)
    model.head = nn.Linear(64, 100, bias=False)
    model.own = OwnProjection()
    return model


def test_a_plain_model_counts_every_parameter_and_each_layers_multiply_accumulates():
    model = mixed_model()
    report = qtensor.quantize_(model, qtensor.recipes.mxfp8(), exclude=["head"])
    low_params = 192 * 64 + 64 * 64 + 64 * 128 + 128 * 64  # in_proj, out_proj, conv, mlp
    high_params = 100 * 64 + (192 + 64 + 128 + 64) + 64 * 100 + 16 * 64  # embedding, biases, head, own
    assert (report.parameters.low, report.parameters.high) == (low_params, high_params)
    assert report.parameters.embedding_tables == 100 * 64
    # Per token: in × out of each linear layer; the embedding is a lookup; `own`'s is not known.
    low_macs = 64 * 192 + 64 * 64 + 64 * 128 + 128 * 64
    assert (report.macs_per_token.low, report.macs_per_token.high) == (low_macs, 64 * 100)
    assert report.macs_per_token.unknown == ("own",)
    assert report.macs_by_layer["head"] == (64 * 100, False) and report.macs_by_layer["conv"] == (64 * 128, True)
    text = str(report)
    assert "4 quantized, 3 skipped" in text
    assert expected_line("parameters", low_params, high_params) + ", 6,400 of them in embedding tables)" in text
    assert expected_line("multiply-accumulates per token", low_macs, 64 * 100) + "); unknown, left out: own" in text


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_quantized_weights_count_by_their_logical_shape(weights):
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 32))
    report = qtensor.quantize_(model, qtensor.recipes.float8_current(), weights=weights, exclude=["3"])
    assert weights == "dynamic" or isinstance(model[0].weight, qtensor.QuantizedTensor)
    assert (report.parameters.low, report.parameters.high) == (2 * 64 * 128, 64 * 32 + 128 + 64 + 32)
    assert (report.macs_per_token.low, report.macs_per_token.high) == (2 * 64 * 128, 64 * 32)
    assert report.mostly_high_precision() is None


def test_a_share_reads_100_or_0_percent_only_when_exact():
    report = qtensor.quantize_(nn.Linear(256, 256), qtensor.recipes.float8_current())  # 65,536 of 65,792
    assert "parameters: 99% in low precision (65,536 of 65,792), 1% in high precision (256)" in str(report)


def test_a_bare_linear_layer_is_the_model_itself():
    report = qtensor.quantize_(nn.Linear(4, 4), qtensor.recipes.float8_current())
    text = str(report)
    assert list(report.quantized) == [""] and report.output_head == ""
    assert "(the model)  quantized" in text and "exclude=['']" not in text and "output head" not in text
    assert "the model is itself a single linear layer" in text and text.endswith(", quantized")
    # exclude=[''] names that layer, as the report says, and keeps it in high precision.
    model = nn.Linear(4, 4)
    report = qtensor.quantize_(model, qtensor.recipes.float8_current(), exclude=[""])
    assert type(model.weight) is nn.Parameter and list(report.skipped) == [""]
    assert str(report).endswith(", in high precision") and (report.parameters.low, report.parameters.high) == (0, 20)


MOE = {
    "mixtral": lambda: transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
    ),
}


def moe_arithmetic(vocab=128, hidden=32, expert=64, layers=2, experts=4, per_token=2, kv=16):
    """Per layer: attention q, o [32, 32] and k, v [16, 32]; a stack [4, 128, 32] (gate and up) and
    [4, 32, 64] (down); a router [4, 32]. Then the output head [128, 32]."""
    attention = 2 * hidden * hidden + 2 * hidden * kv
    stacks = experts * (2 * expert * hidden + hidden * expert)
    return {
        "attention": layers * attention, "stacks": layers * stacks, "head": vocab * hidden,
        "router": layers * experts * hidden, "embedding": vocab * hidden,
        "stack_macs": layers * per_token * (2 * expert * hidden + hidden * expert),
    }


@pytest.mark.parametrize("name", list(MOE))
def test_a_mixture_of_experts_with_its_experts_kept_in_high_precision_warns(name):
    model = transformers.AutoModelForCausalLM.from_config(MOE[name]())
    report = qtensor.quantize_(model, qtensor.recipes.float8_current(), exclude=["*.experts"])
    n = moe_arithmetic()
    assert (report.macs_per_token.low, report.macs_per_token.high) == (n["attention"] + n["head"], n["stack_macs"] + n["router"])
    assert report.macs_per_token.high > 2 * report.macs_per_token.low  # most of the compute stays high
    assert report.parameters.low == n["attention"] + n["head"]
    norms = (2 * 2 + 1) * 32 + (2 * 2 * 8 if name == "qwen3_moe" else 0)  # Qwen3 norms q and k too
    assert report.parameters.high == n["stacks"] + n["router"] + n["embedding"] + norms
    warning = report.mostly_high_precision()
    assert warning is not None and "model.layers.*.mlp.experts.gate_up_proj" in warning
    high = n["stack_macs"] + n["router"]
    assert f"{round(100 * high / (high + n['attention'] + n['head']))}% of its multiply-accumulates per token" in warning
    # Everything quantized: no warning.
    model = transformers.AutoModelForCausalLM.from_config(MOE[name]())
    report = qtensor.quantize_(model, qtensor.recipes.float8_current())
    assert (report.macs_per_token.low, report.macs_per_token.high) == (n["attention"] + n["head"] + n["stack_macs"], n["router"])
    assert report.mostly_high_precision() is None


def test_two_calls_merge_into_the_counts_of_the_whole_model():
    """from_pretrained's two passes: the layers outside expert stacks, then the stacks."""
    model = transformers.AutoModelForCausalLM.from_config(MOE["mixtral"]())
    has_stacks = lambda module: any(p.dim() == 3 for p in module.parameters(recurse=False))
    report = qtensor.quantize_(model, qtensor.recipes.float8_current(), filter_fn=lambda m, name: not has_stacks(m))
    assert report.mostly_high_precision() is not None  # the stacks not yet quantized
    report.merge(qtensor.quantize_(model, qtensor.recipes.float8_current(), filter_fn=lambda m, name: has_stacks(m)))
    n = moe_arithmetic()
    assert (report.macs_per_token.low, report.macs_per_token.high) == (n["attention"] + n["head"] + n["stack_macs"], n["router"])
    assert "model.layers.0.mlp.experts.down_proj" in report.quantized and "model.layers.0.mlp.experts.down_proj" not in report.skipped
    assert report.mostly_high_precision() is None


def test_experts_per_token_left_unknown_where_the_model_does_not_say():
    model = nn.Module()
    model.experts = nn.Module()
    model.experts.down_proj = nn.Parameter(torch.randn(4, 32, 64))
    report = qtensor.quantize_(model, qtensor.recipes.float8_current())
    assert report.macs_per_token.unknown == ("experts.down_proj",) and report.macs_per_token.total == 0
    assert report.parameters.low == 4 * 32 * 64
    model.experts.top_k = 2  # the model says
    assert QuantizeReport().count(model).macs_per_token.low == 2 * 32 * 64


def test_tied_embeddings_count_once_on_the_meta_device():
    config = transformers.Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    report = qtensor.quantize_(model, qtensor.recipes.float8_current())
    assert "tied" in report.skipped["lm_head"]
    per_layer = 2 * 32 * 32 + 2 * 16 * 32 + 3 * 32 * 64  # q, o; k, v; gate, up, down
    biases_and_norms = 2 * (32 + 16 + 16) + (2 * 2 + 1) * 32
    assert (report.parameters.low, report.parameters.high) == (2 * per_layer, 128 * 32 + biases_and_norms)
    assert report.parameters.embedding_tables == 128 * 32  # the shared table, once
    assert (report.macs_per_token.low, report.macs_per_token.high) == (2 * per_layer, 32 * 128)  # the head multiplies it


def test_a_report_built_by_hand_has_no_counts():
    report = QuantizeReport(quantized={"a": "x"})
    assert report.parameters is None and report.macs_per_token is None and report.mostly_high_precision() is None
    assert str(report).splitlines()[-1] == "1 quantized, 0 skipped"
