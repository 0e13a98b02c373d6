"""Fine-tuning on a low-precision base: LoRA adapters (peft) over frozen quantized weights.

A frozen quantized weight costs only what it must: no weight-gradient GEMM runs, no columnwise
copy of the layer's input is cast or saved, and dgrad multiplies the gradient by the weight's own
columnwise copy. The peft flow: `from_pretrained(..., quantization_config=QTensorConfig(...,
weights="quantized"))`, `get_peft_model`, training, adapters saved and loaded by peft, and
`merge_and_unload` into the quantized base, whose merged weights are the format's cast of the
dequantized base plus the adapters' product (the oracle's)."""

import json
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
import oracle  # noqa: E402
import qtensor  # noqa: E402
import qtensor.hf  # noqa: E402
from qtensor.hf import QTensorConfig  # noqa: E402
from qtensor.layers import linear as linear_module  # noqa: E402
from test_hf import _Tokens  # noqa: E402 (its token ids fit the vocabulary below)

RECIPES = ["float8_current", "float8_rowwise", "mxfp8", "nvfp4", "nvfp4 weight-only"]
WEIGHTS = ["dynamic", "quantized"]


def ready_recipe(recipe: str):
    """A RECIPES entry's recipe: a ready recipe's name, "nvfp4 weight-only" for `nvfp4(weight_only=True)`."""
    name, _, variant = recipe.partition(" ")
    return getattr(qtensor.recipes, name)(**({"weight_only": True} if variant == "weight-only" else {}))


def frozen_layer(recipe, weights):
    torch.manual_seed(0)
    layer = nn.Linear(96, 64, bias=False)
    qtensor.quantize_(layer, ready_recipe(recipe), weights=weights)
    layer.weight.requires_grad_(False)
    return layer


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_frozen_quantized_weight_runs_no_wgrad_and_saves_no_input_copy(recipe, weights):
    """The input needs its gradient (an adapter below), the weight none: one fprop and one dgrad, no
    wgrad; the input is cast rowwise only; the only tensors saved for the backward are the weight's
    columnwise copy (a held weight's own bytes, nothing new; a dynamic weight's cast of it)."""
    layer = frozen_layer(recipe, weights)
    x = torch.randn(32, 96, requires_grad=True)
    calls = {name: mock.Mock(wraps=getattr(linear_module.gemm, name)) for name in ("fprop", "dgrad", "wgrad")}
    input_quantizer = layer.weight.linear_quantizers.input
    saved = []
    with mock.patch.multiple(linear_module.gemm, **calls), \
            mock.patch.object(input_quantizer, "quantize", wraps=input_quantizer.quantize) as input_casts:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = layer(x)
        y.sum().backward()
    assert [calls[name].call_count for name in ("fprop", "dgrad", "wgrad")] == [1, 1, 0]
    assert all(not call.kwargs.get("columnwise", True) for call in input_casts.call_args_list)
    assert x.grad is not None and layer.weight.grad is None
    own = {buffer.untyped_storage().data_ptr() for buffer in _buffers(layer.weight)}
    new_bytes = sum(t.numel() * t.element_size() for t in saved if t is not None and t.untyped_storage().data_ptr() not in own)
    weight_copy = sum(b.numel() * b.element_size() for b in _buffers(layer.weight, "columnwise"))
    assert new_bytes == (0 if weights == "quantized" else pytest.approx(weight_copy, rel=0.01, abs=64))


def _buffers(weight, direction=None):
    """A quantized weight's storage buffers (of `direction`, or both): a held weight's own."""
    if not hasattr(weight, "rowwise"):  # a dynamic weight: its cast's buffers, as the forward makes them
        weight = weight.linear_quantizers.weight.quantize(weight.detach(), rowwise=direction != "columnwise", columnwise=direction != "rowwise")
    storages = [getattr(weight, d) for d in ("rowwise", "columnwise") if d == direction or direction is None]
    return [b for storage in storages if storage is not None for b in storage.buffers.values()]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def lora_model(path, recipe, seed=0):
    """LoRA on every linear layer over a base loaded held quantized by `recipe` (a ready recipe's
    name; "nvfp4 weight-only": `nvfp4(weight_only=True)`, NVFP4 weights and bf16 activations)."""
    config = QTensorConfig(recipe=ready_recipe(recipe), weights="quantized")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    return peft.get_peft_model(model, config)


