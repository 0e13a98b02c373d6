"""Tensor parallelism with torch's own parallel styles over quantize_'d stock modules: 2 gloo ranks
on the CPU against one process (tp_cases.py), every recipe, both weight modes, with and without
sequence parallelism.

A tensor-parallel run differs from one process only in how a row-parallel layer sums its output:
each rank's GEMM sums its half of the reduction dimension, and the all-reduce adds the halves. The
quantized operands themselves are the same bytes (tensor-wide amaxes reduced over the group, shard
edges on block edges), so the runs agree to float32 rounding of those sums.
"""

import os
import sys

import pytest
import torch

import qtensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tp_cases  # noqa: E402
import workers  # noqa: E402
# float32 sums of the two halves of each row-parallel reduction, in another order than one GEMM's.
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


# The 4-rank and the 2-rank run of every scenario, the longest waits of the suite, start while the
# tests before this module's run: workers.Background.
TWO_D = workers.Background("two_d", workers.rank_commands("tp_cases.py", world=4), timeout=600)
RUN = workers.Background("distributed", workers.rank_commands("tp_cases.py", world=2), timeout=400)


@pytest.fixture(scope="module")
def two_d():
    """4 ranks on a 2 x 2 ("dp", "tp") mesh (tp_cases.run_two_d), and where they saved checkpoints."""
    if tp_cases.DEVICE == "cuda" and torch.cuda.device_count() < 4:
        pytest.skip(f"the 2 x 2 mesh takes 4 GPUs, one per NCCL rank; this machine has {torch.cuda.device_count()}")
    folder = TWO_D.results()
    return torch.load(folder / "results.pt", weights_only=False), folder


@pytest.fixture(scope="module")
def distributed():
    return torch.load(RUN.results() / "results.pt", weights_only=False)


def assert_trains_like_one_process(parallel: dict, single: dict, fp8: bool) -> None:
    """The losses, the last output and every weight of the parallel run against one process's."""
    if tp_cases.DEVICE == "cuda" and fp8:
        # The FP8 tensor cores accumulate in reduced precision within each chunk of the reduction
        # dimension (docs/numerics.md), so a row-parallel layer, whose ranks each sum half of it, rounds
        # other partial sums than one GEMM over all of it; E4M3/E5M2 casts downstream then round some
        # elements the other way. The runs agree as two trainings of one model, not bit for bit: the
        # CPU runs (float32 accumulation) hold them to TOLERANCE.
        torch.testing.assert_close(torch.tensor(parallel["losses"]), torch.tensor(single["losses"]), rtol=1e-3, atol=0)
        for name, (got, expected) in {"output": (parallel["output"], single["output"]),
                                      **{n: (parallel["weights"][n], w) for n, w in single["weights"].items()}}.items():
            error = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
            assert error <= 3e-2, (name, error)
        return
    torch.testing.assert_close(torch.tensor(parallel["losses"]), torch.tensor(single["losses"]), **TOLERANCE)
    torch.testing.assert_close(parallel["output"], single["output"], **TOLERANCE)
    for name, weight in single["weights"].items():
        torch.testing.assert_close(parallel["weights"][name], weight, **TOLERANCE, msg=name)


@pytest.mark.parametrize("recipe, weights, sequence_parallel", tp_cases.SCENARIOS)
def test_tensor_parallel_training_equals_one_process(distributed, recipe, weights, sequence_parallel):
    parallel = distributed[(recipe, weights, sequence_parallel)]
    with tp_cases.counting_quantized_gemms() as count:
        single = tp_cases.train(tp_cases.build(recipe, weights), weights)
    # Every linear ran quantized on its shard: 14 layers, each forward of the steps and the last one.
    assert parallel["quantized_linears"] == count[0] == 14 * (tp_cases.STEPS + 1)
    linears = {name for name in single["weights"] if not name.endswith(("norm.weight", "bias")) and ":" not in name}
    assert linears <= parallel["shards"].keys()
    for name, (kind, local, shape) in parallel["shards"].items():
        if name.endswith(("q.weight", "k.weight", "v.weight", "gate.weight", "up.weight")):
            assert shape[0] * 2 == dict(single["weights"])[name].shape[0] and local != "Tensor", (name, local)
        elif name.endswith(("o.weight", "down.weight")):
            assert shape[1] * 2 == dict(single["weights"])[name].shape[1] and local != "Tensor", (name, local)
    assert parallel["weights"].keys() == single["weights"].keys()
    assert_trains_like_one_process(parallel, single, fp8=recipe.startswith("float8"))


