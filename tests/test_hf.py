"""qtensor.hf: from_pretrained with a QTensorConfig quantizes the loaded model as quantize_ does;
offline, on tiny models built from configs and saved to a temporary directory."""

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
import qtensor  # noqa: E402
import qtensor.hf  # noqa: E402
import workers  # noqa: E402
from qtensor.hf import QTensorConfig  # noqa: E402
from fresh import run_python  # noqa: E402

def _decoder(config_class, hidden=128, intermediate=256, **extra):
    """A tiny decoder-only config: two blocks, four heads, two KV heads."""
    return lambda: config_class(
        vocab_size=256, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, **extra,
    )


CONFIGS = {
    "llama": _decoder(transformers.LlamaConfig, tie_word_embeddings=False),
    "qwen2": _decoder(transformers.Qwen2Config, tie_word_embeddings=True),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=256, n_embd=128, n_layer=2, n_head=4, n_positions=64),
    "mistral": _decoder(transformers.MistralConfig, sliding_window=16),
    "mixtral": _decoder(transformers.MixtralConfig, num_local_experts=4, num_experts_per_tok=2),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(model name, a plain checkpoint directory) saved by save_pretrained."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, path


def _by_hand(path, recipe, weights, **options):
    """The model built from the same checkpoint without the config, then quantize_'d: the reference."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    report = qtensor.quantize_(model, getattr(qtensor.recipes, recipe)(), weights=weights, **options)
    return model, report


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("recipe", qtensor.hf.RECIPES)
def test_from_pretrained_quantizes_as_quantize_does(checkpoint, recipe, weights):
    name, path = checkpoint
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=QTensorConfig(recipe=recipe, weights=weights))
    expected, expected_report = _by_hand(path, recipe, weights)
    assert model.qtensor_report.quantized == expected_report.quantized and len(expected_report.quantized) > 0
    assert model.qtensor_report.skipped == expected_report.skipped  # tied embeddings and lm_head as quantize_ leaves them
    before, after = _bytes(expected), _bytes(model)  # quantized weights and running state (a delayed weight's first amax)
    assert before.keys() == after.keys() and all(torch.equal(before[name], after[name]) for name in before)
    tokens = torch.randint(256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, expected(tokens).logits)
    assert model.config.quantization_config.to_dict()["recipe"] == recipe


_PEAK_SCRIPT = """
import sys, threading, time, torch, transformers, qtensor, qtensor.hf

def anonymous_bytes():  # the process's anonymous resident memory (a loaded checkpoint's mmap'd pages are not)
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))

peak, done = [anonymous_bytes()], threading.Event()
start = peak[0]

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anonymous_bytes())
        time.sleep(0.0005)

sampler = threading.Thread(target=sample)
sampler.start()
config = qtensor.hf.QTensorConfig(recipe="nvfp4", weights="quantized")
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, quantization_config=config)
done.set()
sampler.join()
stored, _ = qtensor.checkpoint.state_for_writer(model)
print(peak[0] - start, sum(t.numel() * t.element_size() for t in stored.values()))
"""


def test_from_pretrained_never_holds_the_plain_model(tmp_path):
    """Quantized weights are cast one by one as they load: the peak stays below the bf16 model, which
    loading first and quantize_'ing after would hold whole (and then its quantized copy beside it).
    Above the quantized model the peak holds the loader's and the casts' temporaries and the
    allocator's retained heap: 32-42 MiB here, about a quarter of the bf16 model, whatever the format."""
    import os
    import subprocess
    import sys

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=512, intermediate_size=1408, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=64, tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)  # fp32, on disk; loaded as bf16 (anonymous memory)
    plain_bf16 = sum(p.numel() * 2 for p in model.parameters())
    model.save_pretrained(tmp_path)
    del model
    # Large allocations straight from mmap, so that a freed tensor leaves the resident set at once.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    peak, quantized = map(int, result.stdout.split()[-2:])
    assert quantized < 0.6 * plain_bf16  # NVFP4, both directions
    assert peak < 0.85 * plain_bf16, (peak / 2**20, quantized / 2**20, plain_bf16 / 2**20)