TOKENS = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(1))


def train_lora(model, steps: int, lr: float = 1e-2) -> list[float]:
    """`steps` AdamW steps on the adapters (the parameters needing a gradient) under bf16 autocast
    on TOKENS: the losses."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=TOKENS, labels=TOKENS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def base_bytes(model):
    return {name: b.clone() for name, module in model.named_modules() if isinstance(module, nn.Linear) and hasattr(module.weight, "rowwise")
            for name, b in ((f"{name}.{d}.{k}", v) for d in ("rowwise", "columnwise") if getattr(module.weight, d) is not None
                            for k, v in getattr(module.weight, d).buffers.items())}


@pytest.mark.parametrize("recipe", RECIPES)
def test_lora_trains_over_a_base_loaded_quantized_and_leaves_it_untouched(checkpoint, recipe):
    """The base loaded straight into low precision (no plain model held), every linear layer's LoRA
    adapters trained under bf16 autocast: the loss falls, only adapters get gradients, and the
    base's bytes are the same after the steps."""
    model = lora_model(checkpoint, recipe)
    before = base_bytes(model)
    assert len(before) > 0
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    losses = train_lora(model, 6)
    assert losses[-1] < losses[0] - 0.05
    after = base_bytes(model)
    assert all(torch.equal(before[name].reshape(-1).view(torch.uint8), after[name].reshape(-1).view(torch.uint8)) for name in before)


def test_an_nvfp4_weight_only_base_multiplies_bf16_activations_by_its_nvfp4_weights(checkpoint):
    """`nvfp4(weight_only=True)`, one copy kept: each frozen weight is the numpy oracle's NVFP4 cast
    of the checkpoint's (16x16 tiles), no activation or gradient is quantized, and a layer's output
    and dgrad under bf16 autocast are the fp64 products of the bf16 values with those weights (to
    bf16's rounding of the result)."""
    plain = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)  # the checkpoint's fp32 values, as the base is cast from
    model = lora_model(checkpoint, "nvfp4 weight-only")
    qtensor.keep_forward_copies_(model)
    layer = model.base_model.model.model.layers[0].mlp.down_proj.base_layer
    quantizers = layer.weight.linear_quantizers
    assert isinstance(quantizers.input, qtensor.IdentityQuantizer) and isinstance(quantizers.grad_output, qtensor.IdentityQuantizer)
    assert layer.weight.columnwise is None
    source = plain.model.layers[0].mlp.down_proj.weight.detach().float().numpy()
    expected = torch.from_numpy(np.asarray(oracle.nvfp4(source, "rowwise", block_2d=True).deq, dtype=np.float64))
    assert torch.equal(layer.weight.dequantize(torch.float64), expected)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 24, expected.shape[1], generator=generator).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(2, 24, expected.shape[0], generator=generator).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(grad)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), x.detach().double() @ expected.t(), rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), grad.double() @ expected, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("recipe, halves", [("float8_current", True), ("nvfp4", True), ("mxfp8", False)])
def test_keep_forward_copies_halves_a_frozen_base_and_trains_it_bit_for_bit_as_before(checkpoint, recipe, halves):
    """`qtensor.keep_forward_copies_` after `get_peft_model`: every frozen base weight whose format
    rebuilds dgrad's copy keeps the forward's only (half the bytes), the adapters untouched; LoRA
    then trains to the same losses and adapters, bit for bit, as over the base holding both copies.
    A format whose copies differ (MXFP8) keeps both and says so."""

    def train(model):
        torch.manual_seed(5)  # the gradients' stochastic rounding (nvfp4) draws the same in both runs
        losses = train_lora(model, 3)
        return losses, {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}

    both = lora_model(checkpoint, recipe)
    one = lora_model(checkpoint, recipe)
    weights = {name: p for name, p in one.named_parameters() if isinstance(p, qtensor.QuantizedTensor)}
    before = sum(p.storage_nbytes() for p in weights.values())
    kept = qtensor.keep_forward_copies_(one)
    assert set(kept) == set(weights)
    after = sum(p.storage_nbytes() for p in weights.values())
    if not halves:
        assert after == before and all(text.startswith("both copies") for text in kept.values())
        return
    assert after < 0.51 * before and all(p.columnwise is None for p in weights.values())
    assert set(qtensor.keep_forward_copies_(one).values()) == {"one copy already"}  # a second call: nothing left to drop
    (losses, adapters), (expected_losses, expected_adapters) = train(one), train(both)
    assert losses == expected_losses
    assert all(torch.equal(adapters[name], expected_adapters[name]) for name in expected_adapters)


