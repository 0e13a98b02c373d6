"""FSDP2 (fully_shard) over quantize_'d models: 2 gloo ranks on the CPU against one process.

One launch of two worker processes runs every scenario (fsdp_cases.py); the tests here compare
its results with the same scenarios run in this process.
"""

import ast
import os
import re
import subprocess
import sys

import pytest
import torch

import qtensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_cases  # noqa: E402
import workers  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _single_process_checkpoints(folder) -> dict:
    """One-process checkpoints for the workers to load into 2 ranks (1 -> 2); their logits."""
    import torch.distributed.checkpoint as dcp

    single_logits = {}
    for recipe, weights in fsdp_cases.DCP_CASES:
        model = fsdp_cases.build(recipe, weights, seed=3)
        fsdp_cases.train(model, weights)
        dcp.save(model.state_dict(), checkpoint_id=str(folder / f"dcp1_{recipe}_{weights}"), no_dist=True)
        single_logits[(recipe, weights)] = fsdp_cases.probe_logits(model)
    return single_logits


# The 2 ranks run every scenario once, one of the longest waits of the suite: they start while the
# tests before this module's run (workers.Background). On GPUs inductor compiles the compiled cases'
# blocks: the whole module took 258 s on 2 H200s, more than the CPU's 240 s bound.
RUN = workers.Background("distributed", workers.rank_commands("fsdp_cases.py", world=2),
                         timeout=600 if fsdp_cases.DEVICE == "cuda" else 240,
                         prepare=_single_process_checkpoints)


@pytest.fixture(scope="module")
def distributed():
    results = torch.load(RUN.results() / "results.pt", weights_only=False)
    results["folder"] = RUN.folder
    results["single_logits"] = RUN.prepared
    return results


@pytest.mark.parametrize("recipe, weights, reshard", fsdp_cases.SCENARIOS)
def test_sharded_training_equals_single_process_training(distributed, recipe, weights, reshard):
    sharded = distributed[(recipe, weights, reshard)]
    single = fsdp_cases.train(fsdp_cases.build(recipe, weights), weights)
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-6, atol=0)
    torch.testing.assert_close(sharded["logits"], single["logits"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("recipe, weights", fsdp_cases.COMPILED_CASES)
def test_compiled_blocks_shard_and_train_like_one_eager_process(distributed, recipe, weights):
    """torchtitan's order: quantize_, compile each block whole, fully_shard; against eager in one
    process. Each block is one graph with qtensor's FSDP2 hooks outside it and the casts and the
    quantized linears inside: no graph break, and the blocks share their graphs: one for training
    where the block's input needs a gradient, one where it does not (the first block), one for the
    evaluation forward under no_grad."""
    sharded = distributed[("compiled", recipe, weights)]
    assert "error" not in sharded, sharded["error"]
    assert sharded["graph_breaks"] == 0
    assert sharded["graphs"] == 3
    if "process_group_constants" in sharded:  # the graphs' code, recorded on the CPU (aot_eager)
        assert sharded["process_group_constants"] == 0
        if recipe == "float8_delayed":  # its backward reduces the step's amaxes over the ranks
            assert sharded["collectives"] > 0
    single = fsdp_cases.train(fsdp_cases.build(recipe, weights), weights)
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-6, atol=0)
    torch.testing.assert_close(sharded["logits"], single["logits"], rtol=1e-6, atol=1e-7)


# Per-tensor Float8: the columnwise copy is the rowwise one transposed (row-wise FP8's has its own scales).
PER_TENSOR = ("float8_current", "float8_delayed")


@pytest.mark.parametrize("recipe, weights, reshard", fsdp_cases.SCENARIOS)
def test_all_gathers_carry_low_precision_bytes_of_one_direction(distributed, recipe, weights, reshard):
    gathers = distributed[(recipe, weights, reshard)]["all_gathers"]
    assert gathers, "no quantized all-gather happened"
    limit = 0.3 if recipe == "nvfp4" else 0.55
    for gather in gathers:
        if gather["packed"]:
            continue  # uneven shards pack into the padded shard's shape (README: cost of uneven shards)
        # Without a re-gather (reshard_after_forward=False) one gather brings both GEMMs' directions.
        assert gather["bytes"] <= limit * gather["bf16_bytes"] * len(gather["directions"]), gather
        assert len(gather["directions"]) == (1 if reshard else 2) or recipe in PER_TENSOR, gather
    # Under training, a layer is gathered for the forward and again for the backward when resharded.
    directions = {tuple(g["directions"]) for g in gathers}
    if recipe in PER_TENSOR:
        assert directions == {("rowwise",)}  # the columnwise copy is the transpose, made locally
    elif reshard:
        assert directions == {("rowwise",), ("columnwise",)}
    else:
        assert directions == {("rowwise", "columnwise")}
    assert any(g["packed"] for g in gathers), "the 63-row head should shard unevenly"


def test_when_fsdp2_cannot_say_whether_it_regathers_the_forward_gather_brings_both_directions(distributed):
    """Pins the fallback of fsdp_state.regathers_before_backward: unknown is taken as "no re-gather"."""
    result = distributed["unknown_regather"]
    # Every forward gather (the ones carrying the rowwise copy) brings the backward's copy too; a
    # re-gather that FSDP2 does run before backward still carries only the backward's.
    forward = [g for g in result["all_gathers"] if "rowwise" in g["directions"]]
    assert forward and all(g["directions"] == ["rowwise", "columnwise"] for g in forward)
    expected = fsdp_cases.train(fsdp_cases.build("mxfp8", "dynamic"), "dynamic")
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected["losses"]), rtol=1e-6, atol=0)