def test_mixtral_expert_stacks_are_quantized_on_load_as_quantize_would(tmp_path):
    """Mixtral's experts are fused [experts, rows, cols] parameters: loading with QTensorConfig
    quantizes each stack (its experts cast one by one) as quantize_ does on the plain model, and the
    router stays in high precision."""
    path = tmp_path / "mixtral"
    transformers.AutoModelForCausalLM.from_config(CONFIGS["mixtral"]()).save_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=QTensorConfig(recipe="mxfp8"))
    stacks = {f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")}
    assert stacks <= set(model.qtensor_report.quantized)
    assert all("a stack of 4 experts" in model.qtensor_report.quantized[name] for name in stacks)
    assert "router" in model.qtensor_report.skipped["model.layers.0.mlp.gate"]
    plain = transformers.AutoModelForCausalLM.from_pretrained(path)
    qtensor.quantize_(plain, qtensor.recipes.mxfp8(), strict=True)
    tokens = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(model(tokens).logits, plain(tokens).logits, rtol=0, atol=0)


def test_the_loaded_model_trains(checkpoint):
    _, path = checkpoint
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=QTensorConfig(recipe="float8_current"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(256, (4, 32), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(8):
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert model.hf_quantizer.is_trainable and model.hf_quantizer.is_qat_trainable  # what Trainer asks


def test_modules_to_not_convert_keeps_layers_in_high_precision(checkpoint):
    name, path = checkpoint
    keep = ["lm_head"] if name != "gpt2" else ["transformer.h.0.mlp"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=QTensorConfig(modules_to_not_convert=keep))
    _, expected = _by_hand(path, "float8_current", "dynamic", exclude=keep)
    assert model.qtensor_report.quantized == expected.quantized


def test_recipe_options_reach_the_recipe_and_come_back_from_config_json():
    config = QTensorConfig(recipe="float8_delayed", recipe_options={"amax_history_len": 8, "fp8_dtype": torch.float8_e5m2})
    assert config.factory().options["amax_history_len"] == 8
    written = json.loads(json.dumps(config.to_dict()))  # what config.json holds
    assert written == {
        "quant_method": "qtensor", "recipe": "float8_delayed", "weights": "dynamic", "modules_to_not_convert": [],
        "recipe_options": {"amax_history_len": 8, "fp8_dtype": {"dtype": "float8_e5m2"}}, "strict": False,
    }
    again = QTensorConfig.from_dict(written)
    assert again.recipe_options == {"amax_history_len": 8, "fp8_dtype": torch.float8_e5m2}
    assert repr(again.factory()) == repr(config.factory())


@pytest.mark.parametrize("bad, message", [
    (dict(recipe="float8"), "unknown recipe"),
    (dict(weights="fp8"), "weights must be"),
    (dict(recipe="mxfp8", recipe_options={"no_such_option": 1}), "no_such_option"),
    (dict(recpie="nvfp4"), "unexpected keyword argument.*recpie"),
    (dict(recipe="nvfp4", strict="yes"), "strict must be True or False"),
])
def test_bad_configs_raise_when_made(bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        QTensorConfig(**bad)


def test_a_misspelt_option_in_config_json_raises_on_load():
    with pytest.raises(TypeError, match="unexpected keyword argument.*stirct"):
        QTensorConfig.from_dict({"quant_method": "qtensor", "recipe": "mxfp8", "stirct": True})


def test_strict_and_exclude_reach_quantize_(tmp_path):
    """`exclude` keeps a layer in high precision as modules_to_not_convert does, and config.json
    carries it; `strict=True` refuses a model one of whose linear layers cannot be quantized (an
    output head tied to the embedding table) where the default leaves it, reported, in high precision."""
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    keep = "model.layers.0.mlp.down_proj"
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=QTensorConfig(recipe="mxfp8", exclude=keep))
    assert keep in model.qtensor_report.skipped and "model.layers.0.mlp.up_proj" in model.qtensor_report.quantized
    assert "tied" in model.qtensor_report.skipped["lm_head"]
    assert model.config.quantization_config.to_dict()["modules_to_not_convert"] == [keep]
    with pytest.raises(ValueError, match="strict=True.*lm_head"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=QTensorConfig(recipe="mxfp8", strict=True))


def _bytes(model) -> dict:
    """Every state entry as its stored bytes (a quantized tensor as its buffers): what a round trip keeps."""
    stored, _ = qtensor.checkpoint.state_for_writer(model)
    return {name: tensor.contiguous().view(-1).view(torch.uint8) for name, tensor in stored.items()}


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("recipe", qtensor.hf.RECIPES)
def test_save_pretrained_and_from_pretrained_restore_the_quantized_model(checkpoint, recipe, weights, tmp_path):
    """save_pretrained writes qtensor's tensors (sharded with transformers' index when asked) and
    config.json the config; from_pretrained with no argument restores the same bytes and logits,
    after two training steps (delayed scaling's histories included)."""
    name, path = checkpoint
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=QTensorConfig(recipe=recipe, weights=weights))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    if weights == "quantized":
        optimizer = qtensor.optim.MasterWeights(optimizer)
    tokens = torch.randint(256, (2, 32), generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1, files
    saved_config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved_config["quant_method"] == "qtensor" and saved_config["recipe"] == recipe and saved_config["weights"] == weights

    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded.config.quantization_config, QTensorConfig)
    assert loaded.qtensor_report.quantized == model.qtensor_report.quantized
    before, after = _bytes(model), _bytes(loaded)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before), [n for n in before if not torch.equal(before[n], after[n])]
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, loaded(tokens).logits)