def test_qtensor_trainer_keeps_one_copy_of_a_frozen_base_unless_told_not_to(checkpoint, tmp_path):
    """QTensorTrainer.train() over LoRA on a per-tensor FP8 base: every frozen base weight keeps the
    forward's copy only, and the run ends on the losses and adapters, bit for bit, of a run told to
    keep both copies (`keep_forward_copies=False`), whose weights keep both."""

    def run(out, keep):
        model = lora_model(checkpoint, "float8_current")
        args = transformers.TrainingArguments(
            out, max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1, report_to=[],
            use_cpu=True, seed=0, data_seed=0, lr_scheduler_type="constant", disable_tqdm=True, save_strategy="no",
        )
        trainer = qtensor.hf.QTensorTrainer(model=model, args=args, train_dataset=_Tokens(), keep_forward_copies=keep)
        trainer.train()
        weights = [p for p in model.parameters() if isinstance(p, qtensor.QuantizedTensor)]
        adapters = {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return trainer, weights, losses, adapters

    one, one_weights, losses, adapters = run(tmp_path / "one", True)
    both, both_weights, expected_losses, expected_adapters = run(tmp_path / "both", False)
    # the 14 block linears and the head, all frozen
    assert len(one.kept_copies) == len(one_weights) == 15
    assert all(text.startswith("the forward's copy") for text in one.kept_copies.values())
    assert all(p.columnwise is None for p in one_weights)
    assert both.kept_copies == {} and all(p.columnwise is not None for p in both_weights)
    assert len(losses) == 2 and losses == expected_losses
    assert all(torch.equal(adapters[name], expected_adapters[name]) for name in expected_adapters)


def test_peft_saves_the_adapters_and_loads_them_onto_a_quantized_base(checkpoint, tmp_path):
    """peft's own save_pretrained writes the adapters alone; PeftModel.from_pretrained over a fresh
    quantized base gives the same logits."""
    model = lora_model(checkpoint, "float8_rowwise")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        model(input_ids=TOKENS, labels=TOKENS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(tmp_path)
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=QTensorConfig(recipe="float8_rowwise", weights="quantized"))
    loaded = peft.PeftModel.from_pretrained(base, tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=TOKENS).logits, model(input_ids=TOKENS).logits)


@pytest.mark.parametrize("recipe", RECIPES)
def test_merging_the_adapters_recasts_each_weight_from_its_base_plus_the_product(checkpoint, recipe):
    """merge_and_unload into the quantized base: each merged layer holds the format's cast (the
    numpy oracle's) of its dequantized base weight plus the adapters' product, so the merged model
    is a quantized model again, its error from the exact sum one cast's."""
    model = lora_model(checkpoint, recipe)
    for name, module in model.named_modules():  # adapters away from zero, as training leaves them
        if isinstance(module, peft.tuners.lora.Linear):
            nn.init.normal_(module.lora_B["default"].weight, std=0.05)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, peft.tuners.lora.Linear)}
    exact = {name: (m.base_layer.weight.dequantize(torch.float32) + m.get_delta_weight("default").float()).detach() for name, m in layers.items()}
    merged = model.merge_and_unload()
    weight_oracle = _weight_oracle(recipe)
    for name, value in exact.items():
        weight = merged.get_submodule(name.removeprefix("base_model.model.")).weight
        assert hasattr(weight, "rowwise"), f"{name}: merged into a plain weight"
        np.testing.assert_array_equal(weight.dequantize(torch.float32).numpy(), weight_oracle(value.numpy()).astype(np.float32))


