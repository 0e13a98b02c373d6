"""DistributedDataParallel with delayed scaling: the amaxes are reduced over every rank by default
(docs/running-state.md). 2 gloo ranks with different batches (ddp_case.py) against one process."""

import copy
import os
import sys

import pytest
import torch

import qtensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_case  # noqa: E402
import workers  # noqa: E402

WORLD = 2


RUN = workers.Background("ranks", workers.rank_commands("ddp_case.py", world=WORLD), timeout=180)


@pytest.fixture(scope="module")
def ranks():
    return torch.load(RUN.results() / "results.pt", weights_only=False)


def _batch_amaxes(rank: int) -> list[float]:
    """The amax of each of `rank`'s batches: what the first layer's input history records at each step."""
    return [x.abs().max().item() for x, _ in ddp_case.batches(rank)]


def _recorded(history: torch.Tensor) -> list[float]:
    assert (history[: ddp_case.HISTORY - ddp_case.STEPS] == -1).all() and (history[-ddp_case.STEPS :] >= 0).all(), history
    return history[-ddp_case.STEPS :].tolist()


def test_by_default_every_rank_holds_the_max_over_the_ranks(ranks):
    """No amax_reduction_group, quantize_ called before init_process_group: every rank ends with the
    same histories and weights, the first layer's input history is the max over the ranks' batches,
    and both equal one process trained on the concatenated batches."""
    first, *others = ranks["default"]
    assert {name.split(".", 1)[1] for name in first["histories"]} == {"input.amax_history", "weight.amax_history", "grad_output.amax_history"}
    for history in first["histories"].values():
        _recorded(history)
    for other in others:
        for kind in ("histories", "weights"):
            assert other[kind].keys() == first[kind].keys()
            for name, value in first[kind].items():
                assert torch.equal(other[kind][name], value), (kind, name)
    expected = [max(amaxes) for amaxes in zip(*(_batch_amaxes(rank) for rank in range(WORLD)))]
    assert _recorded(first["histories"]["0.input.amax_history"]) == expected
    assert expected != _batch_amaxes(0) and expected != _batch_amaxes(1)  # each rank gave some of the maxima

    single = ddp_case.build()
    data = [tuple(torch.cat(parts) for parts in zip(*step)) for step in zip(*(ddp_case.batches(rank) for rank in range(WORLD)))]
    ddp_case.train(single, data, world=WORLD)
    one = ddp_case.state(single)
    assert torch.equal(one["histories"]["0.input.amax_history"], first["histories"]["0.input.amax_history"])
    initial = ddp_case.state(ddp_case.build())["weights"]
    for kind in ("histories", "weights"):
        for name, value in one[kind].items():
            # The same casts; the weight gradients summed in another order (two GEMMs and DDP's all-reduce).
            torch.testing.assert_close(first[kind][name], value, rtol=1e-5, atol=1e-5, msg=f"{kind} {name}")
            if kind == "weights":  # the steps moved every weight far past that tolerance
                assert (value - initial[name]).abs().max() > 1e-2, name


@pytest.mark.parametrize("scenario", ["local", "one_rank_group"])
def test_an_opt_out_keeps_each_ranks_own_histories(ranks, scenario):
    """amax_reduction_group="local", or a group of the rank alone: each rank records its own batches'
    amaxes; DDP still keeps the weights equal."""
    per_rank = ranks[scenario]
    for rank, result in enumerate(per_rank):
        assert _recorded(result["histories"]["0.input.amax_history"]) == _batch_amaxes(rank), rank
    first, second = per_rank
    assert not torch.equal(first["histories"]["0.input.amax_history"], second["histories"]["0.input.amax_history"])
    for name, value in first["weights"].items():
        assert torch.equal(second["weights"][name], value), name


def test_a_stack_routed_differently_on_each_rank_reduces_every_experts_amax(ranks):
    """Under the default reduction every expert of a delayed-scaling stack joins each step's
    reductions, whatever rows the rank routed to it: the ranks hold the same per-expert histories,
    each the max over the ranks of that expert's rows (0 for an expert no rank routed a row to)."""
    first, second = ranks["experts"]
    batches = [ddp_case.batches(rank)[:2] for rank in range(WORLD)]
    for expert in range(ddp_case.EXPERTS):
        assert torch.equal(first[expert], second[expert]), expert
        expected = []
        for step in range(2):
            amaxes = [0.0]
            for rank in range(WORLD):
                ends = ddp_case.expert_ends(rank)
                start = ends[expert - 1] if expert else 0
                rows = batches[rank][step][0][start:ends[expert]]
                amaxes.append(rows.abs().max().item() if len(rows) else 0.0)
            expected.append(max(amaxes))
        assert first[expert][-2:].tolist() == expected, expert
    assert first[2][-2:].tolist() == [0.0, 0.0]


def test_amax_reduction_group_takes_a_group_local_or_none():
    model = torch.nn.Linear(32, 32)
    with pytest.raises(ValueError, match=r"amax_reduction_group='world'.*'local'"):
        qtensor.quantize_(model, qtensor.recipes.float8_delayed(), amax_reduction_group="world")
    with pytest.raises(ValueError, match="amax_reduction_group=False"):
        qtensor.quantize_(model, qtensor.recipes.float8_delayed(), amax_reduction_group=False)
    assert type(model.weight) is torch.nn.Parameter  # nothing was changed
    # "local" stays with copies of the model, pickled or not.
    qtensor.quantize_(model, qtensor.recipes.float8_delayed(), amax_reduction_group="local")
    assert copy.deepcopy(model).weight.linear_quantizers.running.amax_group == "local"
    import io

    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False).weight.linear_quantizers.running.amax_group == "local"


def test_the_default_reduction_is_traced_into_the_compiled_backward():
    """Under torch.compile the backward's amax reduction over the default group is a traced
    collective (by the group's name), settled when the backward is traced; "local" traces none.
    One process with a fake 2-rank group: collectives return their input."""
    import torch._dynamo.testing
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        reductions = {}
        for group in (None, "local"):
            torch._dynamo.reset()
            counters.clear()
            model = ddp_case.build(group)
            recorder = torch._dynamo.testing.AotEagerAndRecordGraphs()
            compiled = torch.compile(model, backend=recorder, fullgraph=True)
            x, target = ddp_case.batches(0)[0]
            (compiled(x) - target).square().mean().backward()
            assert sum(counters["graph_break"].values()) == 0
            (backward,) = recorder.bw_graphs
            reductions[group] = backward.code.count("_c10d_functional.all_reduce")
            assert "_torchbind_obj" not in backward.code  # no ProcessGroup constant
            assert _recorded_once(model)
        # Two layers, one all-reduce each (of all the layer's amaxes).
        assert reductions == {None: 2, "local": 0}, reductions
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def _recorded_once(model) -> bool:
    return all(int((buffer >= 0).sum()) == 1 for name, buffer in ddp_case.state(model)["histories"].items())