def test_a_custom_factory_is_refused_by_save_pretrained_by_name(checkpoint, tmp_path):
    _, path = checkpoint
    factory = qtensor.recipes.float8_current()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=QTensorConfig(recipe=factory))
    with pytest.raises(ValueError, match="ready recipe's name"):
        model.save_pretrained(tmp_path)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.tokens = torch.randint(256, (64, 32), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_trainer_trains_and_resumes_exactly(weights, tmp_path):
    """QTensorTrainer: gradient accumulation, MasterWeights for quantized weights, and a run resumed
    from its step-3 checkpoint ends on the same losses and the same bytes as the run that went on."""
    torch.manual_seed(0)
    path = tmp_path / "plain"
    transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]()).save_pretrained(path)

    def trainer(out):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=QTensorConfig(recipe="float8_delayed", weights=weights))
        args = transformers.TrainingArguments(
            out, max_steps=6, per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-3, save_steps=3,
            logging_steps=1, report_to=[], use_cpu=True, seed=0, data_seed=0, lr_scheduler_type="constant", disable_tqdm=True,
        )
        return qtensor.hf.QTensorTrainer(model=model, args=args, train_dataset=_Tokens())

    losses = lambda t: [entry["loss"] for entry in t.state.log_history if "loss" in entry]
    uninterrupted = trainer(tmp_path / "run")
    uninterrupted.train()
    if weights == "quantized":
        assert isinstance(uninterrupted.optimizer_unwrapped(), qtensor.optim.MasterWeights)
    resumed = trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert len(losses(uninterrupted)) == 6 and losses(resumed) == losses(uninterrupted)
    before, after = _bytes(uninterrupted.model), _bytes(resumed.model)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert any(before[name].any() for name in before if "amax_history" in name)  # delayed scaling recorded amaxes


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_export_writes_a_plain_checkpoint_transformers_loads_without_qtensor(checkpoint, weights, tmp_path):
    _, path = checkpoint
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=QTensorConfig(recipe="nvfp4", weights=weights))
    qtensor.hf.export(model, tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    assert model.hf_quantizer is not None and len(model.qtensor_report.quantized) > 0  # the model is left as it was
    # A fresh interpreter where qtensor cannot be imported loads it, every weight in bf16.
    script = (
        "import sys, torch, transformers; sys.modules['qtensor'] = None\n"
        f"m = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})\n"
        "torch.save({k: v for k, v in m.state_dict().items()}, sys.argv[1])"
    )
    out = tmp_path / "state.pt"
    done = run_python(script, str(out), preload=("torch", "transformers"))  # forked from a server without qtensor: fresh.py
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = torch.load(out)
    for name, value in model.state_dict().items():
        if name in loaded:
            plain = value.dequantize() if isinstance(value, qtensor.QuantizedTensor) else value.plain() if isinstance(value, qtensor.DynamicWeight) else value
            expected = plain.to(torch.bfloat16) if plain.is_floating_point() else plain
            module = model.get_submodule(name.rsplit(".", 1)[0])
            if type(module).__name__ == "Conv1D" and isinstance(value, qtensor.QuantizedTensor):
                expected = expected.t()  # a quantized Conv1D weight is held [out, in]; the checkpoint's is [in, out]
            assert torch.equal(loaded[name], expected), name
    quantized_weights = [name for name, p in model.named_parameters() if getattr(p, "linear_quantizers", None) is not None]
    assert len(quantized_weights) == len(model.qtensor_report.quantized)
    assert all(name in loaded and loaded[name].dtype == torch.bfloat16 for name in quantized_weights), quantized_weights


FP8_CONFIGS = {  # every projection whole 128x128 blocks (or a single partial one), as DeepSeek-V3's are
    "llama": _decoder(transformers.LlamaConfig, hidden=256, intermediate=512, tie_word_embeddings=False),
    "qwen2": _decoder(transformers.Qwen2Config, hidden=256, intermediate=512, tie_word_embeddings=True),
}
FP8_BLOCKS = {"float8_current": [128, 128], "float8_delayed": [128, 128], "float8_blockwise": [128, 128], "float8_rowwise": [1, 128]}


def _forward_weight(module) -> "qtensor.QuantizedTensor":
    """The quantized weight a layer's forward GEMM reads (a dynamic weight cast by its quantizer)."""
    weight = module.weight
    if isinstance(weight, qtensor.QuantizedTensor):
        return weight
    return module._qtensor_layers["weight"][0].weight.quantize(weight.plain().detach(), rowwise=True, columnwise=False)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("recipe", list(FP8_BLOCKS))
@pytest.mark.parametrize("name", list(FP8_CONFIGS))
def test_fp8_export_is_the_fine_grained_layout_transformers_loads(name, recipe, weights, tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(FP8_CONFIGS[name]()).save_pretrained(tmp_path / "plain")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", quantization_config=QTensorConfig(recipe=recipe, weights=weights))
    if weights == "dynamic" and recipe == "float8_delayed":  # one step, so that the histories hold amaxes
        tokens = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(4))
        model(tokens, labels=tokens).loss.backward()
    qtensor.hf.export(model, tmp_path / "fp8", fp8=True)

    written = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    block = FP8_BLOCKS[recipe]
    assert written["quant_method"] == "fp8" and written["weight_block_size"] == block
    assert sorted(written["modules_to_not_convert"]) == sorted(model.qtensor_report.skipped.keys() & {"lm_head"})
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    quantized = {layer: model.get_submodule(layer) for layer in model.qtensor_report.quantized}
    for layer, module in quantized.items():
        expected = _forward_weight(module)
        data, scale_inv = stored[f"{layer}.weight"], stored[f"{layer}.weight_scale_inv"]
        assert data.dtype == torch.float8_e4m3fn and torch.equal(data.view(torch.uint8), expected.rowwise.data.view(torch.uint8))
        # Each block's values times its scale are the quantized layer's values (fp32, as qtensor dequantizes).
        rows, cols = data.shape
        per_element = scale_inv.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
        assert torch.equal(data.float() * per_element, expected.dequantize().float()), layer

    # transformers' own loader reads it (on a CPU it dequantizes the FP8 weights to bf16).
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")
    for layer, module in quantized.items():
        assert torch.equal(loaded.get_submodule(layer).weight, _forward_weight(module).dequantize().to(torch.bfloat16)), layer


@pytest.mark.parametrize("case, message", [
    ("mxfp8", "its forward weight is mxfp8, not Float8"),
    ("e5m2", "the layout holds float8_e4m3fn"),
    ("gpt2", "Conv1D: transformers' FP8 loader converts nn.Linear layers only"),
    ("partial", "are not whole 128x128 blocks"),
])
def test_fp8_export_refuses_what_the_layout_cannot_hold_exactly(case, message, tmp_path):
    configs = {
        "gpt2": CONFIGS["gpt2"],
        "partial": _decoder(transformers.LlamaConfig, hidden=256, intermediate=320),
    }
    transformers.AutoModelForCausalLM.from_config(configs.get(case, FP8_CONFIGS["llama"])()).save_pretrained(tmp_path / "plain")
    config = {
        "mxfp8": QTensorConfig(recipe="mxfp8"),
        "e5m2": QTensorConfig(recipe="float8_current", recipe_options={"fp8_dtype": torch.float8_e5m2}),
    }.get(case, QTensorConfig(recipe="float8_current"))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", quantization_config=config)
    with pytest.raises(ValueError, match=message):
        qtensor.hf.export(model, tmp_path / "fp8", fp8=True)
    assert not (tmp_path / "fp8").exists()


def test_from_pretrained_with_a_device_map(checkpoint):
    """device_map makes transformers reserve memory for what the model's state_dict lists before
    loading: a quantized weight counts its own bytes, and the running state (quantize_'s, not the
    checkpoint's) is left out of that list until loaded."""
    _, path = checkpoint
    config = QTensorConfig(recipe="float8_delayed", weights="quantized")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, device_map="cpu", quantization_config=config)
    expected, _ = _by_hand(path, "float8_delayed", "quantized")
    before, after = _bytes(expected), _bytes(model)
    assert before.keys() == after.keys() and all(torch.equal(before[name], after[name]) for name in before)
    weight = next(p for p in model.parameters() if isinstance(p, qtensor.QuantizedTensor))
    size = model.hf_quantizer.param_element_size(model, "", weight)
    assert size == 2 + 4 / weight.numel()  # E4M3 both directions and one fp32 scale, not fp32's 4 bytes