def _weight_oracle(recipe):
    """The numpy oracle's dequantized cast of a weight by `recipe`'s weight role (rowwise copy)."""
    if recipe == "float8_current":
        return lambda w: oracle.float8_current(w, "e4m3").deq
    if recipe == "float8_rowwise":
        return lambda w: oracle.float8_block(w, "rowwise", block_rows=1, block_cols=None, pow2_scales=True).deq
    if recipe == "mxfp8":
        return lambda w: oracle.mxfp8(w, "rowwise").deq
    return lambda w: oracle.nvfp4(w, "rowwise", block_2d=True).deq


@pytest.mark.parametrize("recipe", ["float8_rowwise", "float8_delayed"])
def test_qtensor_trainer_trains_a_peft_model_with_checkpointing_and_accumulation_and_resumes_exactly(checkpoint, recipe, tmp_path):
    """QTensorTrainer over LoRA on a quantized base: gradient checkpointing, two micro-batches a
    step; a run resumed from its step-2 checkpoint (peft's adapter files, and with delayed scaling
    the base's amax histories beside them) ends on the same losses and the same adapters as the
    run that went on, and the base is never written."""

    def trainer(out):
        model = lora_model(checkpoint, recipe)
        args = transformers.TrainingArguments(
            out, max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-2, save_steps=2,
            logging_steps=1, report_to=[], use_cpu=True, seed=0, data_seed=0, lr_scheduler_type="constant", disable_tqdm=True,
            gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        )
        return qtensor.hf.QTensorTrainer(model=model, args=args, train_dataset=_Tokens())

    losses = lambda t: [entry["loss"] for entry in t.state.log_history if "loss" in entry]
    uninterrupted = trainer(tmp_path / "run")
    before = base_bytes(uninterrupted.model)
    uninterrupted.train()
    assert (tmp_path / "run" / "checkpoint-2" / qtensor.hf.RUNNING_STATE_FILE).exists() == (recipe == "float8_delayed")
    resumed = trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert len(losses(uninterrupted)) == 4 and losses(resumed) == losses(uninterrupted)
    adapters = lambda t: {n: p.detach() for n, p in t.model.named_parameters() if "lora_" in n}
    assert all(torch.equal(p, adapters(resumed)[n]) for n, p in adapters(uninterrupted).items())
    after = base_bytes(uninterrupted.model)  # (a per-tensor FP8 base kept the forward's copy only: QTensorTrainer.train)
    assert after and set(after) <= set(before)
    assert all(torch.equal(before[n].reshape(-1).view(torch.uint8), after[n].reshape(-1).view(torch.uint8)) for n in after)


def test_a_precision_schedule_over_a_peft_model_resumes_across_a_switch_into_delayed_scaling(checkpoint, tmp_path):
    """LoRA over a dynamic base loaded as float8_current, whose schedule switches it to
    float8_delayed at step 2, under QTensorTrainer with PrecisionScheduleCallback: checkpoint-2,
    saved after the switch, holds the base's new amax histories; resuming from it moves the
    schedule to step 2 before they are loaded, and ends on the uninterrupted run's losses and
    adapters."""

    def trainer(out):
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=QTensorConfig(recipe="float8_current"))
        phases = [qtensor.Phase(0, qtensor.recipes.float8_current()), qtensor.Phase(2, qtensor.recipes.float8_delayed())]
        schedule = qtensor.PrecisionSchedule(model, phases)  # over the base, before peft wraps its layers
        torch.manual_seed(0)
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
        args = transformers.TrainingArguments(
            out, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, save_steps=2, logging_steps=1, report_to=[],
            use_cpu=True, seed=0, data_seed=0, lr_scheduler_type="constant", disable_tqdm=True,
        )
        callbacks = [qtensor.hf.PrecisionScheduleCallback(schedule)]
        return qtensor.hf.QTensorTrainer(model=model, args=args, train_dataset=_Tokens(), callbacks=callbacks), schedule

    losses = lambda t: [entry["loss"] for entry in t.state.log_history if "loss" in entry]
    uninterrupted, schedule = trainer(tmp_path / "run")
    uninterrupted.train()
    assert [(s.step, s.phase) for s in schedule.switches] == [(2, 1)]
    assert (tmp_path / "run" / "checkpoint-2" / qtensor.hf.RUNNING_STATE_FILE).exists()
    resumed, _ = trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert len(losses(uninterrupted)) == 4 and losses(resumed) == losses(uninterrupted)
    adapters = lambda t: {n: p.detach() for n, p in t.model.named_parameters() if "lora_" in n}
    assert all(torch.equal(p, adapters(resumed)[n]) for n, p in adapters(uninterrupted).items())