def test_a_shard_that_cuts_a_block_raises_naming_the_parameter(distributed):
    message = distributed["block_error"]
    assert message is not None and "0.weight" in message and "32-row blocks" in message and "48" in message


def test_a_shard_that_cuts_a_block_of_a_quantized_weight_raises_naming_the_parameter(distributed):
    message = distributed[("block_error", "quantized")]
    assert message is not None, "sharding a 96-row MXFP8 weight into 48-row shards did not raise"
    assert "proj.weight" in message and "32" in message, message


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("recipe", fsdp_cases.RECIPES)
def test_evaluation_forwards_between_sharded_training_steps_change_nothing(distributed, recipe, weights):
    """Against the same loop in one process (evaluation forwards included): float8_delayed is the
    case where an evaluation forward could record into the histories on the ranks."""
    sharded = distributed[("evaluating", recipe, weights)]
    single = fsdp_cases.train(fsdp_cases.build(recipe, weights), weights, evaluate_between_steps=True)
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-6, atol=0)
    torch.testing.assert_close(sharded["logits"], single["logits"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_ranks_with_different_batches_hold_the_same_delayed_scaling_histories(distributed, weights):
    ranks = distributed[("own_batches", weights)]
    first, *others = ranks
    assert first["histories"], "no quantized layer was found on the sharded model"
    assert {role for _, role in first["histories"]} == {"input", "weight", "grad_output"}
    recorded = [key for key, history in first["histories"].items() if any(a != -1.0 for a in history)]
    assert len(recorded) == len(first["histories"]), "a history recorded nothing: the comparison would prove nothing"
    for rank, other in enumerate(others, start=1):
        assert other["histories"].keys() == first["histories"].keys()
        for key, history in first["histories"].items():
            assert other["histories"][key] == history, (rank, key)
        assert torch.equal(other["logits"], first["logits"]), rank


def test_under_ddp_the_amax_reduction_group_gives_every_rank_the_same_histories(distributed):
    first, *others = distributed["ddp_own_batches"]
    recorded = [key for key, history in first["histories"].items() if any(a != -1.0 for a in history)]
    assert recorded and len(recorded) == len(first["histories"])
    for other in others:
        assert other["histories"] == first["histories"]
        assert torch.equal(other["logits"], first["logits"])


@pytest.mark.parametrize("recipe, weights", [("float8_current", "quantized"), ("hybrid", "dynamic")])
def test_meta_device_init_then_fully_shard_trains_quantized(distributed, recipe, weights):
    result = distributed[("meta", recipe, weights)]
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    assert result["local_type"] == ("Float8Tensor" if weights == "quantized" else "DynamicWeight")
    if "scales" in result:  # shards initialised apart were brought to one scale before the first gather
        assert len(set(result["scales"])) == 1, result["scales"]


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("recipe", ["float8_delayed", "mxfp8", "nvfp4", "hybrid"])
def test_meta_device_init_on_one_process_equals_eager_init(recipe, weights, monkeypatch):
    monkeypatch.setattr(fsdp_cases, "DEVICE", "cpu")  # the CPU generator's draws, in both builds
    eager = fsdp_cases.build(recipe, weights)
    with torch.device("meta"):
        model = fsdp_cases.Net()
    qtensor.quantize_(model, fsdp_cases.RECIPES[recipe](), weights=weights)
    assert model(torch.randn(4, fsdp_cases.WIDTH, device="meta")).shape == (4, fsdp_cases.OUT)  # shapes propagate
    model.to_empty(device=fsdp_cases.device())
    torch.manual_seed(0)  # build() seeds 0 before constructing: the same draws, in the same order
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()
    for (name, mine), (_, theirs) in zip(model.state_dict().items(), eager.state_dict().items()):
        assert type(mine) is type(theirs), name
        plain = mine.dequantize() if isinstance(mine, qtensor.QuantizedTensor) else mine
        expected = theirs.dequantize() if isinstance(theirs, qtensor.QuantizedTensor) else theirs
        assert torch.equal(plain, expected), name
    assert fsdp_cases.train(model, weights)["losses"] == fsdp_cases.train(fsdp_cases.build(recipe, weights), weights)["losses"]


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_a_precision_schedule_switches_sharded_weights_like_one_process(distributed, weights):
    """A format switch for the last step (qtensor.PrecisionSchedule): dynamic weights from
    float8_current to mxfp8, held weights from mxfp8 to float8_current (each rank's shard cast
    again from its master's shard at the whole weight's scale). On 2 ranks the gathered weights
    are in the first format, then the second (FSDP2's gather buffers made again at their new
    sizes), and the losses and logits are the single process's."""
    sharded = distributed[("schedule", weights)]
    model, schedule, seen = fsdp_cases.scheduled(weights)
    single = fsdp_cases.train(model, weights, schedule=schedule)
    steps = fsdp_cases.STEPS
    first, then = ({"float8_current": "Float8Tensor", "mxfp8": "MXFP8Tensor"}[r] for r in fsdp_cases.SCHEDULED[weights])
    assert sharded["formats"][:steps] == seen[:steps] == [first] * (steps - 1) + [then]
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-6, atol=0)
    torch.testing.assert_close(sharded["logits"], single["logits"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_mixed_precision_policy_gathers_a_bf16_quantized_weight(distributed, weights):
    result = distributed[("mixed", weights)]
    assert result["gathered_weight"] == ("MXFP8Tensor", torch.bfloat16)
    single = fsdp_cases.train(fsdp_cases.build("mxfp8", weights), weights)
    # bf16 compute against fp32: close, not equal
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(single["losses"]), rtol=2e-2, atol=0)


def _torchrun(*arguments: str) -> list:
    """For workers.Background: `torchrun --nproc-per-node 2 ARGUMENTS`, qtensor importable from the repository."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    return [([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(workers.free_port()), *arguments], env)]


_DEMO_ARGUMENTS = ["--steps", "3", "--d-model", "64", "--layers", "1", "--batch", "4", "--length", "16", "--only", "nvfp4", "mxfp8,"]
TORCHRUN_DEMO = workers.Background(
    "torchrun_demo", lambda folder: _torchrun("-m", "qtensor.demo", "--fsdp", "--device", "cpu", *_DEMO_ARGUMENTS), timeout=240
)


@pytest.fixture
def torchrun_demo() -> subprocess.CompletedProcess:
    """The main job under torchrun with FSDP2 (started early: workers.Background)."""
    (done,) = TORCHRUN_DEMO.wait()
    return done


def test_the_main_job_under_torchrun_prints_the_single_process_losses_and_the_gathered_bytes(torchrun_demo, capsys):
    from qtensor import demo

    done = torchrun_demo
    assert done.returncode == 0, done.stderr[-4000:]
    sharded = workers.demo_rows(done.stdout)
    demo.main([*_DEMO_ARGUMENTS, "--device", "cpu"])
    single = workers.demo_rows(capsys.readouterr().out)
    for name in ("bf16", "nvfp4", "mxfp8, quantized weights"):
        assert sharded[name][0] == single[name][0], (name, sharded[name], single[name])  # final loss, as printed
    nvfp4 = sharded["nvfp4"]
    sent, bf16 = float(nvfp4[-2]), float(nvfp4[-1].strip("()"))
    assert 0 < sent <= 0.3 * bf16


def _readme_fsdp_script(folder) -> None:
    readme = open(os.path.join(os.path.dirname(HERE), "README.md")).read()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "fully_shard" in b]
    # os._exit (docs/design.md, FSDP2) skips Python's flush: flush what the example printed first.
    (folder / "train.py").write_text(block + "\n    dist.destroy_process_group()\n    import sys\n    sys.stdout.flush()\n    os._exit(0)\n")


TORCHRUN_README = workers.Background(
    "torchrun_readme", lambda folder: _torchrun(str(folder / "train.py")), timeout=120, prepare=_readme_fsdp_script
)


@pytest.fixture
def torchrun_readme() -> subprocess.CompletedProcess:
    """README's FSDP2 example under torchrun (started early: workers.Background)."""
    (done,) = TORCHRUN_README.wait()
    return done


def test_the_readme_fsdp_example_runs_under_torchrun(torchrun_readme):
    done = torchrun_readme
    assert done.returncode == 0, done.stderr[-3000:]
    # One dict per rank; the two ranks share the pipe, so find them by pattern, not by line.
    stats = [ast.literal_eval(found) for found in re.findall(r"\{'all_gathers': \d+, 'bytes': \d+, 'bf16_bytes': \d+\}", done.stdout)]
    assert len(stats) == 2, done.stdout
    assert all(n["all_gathers"] > 0 and 0 < n["bytes"] < n["bf16_bytes"] for n in stats)


_FREED_SCRIPT = """
import gc, sys, weakref
import torch, torch.distributed as dist, torch.nn as nn
import qtensor
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo", rank=0, world_size=1)
for case in sys.argv[1:]:
    recipe, weights = case.split(",")
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    qtensor.quantize_(model, getattr(qtensor.recipes, recipe)(), weights=weights)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    if weights == "quantized":
        optimizer = qtensor.optim.MasterWeights(optimizer)
    for _ in range(2):
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    parameters = [weakref.ref(p) for p in model.parameters()]
    del model, optimizer
    gc.collect()
    print(case, sum(p() is not None for p in parameters), len(parameters))
dist.destroy_process_group()
"""
_FREED_CASES = [("float8_current", "dynamic"), ("mxfp8", "quantized")]


def _one_rank(script: str, *arguments: str):
    """For workers.Background: `script` run in a fresh interpreter as one gloo rank."""

    def commands(folder) -> list:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(workers.free_port()), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
        return [([sys.executable, "-c", script, *arguments], env)]

    return commands


def _printed(run: workers.Background) -> str:
    """What a `_one_rank` script printed."""
    (done,) = run.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


FREED = workers.Background("parameters_left_alive", _one_rank(_FREED_SCRIPT, *(f"{r},{w}" for r, w in _FREED_CASES)), timeout=120)


@pytest.fixture(scope="module")
def parameters_left_alive():
    """{(recipe, weights): (parameters still alive after the model was deleted, parameters)}."""
    printed = _printed(FREED)
    return {tuple(line.split()[0].split(",")): tuple(int(n) for n in line.split()[1:]) for line in printed.splitlines()}


@pytest.mark.parametrize("recipe, weights", _FREED_CASES)
def test_a_deleted_sharded_model_frees_its_parameters(parameters_left_alive, recipe, weights):
    """A quantized layer notes FSDP2's parameter group holding its weight; a strong reference back
    from the weight's quantizers would close a cycle through autograd's references between a
    parameter and its shard, which the garbage collector cannot see: a deleted model (the previous
    run of a benchmark or a sweep) would keep every parameter. One gloo rank, FSDP2 on the root (a
    model sharded per block is kept alive by FSDP2 itself on the CPU builds of torch 2.11 and 2.13,
    with or without qtensor)."""
    assert parameters_left_alive[(recipe, weights)] == (0, 4)


_UNSHARDED_BYTES_SCRIPT = """
import sys
import torch, torch.distributed as dist, torch.nn as nn
import qtensor
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo", rank=0, world_size=1)


def held_bytes(module, args):
    storages = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in module.weight.buffer_dict(quantizer_state=False).values()}
    seen.append(sum(storages.values()))


for recipe in sys.argv[1:]:
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.Linear(256, 256, bias=False))
    qtensor.quantize_(model, getattr(qtensor.recipes, recipe)())
    fully_shard(model[0])
    fully_shard(model)
    seen = []
    model[0].register_forward_pre_hook(held_bytes)
    for _ in range(2):
        model(torch.randn(32, 256)).square().mean().backward()
    print(recipe, *seen)
dist.destroy_process_group()
"""
_GATHERED_BYTES = {
    "mxfp8": 256 * 256 + 256 * 256 // 32,  # one direction's E4M3 codes and E8M0 block scales
    "nvfp4": 256 * 256 // 2 + 256 * 256 // 256 + 4,  # one direction's E2M1 codes, E4M3 scales of 16x16 tiles, the fp32 global scale
    "float8_current": 2 * 256 * 256 + 4,  # the codes and their transpose (rebuilt after each gather), one fp32 scale
    # Both copies, each with its 2 x 2 fp32 scales of 128 x 128 blocks (the columnwise one rebuilt by
    # transposition). Its gather sends two buffers: on one rank, where FSDP2 copies only the first
    # all-gather input, they travel packed (they used to be sent as two inputs and the gather failed).
    "float8_blockwise": 2 * 256 * 256 + 2 * 4 * 4,
}


GATHERED = workers.Background("gathered_weight_bytes", _one_rank(_UNSHARDED_BYTES_SCRIPT, *_GATHERED_BYTES), timeout=120)


@pytest.fixture(scope="module")
def gathered_weight_bytes():
    """{recipe: [bytes the gathered weight holds at each of two forwards]}."""
    printed = _printed(GATHERED)
    return {line.split()[0]: [int(n) for n in line.split()[1:]] for line in printed.splitlines()}


@pytest.mark.parametrize("recipe", _GATHERED_BYTES)
def test_a_gathered_weight_holds_one_directions_bytes_when_the_backward_gathers_the_other(gathered_weight_bytes, recipe):
    """With a re-gather before the backward (reshard_after_forward, the default), MXFP8's and NVFP4's
    forward gather sends the rowwise copy and the re-gather the columnwise one: the unsharded weight's
    two directions share one buffer, as large as one direction, where each gather writes what it
    brought (the exactness of such training: the scenarios above). Float8 rebuilds its transpose
    from the gathered codes and keeps both."""
    assert gathered_weight_bytes[recipe] == [_GATHERED_BYTES[recipe]] * 2


@pytest.mark.parametrize("recipe, weights", fsdp_cases.DCP_CASES)
def test_distributed_checkpoint_round_trips_and_reshards_between_one_and_two_ranks(distributed, recipe, weights):
    import torch.distributed.checkpoint as dcp

    result = distributed[("dcp", recipe, weights)]
    assert torch.equal(result["reloaded"], result["saved"])  # 2 ranks -> 2 ranks
    assert torch.equal(result["from_one_rank"], distributed["single_logits"][(recipe, weights)])  # 1 -> 2
    model = fsdp_cases.build(recipe, weights, seed=11)  # 2 -> 1
    dcp.load(model.state_dict(), checkpoint_id=str(distributed["folder"] / f"dcp2_{recipe}_{weights}"), no_dist=True)
    assert torch.equal(fsdp_cases.probe_logits(model), result["saved"])


def test_distributed_checkpoint_carries_the_optimizer_state(distributed):
    original, reloaded = distributed["dcp_optimizer"]
    assert original == reloaded


@pytest.mark.parametrize("recipe, weights", fsdp_cases.DCP_CASES)
def test_save_model_of_a_sharded_model_loads_into_one_process_bitwise(distributed, recipe, weights):
    result = distributed[("dcp", recipe, weights)]
    model = fsdp_cases.build(recipe, weights, seed=12)
    assert qtensor.load_model(model, distributed["folder"] / f"full_{recipe}_{weights}.safetensors") == ([], [])
    assert torch.equal(fsdp_cases.probe_logits(model), result["saved"])


def test_distributed_checkpoint_carries_master_weights(distributed):
    original, reloaded = distributed["dcp_masters"]
    assert original == reloaded


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_a_layer_with_fewer_rows_than_ranks_trains_like_one_process(distributed, weights):
    torch.manual_seed(0)
    tiny = torch.nn.Sequential(torch.nn.Linear(fsdp_cases.WIDTH, 1)).to(fsdp_cases.device())
    qtensor.quantize_(tiny, fsdp_cases.RECIPES["float8_current"](), weights=weights)
    losses = fsdp_cases.train_losses(tiny, weights, outputs=1)
    torch.testing.assert_close(torch.tensor(distributed[("tiny", weights)]), torch.tensor(losses), rtol=1e-6, atol=0)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_attention_in_proj_and_conv1d_layers_train_sharded_like_one_process(distributed, weights):
    pytest.importorskip("transformers")
    single = fsdp_cases.train_layer_types(weights)
    torch.testing.assert_close(torch.tensor(distributed[("layer_types", weights)]), torch.tensor(single), rtol=1e-6, atol=0)


def _assert_trains_exactly_like(result, single):
    """Bit for bit on the CPU. On GPUs the weight gradient of the sharded run is the sum of each
    rank's fp32 GEMM over its tokens, whose rounding differs from one GEMM over all of them: there the
    losses and the trained model's logits agree to the tolerance of the other sharded-training tests."""
    assert result["weights"].keys() == single["weights"].keys() and result["weights"]
    if fsdp_cases.DEVICE == "cuda":
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(single["losses"]), rtol=1e-6, atol=0)
        torch.testing.assert_close(result["logits"], single["logits"], rtol=1e-6, atol=1e-7)
        return
    assert result["losses"] == single["losses"]
    for name, weight in single["weights"].items():
        assert torch.equal(result["weights"][name], weight), name
    assert torch.equal(result["logits"], single["logits"])


@pytest.mark.parametrize("variant", ["plain", "evaluating"])
@pytest.mark.parametrize("recipe", fsdp_cases.AMAX_RECIPES)
def test_one_all_reduce_per_step_reduces_the_amaxes_of_every_dynamic_weight(distributed, recipe, variant):
    """The first stale shard cast in a step reduces every dynamic weight's tensor-wide amaxes in one
    collective; the pre-backward re-gathers, the second micro-batch and a training forward after an
    evaluation forward ("evaluating") reuse the casts. Bit for bit one process's training."""
    result = distributed[("amax_reductions", recipe, variant)]
    amaxes = fsdp_cases.QUANTIZED_LAYERS * fsdp_cases.AMAX_RECIPES[recipe]
    assert result["reductions"] == [[amaxes]] * fsdp_cases.STEPS
    options = dict(evaluate=True, micro_batches=2) if variant == "evaluating" else {}
    single = fsdp_cases.train_counting_amax_reductions(fsdp_cases.build(recipe, "dynamic"), **options)
    _assert_trains_exactly_like(result, single)


def test_each_cast_reducing_its_own_amaxes_takes_one_all_reduce_per_layer_and_the_same_bytes(distributed):
    """The batching turned off in the workers: the count the test above pins is the batching's, and
    the two ways train bit for bit alike."""
    unbatched = distributed[("amax_reductions", "float8_current", "unbatched")]
    assert unbatched["reductions"] == [[1] * fsdp_cases.QUANTIZED_LAYERS] * fsdp_cases.STEPS
    _assert_trains_exactly_like(unbatched, distributed[("amax_reductions", "float8_current", "plain")])


def test_frozen_weights_are_reduced_once_then_left_out(distributed):
    result = distributed[("amax_reductions", "float8_current", "frozen")]
    trained = fsdp_cases.QUANTIZED_LAYERS - 2  # the first block's two linears are frozen
    assert result["reductions"] == [[fsdp_cases.QUANTIZED_LAYERS]] + [[trained]] * (fsdp_cases.STEPS - 1)
    model = fsdp_cases.build("float8_current", "dynamic")
    model.layers[0].requires_grad_(False)
    _assert_trains_exactly_like(result, fsdp_cases.train_counting_amax_reductions(model))


def test_trained_weights_release_their_shard_casts_after_the_backward_and_frozen_ones_keep_them(distributed):
    """The pre-backward re-gather is the last use of a trained weight's cast before the optimizer
    writes it: the cast is not kept (memory). A frozen block's casts stay for the next step, and
    the root (never re-gathered) keeps its own. Training equals one process."""
    result = distributed["frozen_middle"]
    kept = ["head.weight", "layers.1.down.weight", "layers.1.up.weight"]
    assert result["cached_casts"] == [kept] * fsdp_cases.STEPS
    model = fsdp_cases.build("float8_current", "dynamic")
    model.layers[1].requires_grad_(False)
    single = fsdp_cases.train_losses(model, "dynamic", outputs=fsdp_cases.OUT)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(single), rtol=1e-6, atol=0)