_LOAD_IN_A_FRESH_INTERPRETER = """
import sys, torch
if sys.argv[1] == "import qtensor":
    import qtensor  # noqa: F401 (before transformers: registers when transformers is imported)
import transformers
for directory in sys.argv[2:]:
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    except Exception as error:
        print("raised", type(error).__name__, " ".join(str(error).split())[:400])
        continue
    weight = model.model.layers[0].mlp.down_proj.weight
    logits = model(torch.arange(32)[None]).logits
    plain = torch.load(directory + "/down_proj.pt")
    same_weight = type(weight) is torch.nn.Parameter and weight.shape == plain.shape and torch.equal(weight.detach(), plain)
    print("loaded", type(weight).__name__, torch.equal(logits, torch.load(directory + "/logits.pt")), same_weight)
"""


def _saved_directories(folder) -> None:
    """A plain checkpoint, and from_pretrained's MXFP8 model of it saved in each weight mode with
    its logits and one weight's values (what _LOAD_IN_A_FRESH_INTERPRETER compares)."""
    transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]()).save_pretrained(folder / "plain")
    for weights in ("dynamic", "quantized"):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder / "plain", quantization_config=QTensorConfig(recipe="mxfp8", weights=weights))
        model.save_pretrained(folder / weights)
        with torch.no_grad():
            torch.save(model(torch.arange(32)[None]).logits, folder / weights / "logits.pt")
        weight = model.model.layers[0].mlp.down_proj.weight
        plain = weight.plain() if weights == "dynamic" else weight.dequantize()
        torch.save(plain.detach().clone(), folder / weights / "down_proj.pt")