def test_resuming_a_peft_model_refuses_a_format_switch_of_its_frozen_held_base(checkpoint, tmp_path):
    """A frozen base held quantized has no masters to cast a new format from, so a schedule that
    switches its weights is refused while training; resuming such a schedule from a checkpoint
    (which holds the adapters, not the base) is refused the same way, not cast from the base's
    rounded values."""

    def trainer(out, phases=None):
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=QTensorConfig(recipe="float8_current", weights="quantized"))
        callbacks = [qtensor.hf.PrecisionScheduleCallback(qtensor.PrecisionSchedule(model, phases))] if phases else []
        torch.manual_seed(0)
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
        args = transformers.TrainingArguments(
            out, max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2, save_steps=2, logging_steps=1, report_to=[],
            use_cpu=True, seed=0, data_seed=0, lr_scheduler_type="constant", disable_tqdm=True,
        )
        return qtensor.hf.QTensorTrainer(model=model, args=args, train_dataset=_Tokens(), callbacks=callbacks)

    trainer(tmp_path / "run").train()
    phases = [qtensor.Phase(0, qtensor.recipes.float8_current()), qtensor.Phase(1, qtensor.recipes.mxfp8())]
    resumed = trainer(tmp_path / "resumed", phases)
    before = base_bytes(resumed.model)
    with pytest.raises(ValueError, match="master"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    after = base_bytes(resumed.model)
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


def _train_lora(model, steps=30):
    train_lora(model, steps, lr=3e-3)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=TOKENS, labels=TOKENS).loss.item()


def test_lora_on_every_quantized_base_ends_within_five_percent_of_bf16_lora(checkpoint):
    """The same adapters (same seed), the same steps: over each format's frozen base the final loss
    is within 5% of LoRA over the plain bf16 base."""
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    torch.manual_seed(0)
    reference = _train_lora(peft.get_peft_model(plain, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)))
    assert reference < np.log(256) - 0.5  # the adapters learnt (the untrained model's loss is about ln 256)
    finals = {recipe: _train_lora(lora_model(checkpoint, recipe)) for recipe in RECIPES}
    print({"bf16": reference, **finals})
    assert all(abs(final - reference) <= 0.05 * reference for final in finals.values()), finals


@pytest.mark.parametrize("recipe", ["float8_rowwise", "nvfp4"])
def test_merging_into_a_plain_base_for_serving(checkpoint, recipe, tmp_path):
    """For a plain (bf16) serving checkpoint: `qtensor.dequantize_` the peft model, then
    `merge_and_unload`: each weight is exactly its dequantized base plus the adapters' product, no
    second cast; `save_pretrained` writes a checkpoint transformers loads without qtensor's config."""
    model = lora_model(checkpoint, recipe)
    for module in model.modules():
        if isinstance(module, peft.tuners.lora.Linear):
            nn.init.normal_(module.lora_B["default"].weight, std=0.05)
    layers = {name.removeprefix("base_model.model."): m for name, m in model.named_modules() if isinstance(m, peft.tuners.lora.Linear)}
    exact = {name: (m.base_layer.weight.dequantize(torch.float32) + m.get_delta_weight("default").float()).detach() for name, m in layers.items()}
    qtensor.dequantize_(model)
    merged = model.merge_and_unload()
    for name, value in exact.items():
        weight = merged.get_submodule(name).weight
        assert type(weight) is nn.Parameter
        torch.testing.assert_close(weight.detach().float(), value, rtol=0, atol=1e-6)
    merged.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert getattr(again.config, "quantization_config", None) is None
    with torch.no_grad():
        assert torch.equal(again(input_ids=TOKENS).logits, merged(input_ids=TOKENS).logits)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16 export", "FP8 export"])
