"""safetensors checkpoints (docs/checkpoints.md, docs/checkpoint-format.md): round trips, file contents, bad files, models.

Round trips are checked byte for byte against the tensor that was saved, and the file's contents
are read back with plain `safetensors.safe_open` (not qtensor's loader): the file must hold the
low-precision buffers themselves, readable by any safetensors reader.
"""

import copy
import json
import os
import pickle
import struct
import sys

import pytest
import torch
from safetensors import safe_open
from torch import nn

import qtensor

QUANTIZERS = {
    "float8_current": lambda: qtensor.Float8Quantizer(),
    "float8_delayed_e5m2": lambda: qtensor.Float8Quantizer(torch.float8_e5m2, scaling="delayed", amax_history_len=4),
    "mxfp8": lambda: qtensor.MXFP8Quantizer(),
    "mxfp8_floor_e5m2": lambda: qtensor.MXFP8Quantizer(torch.float8_e5m2, scale_rounding="floor"),
    "nvfp4": lambda: qtensor.NVFP4Quantizer(),
    "nvfp4_rht": lambda: qtensor.NVFP4Quantizer(rht=True),
    "nvfp4_2d": lambda: qtensor.NVFP4Quantizer(block_2d=True),
    "nvfp4_sr": lambda: qtensor.NVFP4Quantizer(stochastic_rounding=True, seed=3),
    "identity": lambda: qtensor.IdentityQuantizer(),
    "identity_bf16": lambda: qtensor.IdentityQuantizer(torch.bfloat16),
    "hybrid_mxfp8_nvfp4": lambda: qtensor.HybridQuantizer(qtensor.MXFP8Quantizer(), qtensor.NVFP4Quantizer(rht=True)),
    "hybrid_float8_nvfp4": lambda: qtensor.HybridQuantizer(qtensor.Float8Quantizer(), qtensor.NVFP4Quantizer()),
    "hybrid_nvfp4_mxfp8": lambda: qtensor.HybridQuantizer(qtensor.NVFP4Quantizer(), qtensor.MXFP8Quantizer()),
    "hybrid_two_delayed": lambda: qtensor.HybridQuantizer(
        qtensor.Float8Quantizer(scaling="delayed", amax_history_len=3), qtensor.Float8Quantizer(scaling="delayed", amax_history_len=5)
    ),
    "hybrid_identity_mxfp8": lambda: qtensor.HybridQuantizer(qtensor.IdentityQuantizer(), qtensor.MXFP8Quantizer()),
    "hybrid_from_rowwise": lambda: qtensor.HybridQuantizer(
        qtensor.MXFP8Quantizer(), qtensor.NVFP4Quantizer(), columnwise_source="rowwise_dequantized"
    ),
}
USAGES = {"both": (True, True), "rowwise": (True, False), "columnwise": (False, True)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def sample(*shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * 3).to(dtype)


def quantized(name, usage="both", dtype=torch.bfloat16, shape=(3, 20, 45)):
    """A tensor of `name`'s format; delayed scaling gets two casts first so its history is non-trivial."""
    quantizer = QUANTIZERS[name]()
    rowwise, columnwise = USAGES[usage]
    for seed in range(3):
        q = quantizer.quantize(sample(*shape, dtype=dtype, seed=seed), rowwise=rowwise, columnwise=columnwise)
    return q


def assert_same_tensor(loaded, original):
    """Same class, shape, dtype, quantizer configuration and running state, and the same bytes
    in every buffer, shared buffers still shared."""
    assert type(loaded) is type(original)
    assert loaded.shape == original.shape and loaded.dtype == original.dtype
    assert loaded.quantizer == original.quantizer and loaded.quantizer is not original.quantizer
    mine, metadata = loaded.to_buffers()
    theirs, original_metadata = original.to_buffers()
    assert metadata == original_metadata
    assert mine.keys() == theirs.keys()
    for name in theirs:
        assert mine[name].dtype == theirs[name].dtype and mine[name].shape == theirs[name].shape, name
        assert torch.equal(mine[name].reshape(-1).view(torch.uint8), theirs[name].reshape(-1).contiguous().view(torch.uint8)), name


def file_tensors(path):
    """Everything in the file, read with plain safetensors."""
    with safe_open(path, framework="pt") as file:
        return {name: file.get_tensor(name) for name in file.keys()}, file.metadata()


# ---- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_round_trip_is_byte_for_byte_and_the_file_holds_the_buffers(tmp_path, name, usage, dtype):
    original = quantized(name, usage, dtype)
    path = tmp_path / "t.safetensors"
    qtensor.save_file({"w": original, "bias": torch.arange(5.0)}, path)
    loaded = qtensor.load_file(path)
    assert_same_tensor(loaded["w"], original)
    assert torch.equal(loaded["bias"], torch.arange(5.0))
    # Independently of qtensor's loader: each buffer is a named tensor holding the original bytes.
    stored, metadata = file_tensors(path)
    buffers, _ = original.to_buffers()
    assert set(stored) == {f"w.{n}" for n in buffers} | {"bias"}
    for buffer_name, buffer in buffers.items():
        assert stored[f"w.{buffer_name}"].dtype == buffer.dtype
        assert torch.equal(stored[f"w.{buffer_name}"].reshape(-1).view(torch.uint8), buffer.reshape(-1).view(torch.uint8))
    assert json.loads(metadata["qtensor"])["tensors"]["w"]["tensor"] == type(original).__name__


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_split_pieces_are_saved_compactly_and_load_as_whole_tensors(tmp_path, name):
    whole = quantized(name, shape=(4, 16, 48))
    top, bottom = whole.split(2)  # 32 rows each: on every format's block boundary
    path = tmp_path / "pieces.safetensors"
    qtensor.save_file({"top": top, "bottom": bottom}, path)
    loaded = qtensor.load_file(path)
    for key, piece in (("top", top), ("bottom", bottom)):
        assert_same_tensor(loaded[key], piece)
        assert torch.equal(loaded[key].dequantize().nan_to_num(), whole.dequantize()[:2 if key == "top" else 4][-2:].nan_to_num())
        # A loaded piece stands alone: it is not a slice of anything, so it may be requantized.
        loaded[key].copy_(sample(2, 16, 48))
    stored, _ = file_tensors(path)
    piece_bytes = sum(t.numel() * t.element_size() for n, t in stored.items() if n.startswith("top."))
    assert piece_bytes == top.storage_nbytes() + sum(b.nbytes for b in top.quantizer.state_buffers().values())


def test_a_tensor_holding_both_directions_stores_a_shared_scale_once(tmp_path):
    q = qtensor.Float8Quantizer().quantize(sample(8, 8))
    buffers, metadata = q.to_buffers()
    assert set(buffers) == {"rowwise.data", "columnwise.data", "scale_inv"} and metadata["shared"] == ["scale_inv"]
    # Plain safetensors takes the buffers as they are: no two of them share memory.
    from safetensors.torch import load_file as plain_load_file
    from safetensors.torch import save_file as plain_save_file

    plain_save_file({n: b.contiguous() for n, b in buffers.items()}, tmp_path / "raw.safetensors")
    assert torch.equal(plain_load_file(tmp_path / "raw.safetensors")["scale_inv"], q.rowwise.scale_inv)
    rht = qtensor.NVFP4Quantizer(rht=True).quantize(sample(32, 32))
    assert rht.to_buffers()[1]["shared"] == []  # the transformed copy has its own amax
    assert qtensor.NVFP4Quantizer().quantize(sample(32, 32)).to_buffers()[1]["shared"] == ["global_amax"]


def test_nvfp4_rowwise_weight_is_stored_in_low_precision_bytes(tmp_path):
    weight = qtensor.NVFP4Quantizer().quantize(sample(1024, 1024, dtype=torch.bfloat16), columnwise=False)
    path = tmp_path / "w.safetensors"
    qtensor.save_file({"weight": weight}, path)
    # 1024*1024/2 packed bytes + 1024*64 E4M3 scales + one fp32 amax, plus the header
    assert os.path.getsize(path) < 0.6 * 2**20
    stored, _ = file_tensors(path)
    assert stored["weight.rowwise.data"].dtype == torch.uint8 and stored["weight.rowwise.data"].shape == (1024, 512)
    assert stored["weight.rowwise.scale_inv"].dtype == torch.float8_e4m3fn and stored["weight.rowwise.scale_inv"].shape == (1024, 64)


def test_plain_tensors_round_trip_and_user_metadata_is_kept(tmp_path):
    tensors = {"a": sample(3, 4), "b": torch.arange(6, dtype=torch.int64)}
    qtensor.save_file(tensors, tmp_path / "p.safetensors", metadata={"step": "7"})
    loaded = qtensor.load_file(tmp_path / "p.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert file_tensors(tmp_path / "p.safetensors")[1]["step"] == "7"
    with pytest.raises(ValueError, match="reserved"):
        qtensor.save_file(tensors, tmp_path / "x.safetensors", metadata={"qtensor": "{}"})


def test_a_plain_name_inside_a_quantized_tensors_namespace_is_refused(tmp_path):
    with pytest.raises(ValueError, match="collide"):
        qtensor.save_file({"w": quantized("mxfp8"), "w.rowwise.data": torch.zeros(1)}, tmp_path / "c.safetensors")


# ---- bad files -----------------------------------------------------------------------------------
def saved(tmp_path, name="hybrid_two_delayed"):
    path = tmp_path / "good.safetensors"
    qtensor.save_file({"layer.weight": quantized(name), "layer.bias": torch.ones(4)}, path)
    return path


def split_file(path):
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def rewrite(path, header, data, out):
    text = json.dumps(header).encode()
    out.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return out


def with_description(tmp_path, mutate):
    """The good file with its qtensor description changed by `mutate(description)`."""
    header, data = split_file(saved(tmp_path))
    description = json.loads(header["__metadata__"]["qtensor"])
    mutate(description)
    header["__metadata__"]["qtensor"] = json.dumps(description)
    return rewrite(tmp_path / "bad.safetensors", header, data, tmp_path / "bad.safetensors")


@pytest.mark.parametrize("cut", [0, 5, 8, 40, -1, -100])
def test_a_truncated_file_is_a_value_error(tmp_path, cut):
    raw = saved(tmp_path).read_bytes()
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(raw[:cut] if cut >= 0 else raw[:cut])
    with pytest.raises(ValueError, match="truncated|too short|not valid JSON|not a safetensors"):
        qtensor.load_file(bad)


def test_a_file_cut_inside_the_data_names_the_tensor_that_runs_past_the_end(tmp_path):
    header, data = split_file(saved(tmp_path))
    last = max(header, key=lambda n: header[n]["data_offsets"][1] if n != "__metadata__" else -1)
    bad = rewrite(tmp_path, header, data[:-3], tmp_path / "short.safetensors")
    with pytest.raises(ValueError, match=f"{last}.*truncated"):
        qtensor.load_file(bad)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["tensors"]["layer.weight"].update(shape=[3, 20, 44]), "layer.weight.*expected"),
        (lambda d: d["tensors"]["layer.weight"].update(shape=[3, -20, 45]), "layer.weight.shape"),
        (lambda d: d["tensors"]["layer.weight"].update(dtype="int64"), "layer.weight.dtype"),
        (lambda d: d["tensors"]["layer.weight"].update(tensor="MXFP8Tensor"), "layer.weight.tensor"),
        (lambda d: d["tensors"]["layer.weight"].update(columnwise=None), "layer.weight.*unexpected"),
        (lambda d: d["tensors"]["layer.weight"].update(shared=["scale_inv"]), "layer.weight.*missing \\['scale_inv'\\]"),
        (lambda d: d["tensors"]["layer.weight"]["rowwise"].update(fp8_dtype={"dtype": "float32"}), "fp8_dtype"),
        (lambda d: d["tensors"]["layer.weight"]["quantizer"]["config"]["rowwise"]["quantizer"]["config"].update(amax_history_len=9), "amax_history"),
        (lambda d: d["tensors"]["layer.weight"]["quantizer"]["config"].update(unknown_option=1), "unknown_option"),
        (lambda d: d["tensors"].update(ghost=d["tensors"]["layer.weight"]), "ghost"),
        (lambda d: d.update(version=99), "version"),
        (lambda d: d["tensors"]["layer.weight"].pop("dtype"), "layer.weight.metadata"),
    ],
    ids=["shape", "negative-size", "dtype", "class", "direction-dropped", "bogus-share", "option", "state-shape", "option-name", "ghost-tensor", "version", "missing-field"],
)
def test_metadata_that_disagrees_with_the_buffers_is_a_value_error_naming_the_key(tmp_path, mutate, message):
    bad = with_description(tmp_path, mutate)
    with pytest.raises(ValueError, match=message):
        qtensor.load_file(bad)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda h: h["layer.weight.rowwise.data"].update(dtype="U8"), "layer.weight.rowwise.data: expected float8_e4m3fn"),
        (lambda h: h["layer.weight.rowwise.data"].update(dtype="X9"), "unsupported dtype"),
        (lambda h: h["layer.bias"].update(shape=[5]), "layer.bias: data_offsets"),
        (lambda h: h["layer.bias"].update(data_offsets=[n + 1 for n in h["layer.bias"]["data_offsets"]]), "overlapping|gapped|truncated"),
        (lambda h: h.update({"layer.weight.rowwise.extra": h.pop("layer.bias")}), "unexpected"),
    ],
    ids=["buffer-dtype", "unknown-dtype", "shape-vs-bytes", "overlap", "stray-buffer"],
)
def test_a_corrupted_header_is_a_value_error_naming_the_key(tmp_path, mutate, message):
    header, data = split_file(saved(tmp_path))
    mutate(header)
    with pytest.raises(ValueError, match=message):
        qtensor.load_file(rewrite(tmp_path, header, data, tmp_path / "bad.safetensors"))


