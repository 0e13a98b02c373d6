"""Files written by earlier qtensor code still load, to the values that code computed.

tests/legacy/<commit>/ holds what tests/legacy/make_files.py wrote with the code of that commit (the
last one before the package's layout changed): whole-model pickles, a `weights_only` state_dict, a
`save_model` file, a torch.distributed.checkpoint directory and a `save_pretrained` directory, with
`expected.pt`, each model's output on a fixed input as the writing code computed it. Each is loaded
here into the code of today and must give that output exactly.
"""

import os
import pickle

import pytest
import torch

import qtensor
from legacy.make_files import CASES, model_of

LEGACY = os.path.join(os.path.dirname(__file__), "legacy")
FOLDERS = sorted(os.path.join(LEGACY, name) for name in os.listdir(LEGACY) if os.path.isfile(os.path.join(LEGACY, name, "expected.pt")))
PROBE = torch.randn(16, 64, generator=torch.Generator().manual_seed(7))


@pytest.fixture(params=FOLDERS, ids=os.path.basename)
def folder(request):
    return request.param


def expected(folder, name):
    return torch.load(os.path.join(folder, "expected.pt"))[name]


def output(model):
    with torch.no_grad():
        return model(PROBE)


def test_the_files_are_there():
    assert FOLDERS, "no tests/legacy/<commit>/expected.pt found"


@pytest.mark.parametrize("name", CASES)
def test_a_pickled_module_loads_and_computes_what_it_did(folder, name):
    loaded = torch.load(os.path.join(folder, f"{name}.module.pt"), weights_only=False)
    torch.testing.assert_close(output(loaded), expected(folder, name), rtol=0, atol=0)
    with open(os.path.join(folder, f"{name}.module.pickle"), "rb") as file:
        torch.testing.assert_close(output(pickle.load(file)), expected(folder, name), rtol=0, atol=0)


@pytest.mark.parametrize("name", CASES)
def test_a_saved_state_dict_loads_with_weights_only(folder, name):
    recipe, weights = CASES[name]
    model = model_of(recipe, weights)
    state = torch.load(os.path.join(folder, f"{name}.state_dict.pt"), weights_only=True)
    model.load_state_dict(state)
    torch.testing.assert_close(output(model), expected(folder, name), rtol=0, atol=0)


@pytest.mark.parametrize("name", CASES)
def test_a_save_model_file_loads(folder, name):
    recipe, weights = CASES[name]
    model = model_of(recipe, weights)
    qtensor.load_model(model, os.path.join(folder, f"{name}.safetensors"))
    torch.testing.assert_close(output(model), expected(folder, name), rtol=0, atol=0)


@pytest.mark.parametrize("name", CASES)
def test_a_distributed_checkpoint_loads(folder, name):
    import torch.distributed.checkpoint as dcp

    recipe, weights = CASES[name]
    model = model_of(recipe, weights)
    state = model.state_dict()
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(state, checkpoint_id=os.path.join(folder, f"{name}.dcp"))
    model.load_state_dict(state)
    torch.testing.assert_close(output(model), expected(folder, name), rtol=0, atol=0)


def test_a_save_pretrained_directory_loads(folder):
    transformers = pytest.importorskip("transformers")
    import qtensor.hf  # noqa: F401  (registers the quantization method with transformers)

    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(folder, "llama_mxfp8_quantized"))
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, qtensor.MXFP8Tensor)
    with torch.no_grad():
        logits = model(torch.arange(12).reshape(1, 12)).logits
    torch.testing.assert_close(logits, expected(folder, "llama_mxfp8_quantized"), rtol=0, atol=0)


def test_nvfp4_tiles_saved_with_a_scale_per_row_load_with_one_scale_per_tile(folder):
    """An NVFP4 weight cast in 16x16 tiles was written with each tile's scale repeated down its 16
    rows; it loads into today's layout, one scale per tile (the file's first row of each 16), with
    the file's codes, so a later save writes a sixteenth of the scale bytes."""
    from safetensors.torch import load_file

    path = os.path.join(folder, "nvfp4_quantized.safetensors")
    written = load_file(path)
    model = model_of(*CASES["nvfp4_quantized"])
    qtensor.load_model(model, path)
    for name in ("0.weight", "2.weight"):
        weight = model.get_parameter(name)
        for direction in ("rowwise", "columnwise"):
            storage, per_row = getattr(weight, direction), written[f"{name}.{direction}.scale_inv"].view(torch.uint8)
            assert per_row.shape[0] == storage.data.shape[0] and storage.tile_scales  # the file's: one row of scales per stored row
            assert torch.equal(storage.scale_inv.view(torch.uint8), per_row[::16])
            assert torch.equal(storage.data, written[f"{name}.{direction}.data"])