def _fresh_loads(folder) -> list:
    """Two fresh interpreters loading the saved directories, one after `import qtensor`, one without."""
    directories = [str(folder / weights) for weights in ("dynamic", "quantized")]
    return [([sys.executable, "-c", _LOAD_IN_A_FRESH_INTERPRETER, how, *directories], dict(os.environ), folder) for how in ("import qtensor", "nothing")]


FRESH_LOADS = workers.Background("fresh_loads", _fresh_loads, timeout=600, prepare=_saved_directories)


@pytest.fixture
def fresh_loads() -> list:
    """The two fresh interpreters' CompletedProcess (started early: workers.Background)."""
    return FRESH_LOADS.wait()


def test_import_qtensor_alone_loads_a_saved_model_and_without_it_a_quantized_one_fails_loudly(fresh_loads):
    """In a fresh interpreter, `import qtensor` (before transformers) is enough for from_pretrained
    to restore a save_pretrained directory, in both weight modes. With nothing of qtensor imported,
    transformers cannot know the method: a directory of quantized weights raises (its weights'
    entries do not fit the plain layers) instead of loading newly initialised weights, and one of
    dynamic weights loads their saved high-precision values."""
    with_qtensor, without = fresh_loads
    assert with_qtensor.returncode == 0, with_qtensor.stderr[-3000:]
    assert with_qtensor.stdout.split("\n")[:2] == ["loaded DynamicWeight True False", "loaded MXFP8TensorWeight True False"], with_qtensor.stdout
    assert without.returncode == 0, without.stderr[-3000:]
    dynamic, quantized = without.stdout.split("\n")[:2]
    assert dynamic.startswith("loaded Parameter") and dynamic.endswith(" True"), dynamic  # the saved values, not quantized
    assert quantized.startswith("raised RuntimeError") and "down_proj.weight" in without.stderr + quantized, (quantized, without.stderr[-2000:])