def test_garbage_in_the_header_is_a_value_error(tmp_path):
    raw = bytearray(saved(tmp_path).read_bytes())
    raw[12:20] = b"\xff\x00{}[]\x01\x02"
    bad = tmp_path / "garbage.safetensors"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="JSON"):
        qtensor.load_file(bad)


def _strings(value, path=()):
    """Every string in a JSON value (keys and values), with how to reach it."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield path + (("key", key),), key
            yield from _strings(item, path + (("item", key),))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _strings(item, path + (("item", index),))
    elif isinstance(value, str):
        yield path, value


def _replace(value, path, new):
    (kind, step), rest = path[0], path[1:]
    if kind == "key" and not rest:
        value[new] = value.pop(step)
    elif rest:
        _replace(value[step], rest, new)
    else:
        value[step] = new


def test_a_hostile_file_naming_callables_is_rejected_and_imports_nothing(tmp_path, monkeypatch):
    """Every string of the description replaced, one at a time, by a dotted path to a callable in a
    module whose import would leave a mark: each load is a ValueError and the module is never imported."""
    marker = tmp_path / "imported"
    (tmp_path / "qtensor_hostile_probe.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef boom(*a, **k):\n    raise SystemExit\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    header, data = split_file(saved(tmp_path, "hybrid_mxfp8_nvfp4"))
    description = json.loads(header["__metadata__"]["qtensor"])
    strings = list(_strings(description["tensors"]))
    assert len(strings) > 40
    hostile = "qtensor_hostile_probe.boom"
    for path, _ in strings:
        changed = copy.deepcopy(description)
        _replace(changed["tensors"], path, hostile)
        header["__metadata__"]["qtensor"] = json.dumps(changed)
        bad = rewrite(tmp_path, header, data, tmp_path / "hostile.safetensors")
        with pytest.raises(ValueError):
            qtensor.load_file(bad)
    everything = copy.deepcopy(description)
    for path, _ in _strings(everything["tensors"]):
        if path[-1][0] == "item":  # every value at once (keys stay, so each path still leads somewhere)
            _replace(everything["tensors"], path, hostile)
    header["__metadata__"]["qtensor"] = json.dumps(everything)
    with pytest.raises(ValueError):
        qtensor.load_file(rewrite(tmp_path, header, data, tmp_path / "hostile.safetensors"))
    assert not marker.exists() and "qtensor_hostile_probe" not in sys.modules


# ---- models --------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.embed = nn.Embedding(16, width)
        self.up = nn.Linear(width, 64)
        self.down = nn.Linear(64, width)
        self.head = nn.Linear(width, 16, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models do

    def forward(self, tokens):
        hidden = self.embed(tokens)
        return self.head(hidden + self.down(torch.relu(self.up(hidden))))


def build(recipe, weights, seed=0, width=32):
    torch.manual_seed(seed)
    model = Block(width)
    qtensor.quantize_(model, recipe, weights=weights)
    return model


def train(model, steps, seed=1, optimizer=None):
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-2)
    if any(isinstance(p, qtensor.QuantizedTensor) for p in model.parameters()) and not isinstance(optimizer, qtensor.optim.MasterWeights):
        optimizer = qtensor.optim.MasterWeights(optimizer)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 16, (4, 8), generator=generator)
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, 16), tokens.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, optimizer


RECIPES = {
    "mxfp8": qtensor.recipes.mxfp8,
    "nvfp4": qtensor.recipes.nvfp4,
    "float8_delayed": qtensor.recipes.float8_delayed,
    "hybrid": qtensor.recipes.mxfp8_fwd_nvfp4_bwd,
    "float8_rowwise": qtensor.recipes.float8_rowwise,
    "float8_blockwise": qtensor.recipes.float8_blockwise,
}


@pytest.mark.parametrize("weights", ["quantized", "dynamic"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_load_model_restores_a_model_quantized_with_the_same_recipe_bitwise(tmp_path, recipe, weights):
    model = build(RECIPES[recipe](), weights)
    train(model, 3)
    qtensor.save_model(model, tmp_path / "model.safetensors")
    fresh = build(RECIPES[recipe](), weights, seed=5)
    assert qtensor.load_model(fresh, tmp_path / "model.safetensors") == ([], [])
    tokens = torch.randint(0, 16, (2, 8))
    with torch.no_grad():
        assert torch.equal(fresh(tokens), model(tokens))
    saved_state, loaded_state = model.state_dict(), fresh.state_dict()
    for key, value in saved_state.items():
        if isinstance(value, qtensor.QuantizedTensor):
            assert_same_tensor(loaded_state[key], value)
        else:
            assert torch.equal(loaded_state[key], value), key
    assert fresh.head.weight is fresh.embed.weight  # still tied


def test_tied_weights_are_saved_once(tmp_path):
    model = build(qtensor.recipes.mxfp8(), "quantized")
    qtensor.save_model(model, tmp_path / "model.safetensors")
    stored, metadata = file_tensors(tmp_path / "model.safetensors")
    assert "embed.weight" in stored and "head.weight" not in stored
    assert json.loads(metadata["qtensor"])["tied"] == {"head.weight": "embed.weight"}


def test_delayed_scaling_history_is_in_the_state_dict_and_a_resumed_run_continues_exactly(tmp_path):
    def run(resume):
        model = build(qtensor.recipes.float8_delayed(), "dynamic")
        _, optimizer = train(model, 3)
        if resume is not None:
            qtensor.save_model(model, tmp_path / "run.safetensors")
            optimizer_state = copy.deepcopy(optimizer.state_dict())
            model = build(qtensor.recipes.float8_delayed(), "dynamic", seed=9)
            if resume == "with_history":
                qtensor.load_model(model, tmp_path / "run.safetensors")
            else:  # what a checkpoint without the running state would give
                model.load_state_dict({k: v for k, v in qtensor.load_file(tmp_path / "run.safetensors").items() if "amax_history" not in k}, strict=False)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            optimizer.load_state_dict(optimizer_state)
        losses, _ = train(model, 3, seed=2, optimizer=optimizer)
        return losses, model

    uninterrupted, model = run(None)
    resumed, _ = run("with_history")
    assert "up.input_quantizer.amax_history" in model.state_dict()
    assert resumed == uninterrupted
    without_history, _ = run("without_history")
    assert without_history != uninterrupted  # the history matters: this test can fail


@pytest.mark.parametrize(
    "other, message",
    [
        (lambda: build(qtensor.recipes.nvfp4(), "quantized"), "up.weight.*NVFP4Tensor"),
        (lambda: build(qtensor.recipes.mxfp8(), "quantized", width=48), "shape"),
        (lambda: build(qtensor.recipes.mxfp8(), "dynamic"), "up.weight.*plain.*load_state_dict"),
    ],
    ids=["format", "shape", "plain-model"],
)
def test_a_mismatched_model_is_refused_naming_the_parameter_and_left_untouched(tmp_path, other, message):
    qtensor.save_model(build(qtensor.recipes.mxfp8(), "quantized"), tmp_path / "model.safetensors")
    model = other()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=message):
        qtensor.load_model(model, tmp_path / "model.safetensors")
    for key, value in model.state_dict().items():
        plain = value.dequantize() if isinstance(value, qtensor.QuantizedTensor) else value
        expected = before[key].dequantize() if isinstance(before[key], qtensor.QuantizedTensor) else before[key]
        assert torch.equal(plain, expected), key


def _same_state(model, before):
    for key, value in model.state_dict().items():
        plain = value.dequantize() if isinstance(value, qtensor.QuantizedTensor) else value
        expected = before[key].dequantize() if isinstance(before[key], qtensor.QuantizedTensor) else before[key]
        assert torch.equal(plain, expected), key


R = qtensor.recipes
LAYER_MISMATCHES = {  # saved recipe, weights, the loading model's recipe, what the message must say of up.weight
    "format": (lambda: R.float8_current(), "dynamic", lambda: R.nvfp4(), r"input: file float8, model nvfp4 rht; weight: file float8, model nvfp4 block_2d"),
    "margin": (lambda: R.float8_delayed(margin=2), "dynamic", lambda: R.float8_delayed(), r"input: file float8 scaling=delayed margin=2, model float8 scaling=delayed;"),
    "history-length": (
        lambda: R.float8_delayed(amax_history_len=8), "dynamic", lambda: R.float8_delayed(amax_history_len=16),
        r"input: file float8 scaling=delayed amax_history_len=8, model float8 scaling=delayed amax_history_len=16",
    ),
    "fast-accumulation": (lambda: R.float8_current(), "dynamic", lambda: R.float8_current(fprop_fast_accumulation=False), r"fprop_fast_accumulation: file True, model False"),
    "backward-override": (lambda: qtensor.Recipe(R.mxfp8(), backward_override="dequantized"), "dynamic", lambda: R.mxfp8(), r"backward_override: file 'dequantized', model None"),
    "backward-fast-accumulation": (
        lambda: qtensor.Recipe(R.float8_current(), backward_fast_accumulation=True), "quantized", lambda: R.float8_current(),
        r"backward_fast_accumulation: file True, model False",
    ),
    # a quantized weight's bytes and quantizer agree; the gradient's quantizer does not
    "gradient-quantized": (lambda: R.mxfp8(), "quantized", lambda: R.mxfp8(grad_fp8_dtype=torch.float8_e5m2), r"grad_output: file mxfp8, model mxfp8 e5m2\)"),
}


@pytest.mark.parametrize("case", list(LAYER_MISMATCHES))
def test_a_model_whose_layers_are_quantized_otherwise_is_refused_naming_the_layer_and_what_differs(tmp_path, case):
    """Every layer's recipe is in the file, for dynamic weights too (stored as plain values, which any
    recipe's model could take): loading into a model quantized otherwise raises before anything is
    written, naming the parameter, the file's and the model's settings, and what to do."""
    saved_recipe, weights, other_recipe, message = LAYER_MISMATCHES[case]
    model = build(saved_recipe(), weights)
    train(model, 2)
    qtensor.save_model(model, tmp_path / "model.safetensors")
    other = build(other_recipe(), weights, seed=3)
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=r"up\.weight: the file's layer was quantized otherwise than this model's \(.*" + message) as raised:
        qtensor.load_model(other, tmp_path / "model.safetensors")
    assert "Quantize the model as the file's was" in str(raised.value) and "Nothing was loaded" in str(raised.value)
    _same_state(other, before)
    # The shards of a writer that splits the state itself (save_pretrained, QTensorTrainer's resume) are checked alike.
    stored, metadata = qtensor.checkpoint.state_for_writer(model)
    from safetensors.torch import save_file as plain_save_file

    plain_save_file(stored, tmp_path / "writer.safetensors", metadata=metadata)
    with pytest.raises(ValueError, match=r"up\.weight: the file's layer was quantized otherwise"):
        qtensor.checkpoint.load_model_files(other, [tmp_path / "writer.safetensors"])
    _same_state(other, before)
    # The model quantized as the file's was loads it.
    same = build(saved_recipe(), weights, seed=3)
    assert qtensor.load_model(same, tmp_path / "model.safetensors") == ([], [])
    tokens = torch.randint(0, 16, (2, 8))
    with torch.no_grad():
        assert torch.equal(same(tokens), model(tokens))


def test_the_file_records_every_quantized_layers_configuration(tmp_path):
    """The `layers` field as docs/checkpoint-format.md specifies it, read with plain safetensors."""
    model = build(qtensor.recipes.float8_delayed(margin=2, amax_history_len=8), "dynamic")
    qtensor.save_model(model, tmp_path / "model.safetensors")
    _, metadata = file_tensors(tmp_path / "model.safetensors")
    layers = json.loads(metadata["qtensor"])["layers"]
    assert sorted(layers) == ["down.weight", "up.weight"]  # head is tied to embed: left in high precision
    delayed = {
        "scaling": "delayed", "margin": 2, "amax_history_len": 8, "amax_compute_algo": "max",
        "amax_epsilon": 0.0, "force_pow_2_scales": False,
    }
    assert layers["up.weight"] == {
        "input": {"format": "float8", "config": {"fp8_dtype": {"dtype": "float8_e4m3fn"}, **delayed}},
        "weight": {"format": "float8", "config": {"fp8_dtype": {"dtype": "float8_e4m3fn"}, **delayed}},
        "grad_output": {"format": "float8", "config": {"fp8_dtype": {"dtype": "float8_e5m2"}, **delayed}},
        "backward_override": None, "fprop_fast_accumulation": True, "backward_fast_accumulation": False, "weights": "dynamic",
    }
    quantized = build(qtensor.Recipe(qtensor.recipes.nvfp4(), backward_override="high_precision"), "quantized")
    qtensor.save_model(quantized, tmp_path / "quantized.safetensors")
    layer = json.loads(file_tensors(tmp_path / "quantized.safetensors")[1]["qtensor"])["layers"]["down.weight"]
    assert layer["weights"] == "quantized" and layer["backward_override"] == "high_precision"
    assert layer["weight"] == {"format": "nvfp4", "config": {"block_2d": True, "rht": False, "stochastic_rounding": False, "seed": None}}
    # A plain model's file records no layers (nor does save_file, which saves no model).
    qtensor.save_model(Block(), tmp_path / "plain.safetensors")
    assert "layers" not in json.loads(file_tensors(tmp_path / "plain.safetensors")[1]["qtensor"])


def test_what_the_layer_check_leaves_alone(tmp_path):
    """A layer quantized on one side only is not compared: a plain model takes a dynamic model's
    values, a quantized model a plain model's file, a model that keeps a layer in high precision the
    file's values of it; and a file written before files recorded their layers loads as it did."""
    model = build(qtensor.recipes.float8_current(), "dynamic")
    qtensor.save_model(model, tmp_path / "dynamic.safetensors")
    torch.manual_seed(7)
    plain = Block()
    assert qtensor.load_model(plain, tmp_path / "dynamic.safetensors") == ([], [])
    assert torch.equal(plain.up.weight, model.up.weight.plain())
    qtensor.save_model(plain, tmp_path / "plain.safetensors")
    for weights in ("dynamic", "quantized"):
        quantized = build(qtensor.recipes.nvfp4(), weights, seed=2)
        if weights == "dynamic":
            assert qtensor.load_model(quantized, tmp_path / "plain.safetensors") == ([], [])
            assert torch.equal(quantized.up.weight.plain(), plain.up.weight)
        else:  # as before: a quantized weight restores only quantized bytes
            with pytest.raises(ValueError, match="up.weight: the model holds NVFP4Tensor.*the file plain"):
                qtensor.load_model(quantized, tmp_path / "plain.safetensors")
    torch.manual_seed(0)
    partly = Block()
    qtensor.quantize_(partly, qtensor.recipes.float8_current(), exclude=["down"])
    assert qtensor.load_model(partly, tmp_path / "dynamic.safetensors") == ([], [])
    assert torch.equal(partly.down.weight, model.down.weight.plain())
    # The same file without its layers field (as files were written before it): not checked.
    header, data = split_file(tmp_path / "dynamic.safetensors")
    description = json.loads(header["__metadata__"]["qtensor"])
    del description["layers"]
    header["__metadata__"]["qtensor"] = json.dumps(description)
    older = rewrite(tmp_path, header, data, tmp_path / "older.safetensors")
    other = build(qtensor.recipes.nvfp4(), "dynamic", seed=2)
    assert qtensor.load_model(other, older) == ([], [])
    assert torch.equal(other.up.weight.plain(), model.up.weight.plain())
    with pytest.raises(ValueError, match="up.weight: the file's layer was quantized otherwise"):
        qtensor.load_model(build(qtensor.recipes.nvfp4(), "dynamic", seed=2), tmp_path / "dynamic.safetensors")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda layers: layers["up.weight"].pop("weights"), r"layers\['up.weight'\]: expected the fields"),
        (lambda layers: layers["up.weight"]["input"].update(format="qtensor_hostile_probe.boom"), "unknown qtensor quantizer format"),
        (lambda layers: layers["up.weight"]["input"]["config"].update(margin=-1), "margin"),
        (lambda layers: layers["up.weight"].update(backward_override="os.system"), "backward_override"),
        (lambda layers: layers["up.weight"].update(fprop_fast_accumulation="yes"), "true or false"),
        (lambda layers: layers.update({"up.weight": []}), "expected the fields"),
    ],
    ids=["missing-field", "unknown-format", "bad-option", "override", "flag", "not-an-object"],
)
def test_a_bad_layers_field_is_a_value_error_naming_the_layer(tmp_path, mutate, message):
    qtensor.save_model(build(qtensor.recipes.float8_delayed(), "dynamic"), tmp_path / "model.safetensors")
    header, data = split_file(tmp_path / "model.safetensors")
    description = json.loads(header["__metadata__"]["qtensor"])
    mutate(description["layers"])
    header["__metadata__"]["qtensor"] = json.dumps(description)
    bad = rewrite(tmp_path, header, data, tmp_path / "bad.safetensors")
    model = build(qtensor.recipes.float8_delayed(), "dynamic")
    with pytest.raises(ValueError, match=message):
        qtensor.load_model(model, bad)