def test_a_model_merged_into_its_quantized_base_exports_for_serving(checkpoint, fp8, tmp_path):
    """`qtensor.hf.export` of a model merged into its quantized base: plain weights, or with
    `fp8=True` transformers' fine-grained FP8 layout; transformers loads either (on a CPU it
    dequantizes the FP8 weights to bf16), each weight the merged quantized weight's values."""
    model = lora_model(checkpoint, "float8_rowwise")
    for module in model.modules():
        if isinstance(module, peft.tuners.lora.Linear):
            nn.init.normal_(module.lora_B["default"].weight, std=0.05)
    merged = model.merge_and_unload()
    qtensor.hf.export(merged, tmp_path, fp8=fp8)
    written = json.loads((tmp_path / "config.json").read_text()).get("quantization_config")
    assert (written or {}).get("quant_method") == ("fp8" if fp8 else None)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, module in merged.named_modules():
        if isinstance(module, nn.Linear) and hasattr(module.weight, "rowwise"):
            expected = module.weight.dequantize(torch.float32).to(torch.bfloat16).float()
            assert torch.equal(loaded.get_submodule(name).weight.float(), expected), name


ONE_COPY = {  # recipe, and whether its weight's two copies hold the same values
    "float8_current": (qtensor.recipes.float8_current, True),
    "float8_blockwise": (qtensor.recipes.float8_blockwise, True),
    "nvfp4 16x16 tiles": (qtensor.recipes.nvfp4, True),
    "mxfp8": (qtensor.recipes.mxfp8, False),
    "nvfp4 1x16 blocks": (lambda: qtensor.recipes.nvfp4(weight_block_2d=False), False),
}


@pytest.mark.parametrize("rows", [128, 72])
@pytest.mark.parametrize("case", list(ONE_COPY))
def test_a_frozen_weight_holding_one_copy_rebuilds_dgrads_copy_at_each_backward(case, rows):
    """A frozen held weight can keep only the forward's copy (`update_usage(columnwise=False)`): half
    its bytes where the format's two copies hold the same values (per-tensor Float8: the transpose;
    128×128 FP8 blocks; NVFP4's 16×16 tiles, also where the tiles overrun the matrix), dgrad's copy
    then rebuilt for each backward, the same output and input gradient bit for bit as with the
    copy the cast made. A format whose copies differ says so at the forward."""
    recipe, rebuilds = ONE_COPY[case]
    torch.manual_seed(0)
    layer = nn.Linear(256 if rows == 128 else 200, rows, bias=False)
    qtensor.quantize_(layer, recipe(), weights="quantized")
    layer.weight.requires_grad_(False)
    x = torch.randn(32, layer.in_features, requires_grad=True)
    reference = layer(x)
    reference.sum().backward()
    expected, x.grad = x.grad.clone(), None
    both = layer.weight.storage_nbytes()
    if rebuilds:  # the rebuilt copy is the cast's, byte for byte
        rebuilt = layer.weight.quantizer.rebuild_direction(layer.weight.rowwise, "columnwise")
        for name, buffer in layer.weight.columnwise.buffers.items():
            assert torch.equal(rebuilt.buffers[name].reshape(-1).view(torch.uint8), buffer.reshape(-1).view(torch.uint8)), name
    layer.weight.update_usage(columnwise=False)
    if not rebuilds:
        with pytest.raises(ValueError, match="cannot rebuild it from the rowwise one"):
            layer(x)
        return
    assert layer.weight.storage_nbytes() <= 0.51 * both
    y = layer(x)
    y.sum().backward()
    assert torch.equal(y, reference) and torch.equal(x.grad, expected)
    assert layer.weight.columnwise is None  # the rebuilt copy lived for that backward only