@pytest.mark.parametrize("how", ["qtensor.dequantize_", "model.dequantize"])
@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_a_dequantized_model_saves_and_loads_as_a_plain_one(weights, how, tmp_path):
    """After dequantize_ (or transformers' model.dequantize()) the model is plain: save_pretrained
    writes no qtensor config, and from_pretrained gives back plain layers with the same values."""
    transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]()).save_pretrained(tmp_path / "plain")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", quantization_config=QTensorConfig(recipe="mxfp8", weights=weights))
    qtensor.dequantize_(model) if how == "qtensor.dequantize_" else model.dequantize()
    model.save_pretrained(tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert not any(isinstance(p, qtensor.QuantizedTensor) or hasattr(p, "linear_quantizers") for p in loaded.parameters())
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, loaded.get_parameter(name)), name


@pytest.mark.parametrize("how", ["qtensor.dequantize_", "model.dequantize"])
def test_dequantize_gives_the_dtype_asked_for(how, tmp_path):
    """`dequantize_(model, dtype)` and transformers' `model.dequantize(dtype=...)` make the quantized
    layers' weights plain parameters of that dtype: a bf16 model's FP8 weights dequantized into
    float32 hold the exact products of codes and scales, not their bf16 roundings."""
    # Seeded: for some weights the scale's mantissa is short enough that every product
    # fits bf16, and the check below that the test can tell the roundings apart would not hold.
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]()).save_pretrained(tmp_path / "plain")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "plain", dtype=torch.bfloat16, quantization_config=QTensorConfig(recipe="float8_current", weights="quantized"),
    )
    weight = model.model.layers[0].mlp.down_proj.weight
    assert weight.dtype == torch.bfloat16
    # Each code times the scale, rounded once to float32 (the product is exact in float64).
    expected = (weight.rowwise.data.double() * weight.rowwise.scale_inv.double()).float()
    assert not torch.equal(expected, expected.bfloat16().float())  # the test can tell one rounding from two
    qtensor.dequantize_(model, torch.float32) if how == "qtensor.dequantize_" else model.dequantize(dtype=torch.float32)
    plain = model.model.layers[0].mlp.down_proj.weight
    assert type(plain) is torch.nn.Parameter and plain.dtype == torch.float32 and torch.equal(plain, expected)


def test_qtensor_trainer_refuses_to_train_under_accelerates_fsdp2(checkpoint, tmp_path):
    """accelerate's FSDP2 preparation maps optimizer parameters by data_ptr(), which qtensor's
    weights do not give: QTensorTrainer.train() says so instead of training the wrong tensors. (The
    plugin is set by hand: accelerate applies FSDP on GPUs only; tests/test_hf_fsdp.py runs it there.)"""
    _, path = checkpoint
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=QTensorConfig(recipe="float8_current"))
    args = transformers.TrainingArguments(tmp_path, max_steps=1, report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = qtensor.hf.QTensorTrainer(model=model, args=args, train_dataset=_Tokens())
    state, before = trainer.accelerator.state, getattr(trainer.accelerator.state, "fsdp_plugin", None)
    state.fsdp_plugin = type("Plugin", (), {"fsdp_version": 2})()
    try:
        with pytest.raises(ValueError, match="FSDP2.*data_ptr.*fully_shard"):
            trainer.train()
    finally:
        state.fsdp_plugin = before


_PROBE_THEN_IMPORT = """
import importlib.util, sys
import qtensor
assert "transformers" not in sys.modules  # import qtensor alone imports no transformers
assert importlib.util.find_spec("transformers") is not None  # a library probing for it
assert "transformers" not in sys.modules and "qtensor.hf" not in sys.modules
import transformers.quantizers.auto as auto
print("qtensor" in auto.AUTO_QUANTIZER_MAPPING, "qtensor" in auto.AUTO_QUANTIZATION_CONFIG_MAPPING)
"""


PROBE_THEN_IMPORT = workers.Background("probe_then_import", lambda folder: [([sys.executable, "-c", _PROBE_THEN_IMPORT], dict(os.environ))], timeout=600)


@pytest.fixture
def probe_then_import() -> subprocess.CompletedProcess:
    """_PROBE_THEN_IMPORT run in a fresh interpreter (started early: workers.Background)."""
    (done,) = PROBE_THEN_IMPORT.wait()
    return done


def test_a_probe_for_transformers_before_its_import_keeps_the_registration(probe_then_import):
    """Libraries probe with `importlib.util.find_spec("transformers")` before importing it: the
    probe must not use up the hook `import qtensor` leaves, so the later import still registers."""
    result = probe_then_import
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "True"], result.stdout