def test_missing_and_unexpected_keys(tmp_path):
    model = build(qtensor.recipes.mxfp8(), "quantized")
    qtensor.save_model(model, tmp_path / "model.safetensors")
    bigger = build(qtensor.recipes.mxfp8(), "quantized")
    bigger.extra = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="missing keys.*extra.weight"):
        qtensor.load_model(bigger, tmp_path / "model.safetensors")
    missing, unexpected = qtensor.load_model(bigger, tmp_path / "model.safetensors", strict=False)
    assert missing == ["extra.weight", "extra.bias"] and unexpected == []


def test_a_plain_model_loads_the_dequantized_values(tmp_path):
    model = build(qtensor.recipes.mxfp8_fwd_nvfp4_bwd(), "quantized")
    qtensor.save_model(model, tmp_path / "model.safetensors")
    torch.manual_seed(3)
    plain = Block()
    plain.load_state_dict(qtensor.load_file(tmp_path / "model.safetensors"), strict=False)
    assert type(plain.up.weight.data) is torch.Tensor
    assert torch.equal(plain.up.weight, model.up.weight.dequantize())


def test_sharded_save_writes_an_index_and_loads_back(tmp_path):
    model = build(qtensor.recipes.nvfp4(), "quantized", width=64)
    path = tmp_path / "model.safetensors"
    qtensor.save_model(model, path, max_shard_size="4KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not path.exists()
    assert shards == sorted(p.name for p in tmp_path.glob("model-*-of-*.safetensors"))
    stored = {}
    for shard in shards:
        tensors, _ = file_tensors(tmp_path / shard)
        assert {index["weight_map"][n] for n in tensors} == {shard}
        stored.update(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    fresh = build(qtensor.recipes.nvfp4(), "quantized", seed=4, width=64)
    qtensor.load_model(fresh, path)
    tokens = torch.randint(0, 16, (2, 8))
    with torch.no_grad():
        assert torch.equal(fresh(tokens), model(tokens))
    # A later save with fewer shards, then an unsharded one, replaces the earlier files whole.
    qtensor.save_model(model, path, max_shard_size="10KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(p.name for p in tmp_path.glob("model-*")) != shards
    qtensor.save_model(model, path)
    assert path.exists() and not list(tmp_path.glob("model-*")) and not (tmp_path / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("size", [0, -1, "lots", "5XB", True])
def test_a_bad_shard_size_is_a_value_error(tmp_path, size):
    with pytest.raises(ValueError, match="max_shard_size"):
        qtensor.save_model(build(qtensor.recipes.mxfp8(), "dynamic"), tmp_path / "m.safetensors", max_shard_size=size)


def test_hugging_face_llama_trained_saved_and_reloaded_gives_identical_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )

    def llama(seed):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
        qtensor.quantize_(model, qtensor.recipes.mxfp8_fwd_nvfp4_bwd(), weights="quantized")
        return model

    model = llama(0)
    optimizer = qtensor.optim.MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    qtensor.save_model(model, tmp_path / "model.safetensors", max_shard_size="64KB")
    fresh = llama(1)
    qtensor.load_model(fresh, tmp_path / "model.safetensors")
    with torch.no_grad():
        assert torch.equal(fresh(tokens).logits, model(tokens).logits)
    # save_pretrained cannot write quantized weights; it says what to use instead.
    with pytest.raises(TypeError, match="qtensor.save_model"):
        model.save_pretrained(tmp_path / "hf")


def test_save_pretrained_of_a_dynamic_weight_model_loads_with_load_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    qtensor.quantize_(model, qtensor.recipes.float8_delayed())
    tokens = torch.randint(0, 64, (2, 16))
    model(tokens, labels=tokens).loss.backward()
    model.save_pretrained(tmp_path / "hf")
    torch.manual_seed(1)
    fresh = transformers.LlamaForCausalLM(config)
    qtensor.quantize_(fresh, qtensor.recipes.float8_delayed())
    qtensor.load_model(fresh, tmp_path / "hf" / "model.safetensors")
    with torch.no_grad():
        assert torch.equal(fresh(tokens).logits, model(tokens).logits)
    layer = "model.layers.0.mlp.up_proj"
    assert torch.equal(fresh.get_submodule(layer).weight.linear_quantizers.input.amax_history, model.get_submodule(layer).weight.linear_quantizers.input.amax_history)


# ---- pickling ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_plain_pickle_round_trips_every_type(name):
    original = quantized(name)
    assert_same_tensor(pickle.loads(pickle.dumps(original)), original)


def test_plain_pickle_round_trips_a_quantized_model():
    model = build(qtensor.recipes.float8_delayed(), "quantized")
    train(model, 2)
    loaded = pickle.loads(pickle.dumps(model))
    assert_same_tensor(loaded.up.weight, model.up.weight)
    assert torch.equal(loaded.up.weight.linear_quantizers.input.amax_history, model.up.weight.linear_quantizers.input.amax_history)
    tokens = torch.randint(0, 16, (2, 8))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))


def test_the_documented_format_decodes_a_file_without_qtensor(tmp_path):
    """docs/checkpoint-format.md's decoder (safetensors and torch only) reproduces dequantize()."""
    import pathlib
    import re

    doc = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "checkpoint-format.md").read_text()
    namespace = {}
    for block in re.findall(r"```python\n(.*?)```", doc, flags=re.S):
        exec(compile(block, "checkpoint-format.md", "exec"), namespace)
    x = sample(40, 70, dtype=torch.bfloat16) * 5
    tensors = {
        "float8": qtensor.Float8Quantizer().quantize(x),
        "mxfp8": qtensor.MXFP8Quantizer().quantize(x),
        "nvfp4": qtensor.NVFP4Quantizer().quantize(x),
        "nvfp4_rowwise_only": qtensor.NVFP4Quantizer().quantize(x, columnwise=False),
        "nvfp4_tiles": qtensor.NVFP4Quantizer(block_2d=True).quantize(x),
        "hybrid": qtensor.HybridQuantizer(qtensor.MXFP8Quantizer(), qtensor.NVFP4Quantizer()).quantize(x),
    }
    path = tmp_path / "doc.safetensors"
    qtensor.save_file(tensors, path)
    for key, q in tensors.items():
        assert torch.equal(namespace["decode_rowwise"](str(path), key), q.dequantize(torch.float32, "rowwise")), key


