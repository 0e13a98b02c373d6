"""Stock models train through qtensor: every projection is quantized and the loss falls like bf16's."""

import copy

import pytest
import torch
from torch import nn

import qtensor
from qtensor.demo import VOCABULARY, TinyLM, sums_stream

STEPS = 40


def train(model, recipe=None, weights="dynamic", steps=STEPS, lr=3e-3):
    """Mean loss over the first 3 and the last 5 of `steps` AdamW steps on the sums stream (bf16 autocast)."""
    model = copy.deepcopy(model)
    report = qtensor.quantize_(model, recipe, weights=weights) if recipe is not None else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    if weights == "quantized":
        optimizer = qtensor.optim.MasterWeights(optimizer)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        tokens = sums_stream(8, 32, generator)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
            logits = getattr(logits, "logits", logits)
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return sum(losses[:3]) / 3, sum(losses[-5:]) / 5, report, model


def assert_trains_like_baseline(model, recipe, weights="dynamic", steps=STEPS):
    start, baseline_end, _, _ = train(model, steps=steps)
    q_start, q_end, report, trained = train(model, recipe, weights, steps=steps)
    assert abs(q_start - start) < 0.05
    assert baseline_end < 0.85 * start, "the baseline itself did not learn; the comparison means nothing"
    assert q_end < 0.85 * q_start
    print(f"loss {q_start:.3f} -> {q_end:.3f}; baseline {start:.3f} -> {baseline_end:.3f}")
    assert abs(q_end - baseline_end) < 0.05 * baseline_end, (q_end, baseline_end)
    return report, trained


@pytest.mark.parametrize("recipe", ["mxfp8_fwd_nvfp4_bwd", "float8_current", "nvfp4"])
def test_transformer_encoder_layers_train_with_every_projection_quantized(recipe):
    torch.manual_seed(0)
    model = TinyLM(len(VOCABULARY), 64, 2, 4, 32)
    with qtensor.fallbacks("raise"):
        report, _ = assert_trains_like_baseline(model, getattr(qtensor.recipes, recipe)())
    projections = ("self_attn.in_proj", "self_attn.out_proj", "linear1", "linear2")
    expected = {f"blocks.layers.{i}.{name}" for i in range(2) for name in projections}
    assert set(report.quantized) == expected | {"head"}
    assert set(report.skipped) == {"embed", "position"}
    assert "embedding table" in report.skipped["embed"] and "not a layer's weight" in report.skipped["position"]


def test_transformer_trains_with_quantized_weights_and_master_weights():
    torch.manual_seed(0)
    model = TinyLM(len(VOCABULARY), 64, 2, 4, 32)
    _, trained = assert_trains_like_baseline(model, qtensor.recipes.mxfp8(), weights="quantized")
    assert isinstance(trained.blocks.layers[0].linear1.weight, qtensor.MXFP8Tensor)


@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_backward_overrides_train(override):
    torch.manual_seed(0)
    model = TinyLM(len(VOCABULARY), 64, 2, 4, 32)
    assert_trains_like_baseline(model, qtensor.Recipe(qtensor.recipes.mxfp8_fwd_nvfp4_bwd(), backward_override=override))


def test_hugging_face_llama_trains_with_every_projection_quantized():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    report, trained = assert_trains_like_baseline(model, qtensor.recipes.mxfp8_fwd_nvfp4_bwd())
    projections = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    expected = {f"model.layers.{i}.{p}" for i in range(2) for p in projections} | {"lm_head"}
    assert set(report.quantized) == expected
    assert set(report.skipped) == {"model.embed_tokens"}
    assert isinstance(trained.model.layers[1].mlp.down_proj.weight, qtensor.DynamicWeight)


def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=len(VOCABULARY), n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("recipe", ["mxfp8", "float8_current", "mxfp8_fwd_nvfp4_bwd"])
def test_hugging_face_gpt2_conv1d_layers_train_quantized(recipe):
    model = tiny_gpt2()
    with qtensor.fallbacks("raise"):
        report, trained = assert_trains_like_baseline(model, getattr(qtensor.recipes, recipe)(), steps=80)
    projections = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert set(report.quantized) == {f"transformer.h.{i}.{p}" for i in range(2) for p in projections}
    # The head shares the token embedding's matrix: it stays in high precision, and says why.
    assert set(report.skipped) == {"lm_head", "transformer.wte", "transformer.wpe"}
    assert "tied to transformer.wte.weight" in report.skipped["lm_head"]
    assert isinstance(trained.transformer.h[0].attn.c_attn.weight, qtensor.DynamicWeight)