@pytest.mark.parametrize("recipe", tp_cases.FROZEN)
def test_a_frozen_base_keeping_one_copy_per_shard_trains_like_one_process(distributed, recipe):
    """LoRA's base under tensor parallelism: frozen held weights, each rank's shard keeping the
    forward's copy only (`keep_forward_copies_` on the parallelized model), the backward rebuilding
    dgrad's copy from it on the shard; the norms train. Equals one process keeping one copy too."""
    parallel = distributed[("frozen", recipe)]
    model = tp_cases.frozen(recipe)
    kept = qtensor.keep_forward_copies_(model)
    single = tp_cases.train(model, "quantized")
    assert parallel["kept"].keys() == kept.keys() and len(kept) == 14
    assert all(text.startswith("the forward's copy") for text in parallel["kept"].values()), parallel["kept"]
    assert set(parallel["held"].values()) == {(True, False)} == set(tp_cases.held_copies(model).values())
    assert_trains_like_one_process(parallel, single, fp8=recipe.startswith("float8"))


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_a_precision_schedule_switches_tensor_parallel_layers_like_one_process(distributed, weights):
    """A format switch for the last step (qtensor.PrecisionSchedule) on column- and row-parallel
    layers: dynamic weights from float8_current to mxfp8, held ones from mxfp8 to float8_current
    (each rank's shard cast again from its master's shard at the whole weight's scale). Every one
    of the 14 layers switches at step 2 on both runs, and the 2 ranks train like one process, as
    in the runs above (on GPUs the Float8 phase's tensor-core sums bound the agreement)."""
    parallel = distributed[("schedule", weights)]
    model, schedule = tp_cases.scheduled(weights)
    single = tp_cases.train(model, weights, schedule=schedule)
    steps = tp_cases.STEPS
    assert parallel["switches"] == [(s.step, s.phase, len(s.changes)) for s in schedule.switches] == [(steps - 1, 1, 14)]
    assert_trains_like_one_process(parallel, single, fp8=True)  # float8_current in one of the phases


def test_the_parallel_runs_moved_the_weights():
    """The control for the test above: training changes every weight, so agreeing after it means something."""
    model = tp_cases.build("mxfp8", "dynamic")
    before = tp_cases.plain_weights(model)
    after = tp_cases.train(model, "dynamic")["weights"]
    for name, weight in before.items():
        assert not torch.equal(after[name], weight), name


def test_a_shard_edge_inside_a_block_raises_naming_the_layer_and_the_block(distributed):
    message = distributed["cut_block"]
    assert "layer '0'" in message and "0.weight" in message, message
    assert "32-row blocks" in message and "shards of 24" in message, message


def test_compiling_a_tensor_parallel_layer_is_refused_naming_the_layer(distributed):
    message = distributed["traced"]
    assert "layer '0'" in message and "torch.compile over a tensor-parallel quantized layer" in message, message


def test_a_quantized_weight_splits_along_its_columns_into_the_same_bytes():
    """What RowwiseParallel does to a quantized weight: chunk along dim 1, each piece its columns."""
    weight = qtensor.MXFP8Quantizer().quantize(torch.randn(64, 128))
    for index, piece in enumerate(weight.chunk(2, dim=1)):
        assert type(piece) is qtensor.MXFP8Tensor
        for direction in ("rowwise", "columnwise"):
            expected = weight.dequantize(torch.float32, direction)[:, 64 * index : 64 * (index + 1)]
            assert torch.equal(piece.dequantize(torch.float32, direction), expected)


def test_a_row_parallel_layer_under_autocast_outputs_what_nn_linear_does(distributed):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = torch.nn.Linear(64, 32)(torch.randn(4, 64)).dtype
    assert distributed["row_parallel_autocast_dtype"] == expected == torch.bfloat16