_QTENSOR_THEN_PEFT = """
import warnings
warnings.filterwarnings("error", message="qtensor could not register")  # a failed registration warns: fail the run
import qtensor
import peft  # imports transformers, which registers qtensor from inside peft's own import
import transformers.quantizers.auto as auto
from qtensor.hf import QTensorTrainer
print("qtensor" in auto.AUTO_QUANTIZER_MAPPING, "qtensor" in auto.AUTO_QUANTIZATION_CONFIG_MAPPING, QTensorTrainer.__module__ == "qtensor.hf_trainer")
"""


QTENSOR_THEN_PEFT = workers.Background("qtensor_then_peft", lambda folder: [([sys.executable, "-c", _QTENSOR_THEN_PEFT], dict(os.environ))], timeout=600)


@pytest.fixture
def qtensor_then_peft() -> subprocess.CompletedProcess:
    """_QTENSOR_THEN_PEFT run in a fresh interpreter (started early: workers.Background)."""
    pytest.importorskip("peft")
    (done,) = QTENSOR_THEN_PEFT.wait()
    return done


def test_import_qtensor_then_peft_registers_with_transformers(qtensor_then_peft):
    """The LoRA flow's imports, qtensor first: peft imports transformers, whose registration hook
    imports qtensor.hf while peft is half imported. qtensor.hf imports nothing that imports peft
    (its Trainer side loads at first use), so the registration holds and QTensorTrainer still
    imports."""
    result = qtensor_then_peft
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "True", "True"], result.stdout


@pytest.mark.parametrize("switch", [2, 3], ids=["checkpoint after the switch", "resumed across the switch"])
@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_a_precision_schedule_in_the_trainer_switches_at_the_global_step_and_resumes_exactly(weights, switch, tmp_path):
    """A model from_pretrained with a QTensorConfig (float8_current), its PrecisionSchedule (mxfp8
    from step 2 or 3) driven by PrecisionScheduleCallback: the layers are MXFP8 after training,
    and a run resumed from its step-2 checkpoint (saved after the switch at 2, in MXFP8; before
    the one at 3) ends on the same losses and bytes as the run that went on."""
    torch.manual_seed(0)
    path = tmp_path / "plain"
    transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]()).save_pretrained(path)

    def trainer(out):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=QTensorConfig(recipe="float8_current", weights=weights))
        schedule = qtensor.PrecisionSchedule(model, [qtensor.Phase(0, qtensor.recipes.float8_current()), qtensor.Phase(switch, qtensor.recipes.mxfp8())])
        args = transformers.TrainingArguments(
            out, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3, save_steps=2, logging_steps=1, report_to=[],
            use_cpu=True, seed=0, data_seed=0, lr_scheduler_type="constant", disable_tqdm=True,
        )
        callback = qtensor.hf.PrecisionScheduleCallback(schedule)
        return qtensor.hf.QTensorTrainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[callback]), schedule

    losses = lambda t: [entry["loss"] for entry in t.state.log_history if "loss" in entry]
    uninterrupted, schedule = trainer(tmp_path / "run")
    uninterrupted.train()
    assert [(s.step, s.phase) for s in schedule.switches] == [(switch, 1)]
    layer = uninterrupted.model.model.layers[0].mlp.up_proj.weight
    assert isinstance(layer.quantized(columnwise=False) if weights == "dynamic" else layer, qtensor.MXFP8Tensor)
    resumed, _ = trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert len(losses(uninterrupted)) == 4 and losses(resumed) == losses(uninterrupted)
    before, after = _bytes(uninterrupted.model), _bytes(resumed.model)
    assert before.keys() == after.keys() and all(torch.equal(before[name], after[name]) for name in before)