@pytest.mark.parametrize("recipe", fsdp_cases.ONE_COPY_RECIPES)
def test_a_frozen_block_holding_one_copy_of_its_weights_shards_and_trains_like_one_process(distributed, recipe):
    """A frozen block whose held weights keep the forward's copy only (a LoRA base; per-tensor FP8,
    NVFP4's 16x16 tiles): sharded, each gather brings that copy, the backward rebuilds dgrad's from
    it for the gradients of the block below, and training equals one process; the frozen weights
    still hold one copy after the optimizer's steps."""
    result = distributed[("one_copy", recipe)]
    single_model = fsdp_cases.frozen_one_copy(fsdp_cases.build(recipe, "quantized"))
    single = fsdp_cases.train(single_model, "quantized")
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(single["losses"]), rtol=1e-6, atol=0)
    torch.testing.assert_close(result["logits"], single["logits"], rtol=1e-6, atol=1e-7)
    frozen = {name: copies for name, copies in result["copies"].items() if name.startswith("layers.1.")}
    assert frozen == {"layers.1.up.weight": ["rowwise"], "layers.1.down.weight": ["rowwise"]}
    assert fsdp_cases.held_copies(single_model) == result["copies"]


@pytest.mark.parametrize("recipe, reshard", [("float8_current", True), ("mxfp8", False)])
def test_checkpointed_blocks_train_like_one_process(distributed, recipe, reshard):
    """Activation checkpointing recomputes each block's forward inside the backward. Float8's
    re-gather brings the codes the forward reads (the transpose is rebuilt from them); MXFP8's
    forward gather brings both copies when no re-gather follows."""
    result = distributed[("checkpointed", recipe, reshard)]
    assert "error" not in result, result["error"]
    single = fsdp_cases.train_losses(fsdp_cases.checkpointed(fsdp_cases.build(recipe, "dynamic")), "dynamic")
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(single), rtol=1e-6, atol=0)