def test_a_broadcast_quantized_tensor_holds_the_source_ranks_bytes_on_every_rank(distributed):
    assert distributed["broadcast"] == 2.0  # both ranks


# ---- sequence parallelism with quantized gathers (PrepareQuantizedModuleInput, QuantizedRowwiseParallel) ----
def _copy_bytes(format_name: str, elements: int) -> int:
    """Bytes of one copy of `elements` values, by the formats' definitions (docs/numerics.md): Float8
    one byte an element and one tensor-wide scale (not sent); MXFP8 one byte an element and one E8M0
    scale per 32; NVFP4 half a byte an element and one E4M3 scale per 16 (its global amax not sent)."""
    return {"float8": elements, "mxfp8": elements + elements // 32, "nvfp4": elements // 2 + elements // 16}[format_name]


# recipe: (the input's rowwise copy, its columnwise copy, the output gradient's copies as sent)
_GATHERED_FORMATS = {
    "float8_current": ("float8", "float8", ("float8",)),  # the gradient's columnwise copy is its transpose, made locally
    "mxfp8": ("mxfp8", "mxfp8", ("mxfp8", "mxfp8")),
    "nvfp4": ("nvfp4", "nvfp4", ("nvfp4", "nvfp4")),
    "hybrid": ("mxfp8", "nvfp4", ("nvfp4", "nvfp4")),
}


@pytest.mark.parametrize("recipe", tp_cases.CURRENT)
def test_sequence_parallel_gathers_carry_the_quantized_bytes(distributed, recipe):
    """Per block and step: one forward gather for q/k/v and one for gate/up (their input's rowwise
    copy), the backward's gather of each one's columnwise copy, and one gather of each row-parallel
    output gradient; the last forward adds two more per block. Each rank sends its tokens' bytes."""
    elements = tp_cases.BATCH * tp_cases.TOKENS // 2 * tp_cases.WIDTH  # one rank's tokens of one activation
    rowwise, columnwise, gradient = _GATHERED_FORMATS[recipe]
    blocks, steps = 2, tp_cases.STEPS
    expected = (
        2 * blocks * (steps + 1) * _copy_bytes(rowwise, elements)
        + 2 * blocks * steps * _copy_bytes(columnwise, elements)
        + 2 * blocks * steps * sum(_copy_bytes(f, elements) for f in gradient)
    )
    gathers = 2 * blocks * (steps + 1) + 4 * blocks * steps
    for weights in ("dynamic", "quantized"):
        stats = distributed[(recipe, weights, "quantized")]["gathers"]
        assert stats == {"all_gathers": gathers, "bytes": expected, "high_precision_bytes": gathers * elements * 4}, weights
    assert expected < gathers * elements * 2  # fewer bytes than the same gathers in bf16


def test_an_mxfp8_gradient_is_gathered_in_bf16_under_autocast_where_its_two_copies_would_be_more_bytes(distributed):
    elements = tp_cases.BATCH * tp_cases.TOKENS // 2 * tp_cases.WIDTH
    mxfp8, nvfp4 = distributed[("autocast_gathers", "mxfp8")], distributed[("autocast_gathers", "nvfp4")]
    # One step of two blocks: the inputs' rowwise (forward) and columnwise (backward) gathers, for both...
    assert (mxfp8["all_gathers"], mxfp8["bytes"]) == (8, 8 * _copy_bytes("mxfp8", elements))
    # ...and for NVFP4 the row-parallel gradients' two copies too (1.125 bytes an element against 2).
    assert (nvfp4["all_gathers"], nvfp4["bytes"]) == (12, 8 * _copy_bytes("nvfp4", elements) + 4 * 2 * _copy_bytes("nvfp4", elements))


def test_quantized_sequence_parallel_refuses_delayed_scaling_and_tokens_that_cut_blocks(distributed):
    delayed, cut = distributed[("refused", "float8_delayed")], distributed[("refused", "mxfp8")]
    assert "layers.0.attention.q" in delayed and "delayed" in delayed and "PrepareModuleInput" in delayed, delayed
    assert "runs of 16 rows" in cut and "32-row blocks" in cut and "layers.0.attention.q" in cut, cut


def test_a_gathered_columnwise_copy_is_released_under_activation_checkpointing(distributed):
    """Recomputed projections pack their saved references twice; the gather's backward releases the
    copy all the same (two blocks: an attention and an MLP gather each)."""
    layouts = distributed["checkpointed_layouts"]
    assert len(layouts) >= 4 and all(released for _, released in layouts), layouts


def test_quantized_rowwise_parallel_refuses_a_gradient_quantizer_with_running_state(distributed):
    message = distributed[("refused", "delayed_gradient")]
    assert "running state" in message and "RowwiseParallel" in message and "layers.0.attention.o" in message, message


def test_shard_blocks_follow_the_formats_blocks_and_leave_state_and_random_draws_alone():
    """docs/numerics.md: MXFP8 1x32 blocks in both directions, NVFP4 1x16 blocks (16x16 tiles), Float8 none."""
    role = qtensor.Role("linear", "grad_output", "layer")
    delayed = qtensor.Float8Quantizer(scaling="delayed")
    cases = [
        (qtensor.Float8Quantizer(), (1, 1)), (delayed, (1, 1)), (qtensor.MXFP8Quantizer(), (32, 32)),
        (qtensor.NVFP4Quantizer(block_2d=True), (16, 16)), (qtensor.recipes.nvfp4()(role), (16, 16)),
        (qtensor.recipes.mxfp8_fwd_nvfp4_bwd()(qtensor.Role("linear", "input", "layer")), (16, 32)),
    ]
    torch.manual_seed(0)
    expected_draw = torch.rand(4)
    torch.manual_seed(0)
    for quantizer, block in cases:
        assert quantizer.shard_block() == block, quantizer.describe()
    assert torch.equal(torch.rand(4), expected_draw)  # the stochastic-rounding quantizer drew nothing
    assert (delayed.amax_history == -1).all()  # nothing recorded


# ---- 2-D: FSDP2 over "dp" x tensor parallelism over "tp" -------------------------------------------
# Float8's tensor-wide scales are not powers of two and its gradients are E5M2 (2 mantissa bits): a
# float32 rounding difference (a row-parallel partial sum, a norm computed by DTensor's ops) moves the
# odd element across a rounding boundary, and the run then drifts by that element's step. Those
# recipes are held to the loss within 1e-4 and the weights within 1e-3; the block formats, whose
# runs stay within float32 rounding here, to TOLERANCE. What 2-D sharding can get wrong (a shard cast
# with the amax of its piece) shows bit for bit in the scale check, for every recipe.
TOLERANCE_2D = {"float8_current": dict(rtol=1e-4, atol=1e-3), "float8_delayed": dict(rtol=1e-4, atol=1e-3)}


@pytest.mark.parametrize("recipe", tp_cases.RECIPES)
@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_fsdp2_over_tensor_parallelism_trains_like_one_process(two_d, recipe, weights):
    results, _ = two_d
    parallel = results[(recipe, weights)]
    single = tp_cases.train(tp_cases.build(recipe, weights, width=tp_cases.WIDTH_2D), weights)
    assert parallel["quantized_linears"] == 14 * (tp_cases.STEPS + 1)
    checked, disagreeing = parallel["scales"]
    assert disagreeing == 0, f"{disagreeing} of {checked} weight casts held another scale on some rank"
    if recipe != "mxfp8":  # MXFP8 has no tensor-wide scale; every other recipe's weights were checked
        assert checked >= 14 * tp_cases.STEPS
    tolerance = TOLERANCE_2D.get(recipe, TOLERANCE)
    torch.testing.assert_close(torch.tensor(parallel["losses"]), torch.tensor(single["losses"]), **tolerance)
    assert parallel["weights"].keys() == single["weights"].keys()
    for name, weight in single["weights"].items():
        torch.testing.assert_close(parallel["weights"][name], weight, **tolerance, msg=name)
    if recipe not in TOLERANCE_2D:
        torch.testing.assert_close(parallel["output"], single["output"], **TOLERANCE)


@pytest.mark.parametrize("recipe", tp_cases.RECIPES)
@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_a_2x2_checkpoint_loads_into_4x1_and_into_one_process_bit_for_bit(two_d, recipe, weights):
    import torch.distributed.checkpoint as dcp

    results, folder = two_d
    saved = results[(recipe, weights)]["weights"]  # every copy's exact values, gathered from the 2 x 2 run
    four_by_one = results[(recipe, weights)]["four_by_one"]
    model = tp_cases.build(recipe, weights, seed=11, width=tp_cases.WIDTH_2D)
    dcp.load(model.state_dict(), checkpoint_id=str(folder / f"dcp_{recipe}_{weights}"), no_dist=True)
    one = tp_cases.plain_weights(model)
    # qtensor.save_model of the 2 x 2 model (each weight's pieces gathered as their bytes), loaded here
    from_file = tp_cases.build(recipe, weights, seed=12, width=tp_cases.WIDTH_2D)
    assert qtensor.load_model(from_file, folder / f"full_{recipe}_{weights}.safetensors") == ([], [])
    from_file = tp_cases.plain_weights(from_file)
    assert saved.keys() == four_by_one.keys() == one.keys() == from_file.keys()
    for name, value in saved.items():
        assert torch.equal(four_by_one[name], value), name
        assert torch.equal(one[name], value), name
        assert torch.equal(from_file[name], value), name
    if weights == "quantized":
        assert any(name.endswith(":columnwise") for name in saved)


_BATCH, _LENGTH, _D_MODEL = 4, 16, 64
_DEMO_ARGUMENTS = ["--steps", "3", "--d-model", str(_D_MODEL), "--layers", "1", "--batch", str(_BATCH), "--length", str(_LENGTH),
                   "--spread-seeds", "0", "--only", "nvfp4", "mxfp8,"]


def _torchrun_demo(folder) -> list:
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    return [([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(workers.free_port()),
              "-m", "qtensor.demo", "--tp", "2", "--device", "cpu", *_DEMO_ARGUMENTS], env)]


TORCHRUN_DEMO = workers.Background("torchrun_demo", _torchrun_demo, timeout=300)


@pytest.fixture
def torchrun_demo():
    """The main job under torchrun on 4 ranks with --tp 2 (started early: workers.Background)."""
    (done,) = TORCHRUN_DEMO.wait()
    return done


def test_the_main_job_with_tp_2_over_4_ranks_trains_and_reports_the_collectives_bytes(torchrun_demo, capsys):
    """`torchrun --nproc-per-node 4 -m qtensor.demo --tp 2`: FSDP2 over 2 x tensor parallelism over 2."""
    from qtensor import demo

    done = torchrun_demo
    assert done.returncode == 0, done.stderr[-4000:]
    assert "2-way FSDP2 x 2-way tensor parallel" in done.stderr
    rows = workers.demo_rows(done.stdout)
    demo.main([*_DEMO_ARGUMENTS, "--device", "cpu"])
    single = workers.demo_rows(capsys.readouterr().out)
    # The MLP's all-reduces, per step: linear2's bf16 output in the forward, and the float32 gradient of
    # linear1's input (the LayerNorm's float32 output) in the backward.
    all_reduced = _BATCH * _LENGTH * _D_MODEL * (2 + 4) / 1024
    # Partial sums rounded per rank: the losses agree with one process to the printed rounding's
    # neighbourhood; NVFP4's stochastic rounding draws by position within each rank's shard of the
    # gradient (docs/tensor-parallel.md), so its run differs from one process by other random draws.
    for name, tolerance in (("bf16", 2e-3), ("mxfp8, quantized weights", 2e-3), ("nvfp4", 2e-2)):
        assert abs(float(rows[name][0]) - float(single[name][0])) <= tolerance, (name, rows[name], single[name])
        assert float(rows[name][-1]) == all_reduced, rows[name]
    sent, bf16 = float(rows["nvfp4"][-3]), float(rows["nvfp4"][-2].strip("()"))
    assert 0 < sent <= 0.3 * bf16
