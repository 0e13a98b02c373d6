"""`save_pretrained` of a model sharded by FSDP2 (docs/huggingface.md, docs/fsdp2.md): every rank calls
it, the shards are gathered (quantized weights as their bytes), rank 0 writes, and `from_pretrained`
in one process restores the model that the same training step gives unsharded: the same logits and
the same bytes. 2 gloo ranks (tests/hf_fsdp_case.py); `QTENSOR_TEST_DEVICE=cuda` runs the same worker
on 2 GPUs over NCCL, and there `QTensorTrainer.save_model` too (tests/hf_trainer_fsdp_case.py), which
accelerate shards only on GPUs."""

import os

import pytest
import torch

pytest.importorskip("transformers")
import workers  # noqa: E402

DEVICE = os.environ.get("QTENSOR_TEST_DEVICE", "cpu")


def same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _launched(tmp_path_factory, script: str):
    """Rank 0's results of `script` on 2 ranks."""
    out = tmp_path_factory.mktemp(script.removesuffix(".py")) / "results.pt"
    workers.launch(script, out, world=2)
    return torch.load(out)


RUN = workers.Background("results", workers.rank_commands("hf_fsdp_case.py", world=2), timeout=240)


@pytest.fixture(scope="module")
def results():
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    return torch.load(RUN.results() / "results.pt")


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_save_pretrained_of_an_fsdp2_model_loads_in_one_process_as_the_unsharded_model(results, weights):
    result = results[weights]
    sharded_loss, single_loss = result["losses"]
    assert sharded_loss == single_loss  # the sharded step is the one-process step
    # state_for_writer is a collective: rank 0 gets the whole model's tensors, the other rank none.
    assert result["counts"][0] > 0 and result["counts"][1] == 0
    assert "model.safetensors.index.json" in result["files"] and sum(f.endswith(".safetensors") for f in result["files"]) > 1
    loaded, reference = result["loaded"], result["reference"]
    assert loaded.keys() == reference.keys()
    differing = [name for name in reference if not same_bytes(loaded[name], reference[name])]
    assert not differing, differing
    held = "Float8TensorWeight" if weights == "quantized" else "DynamicWeight"
    assert result["types"]["model.layers.1.mlp.down_proj.weight"] == held and result["types"]["lm_head.weight"] == held
    assert torch.equal(result["logits"]["loaded"], result["logits"]["reference"])
    # The step changed every weight: a save of the initial ones would not pass.
    unchanged = [name for name in reference if same_bytes(result["initial"][name], reference[name])]
    assert not [name for name in unchanged if "norm" not in name], unchanged


@pytest.fixture(scope="module")
def trainer_results(tmp_path_factory):
    """QTensorTrainer.save_model under FSDP2 (tests/hf_trainer_fsdp_case.py): accelerate shards models on GPUs only."""
    if DEVICE != "cuda" or torch.cuda.device_count() < 2:
        pytest.skip("accelerate applies FSDP on GPUs only (on CPUs it runs DDP): needs QTENSOR_TEST_DEVICE=cuda and 2 GPUs")
    return _launched(tmp_path_factory, "hf_trainer_fsdp_case.py")


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_qtensor_trainer_save_model_of_an_fsdp2_model_loads_in_one_process(trainer_results, weights):
    """`train()` under accelerate's FSDP2 is refused with the reason; a model sharded and trained by
    hand saves through `save_model` on every rank, and loads with the trained values and logits."""
    result = trainer_results[weights]
    assert "data_ptr" in result["refused"] and "fully_shard" in result["refused"], result["refused"]
    assert {"config.json", "training_args.bin"} <= set(result["files"])  # Trainer's own save ran on rank 0
    held = "Float8TensorWeight" if weights == "quantized" else "DynamicWeight"
    assert result["types"]["model.layers.0.mlp.up_proj.weight"] == held
    loaded, reference = result["loaded"], result["reference"]
    assert loaded.keys() == reference.keys()
    differing = [name for name in loaded if not torch.equal(loaded[name], reference[name])]
    assert not differing, differing
    assert torch.equal(result["logits"]["loaded"], result["logits"]["sharded"])