def test_a_forward_recomputed_after_a_regather_of_the_backward_copy_only_is_refused(distributed):
    """MXFP8 re-gathers only the columnwise copy before the backward: a checkpointed block's
    recomputed forward would read rowwise codes that gather did not bring. It raises, naming the
    layer and what to do, instead of training on them."""
    error = distributed[("checkpointed", "mxfp8", True)]["error"]
    assert "layers.1." in error and "activation checkpointing" in error and "reshard_after_forward=False" in error


def test_amaxes_are_batched_under_a_mixed_precision_policy_and_with_compiled_blocks(distributed):
    """bf16 gathers: the batch takes the amaxes of the bf16 values each cast reads (else every cast
    would find them stale and reduce again). Compiled blocks: FSDP2's hooks run outside the graphs."""
    mixed = distributed[("amax_reductions", "float8_current", "mixed")]
    assert mixed["reductions"] == [[fsdp_cases.QUANTIZED_LAYERS]] * fsdp_cases.STEPS
    compiled = distributed[("amax_reductions", "float8_current", "compiled")]
    assert compiled["reductions"] == [[fsdp_cases.QUANTIZED_LAYERS]] * fsdp_cases.STEPS
    _assert_trains_exactly_like(compiled, fsdp_cases.train_counting_amax_reductions(fsdp_cases.build("float8_current", "dynamic")))


@pytest.mark.parametrize("name", ["_unsharded_dtensor_spec", "_tp_spec"])
def test_the_groups_of_a_tensor_parallel_shard_are_read_under_either_torch_name(name):
    """FSDP2 keeps a parameter's DTensor spec from before `fully_shard` as `_unsharded_dtensor_spec`
    (torch 2.13) or `_tp_spec` (torch 2.11): under either, a shard on a 2-D mesh reduces its amaxes
    over the tensor-parallel dimension too (without it a tensor-parallel layer refuses to run)."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate, Shard

    from qtensor.distributed.fsdp_state import shard_groups

    mesh = SimpleNamespace(get_group=lambda dim=None: f"group {dim}")
    spec = SimpleNamespace(mesh=mesh, placements=(Replicate(), Shard(0)))
    fsdp_param = SimpleNamespace(shard_mesh_from_root=SimpleNamespace(get_group=lambda: "fsdp group"), **{name: spec})
    assert shard_groups(fsdp_param) == ("fsdp group", "group 1")
    plain = SimpleNamespace(shard_mesh_from_root=SimpleNamespace(get_group=lambda: "fsdp group"))
    assert shard_groups(plain) == ("fsdp group",)