def test_a_state_dict_entry_is_a_load_target_that_takes_the_checkpoints_scale_row_range_by_row_range():
    """torch.distributed.checkpoint fills a state_dict entry chunk by chunk, each a row range of one
    saved tensor: the entry of a quantized weight takes the saved scale (docs/checkpoints.md), while
    the parameter itself still refuses bytes of another scale in a row slice."""
    model = nn.Sequential(nn.Linear(48, 64, bias=False))
    qtensor.quantize_(model, qtensor.recipes.float8_current(), weights="quantized")
    saved = qtensor.Float8Quantizer().quantize(torch.randn(64, 48) * 100)  # another scale than the model's
    entry = model.state_dict()["0.weight"]
    for start in (0, 32):  # as DCP copies the chunks of a checkpoint written by two ranks
        entry[start : start + 32].copy_(saved[start : start + 32])
    assert torch.equal(model[0].weight.rowwise.data.view(torch.uint8), saved.rowwise.data.view(torch.uint8))
    assert torch.equal(model[0].weight.rowwise.scale_inv, saved.rowwise.scale_inv)
    assert torch.equal(model[0].weight.dequantize(), saved.dequantize())
    other = qtensor.Float8Quantizer().quantize(torch.randn(64, 48))
    with pytest.raises(ValueError, match="row slice"):
        model[0].weight.detach()[:32].copy_(other[:32])
