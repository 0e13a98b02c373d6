"""The main job runs end to end and prints its table."""

import os
import sys

import pytest

import workers
from qtensor import demo


def test_demo_trains_every_recipe_and_prints_the_table(capsys):
    demo.main(["--steps", "4", "--d-model", "32", "--layers", "1", "--batch", "4", "--length", "32"])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("recipe"))
    for column in ("final loss", "gap to bf16", "weight KiB", "step ms"):
        assert column in header
    names = [run.name for run in demo.demo_runs()]
    assert "mxfp8_fwd_nvfp4_bwd" in names and any("high_precision" in n for n in names) and any("dequantized" in n for n in names)
    for name in names:
        assert any(line.startswith(name) for line in out.splitlines()), name
    # every quantized run saved, reloaded into a fresh model, and its logits compared
    rows = [line for line in out.splitlines() if line.startswith(tuple(names)) and not line.startswith("bf16")]
    assert rows and all(line.endswith("identical") for line in rows), rows
    assert f"identical in {len(rows)} of {len(rows)} runs" in out


def test_formats_table_lists_every_format(capsys):
    demo.main(["--formats"])
    out = capsys.readouterr().out
    for name in ("float8", "mxfp8", "nvfp4", "identity", "hybrid"):
        assert name in out


def test_a_training_step_of_every_recipe_runs_no_op_on_dequantized_values():
    """qtensor.fallbacks('raise'): the quantized path of the main job's model has no fallback."""
    import copy

    import torch

    import qtensor

    torch.manual_seed(0)
    base = demo.TinyLM(len(demo.VOCABULARY), 32, 1, 4, 32)
    for run in demo.demo_runs()[1:]:
        model = copy.deepcopy(base)
        qtensor.quantize_(model, run.recipe, weights=run.weights)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if run.weights == "quantized":
            optimizer = qtensor.optim.MasterWeights(optimizer)
        tokens = demo.sums_stream(4, 16, torch.Generator().manual_seed(0))
        with qtensor.fallbacks("raise"):
            demo.train_step(model, optimizer, tokens)


SMALL = ["--steps", "4", "--d-model", "32", "--layers", "1", "--batch", "4", "--length", "32"]


def _rows(out: str) -> dict[str, list[str]]:
    """The table's rows by recipe name: the columns after the name, split on whitespace."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("recipe")) + 1
    rows = {}
    for line in lines[start:]:
        if line.startswith("final loss:"):
            break
        rows[line[:26].strip()] = line[26:].split()
    return rows


def _demo_subprocesses(folder) -> list:
    """For workers.Background: `python -m qtensor.demo` under one thread and under two (both at once:
    each process's results depend on its own thread count only). 30 bf16 steps of the default model:
    enough for two threads' GEMM rounding to reach the printed loss."""
    args = ("--only", "no-recipe", "--steps", "30")
    return [([sys.executable, "-m", "qtensor.demo", *args], dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads)))
            for threads in (1, 2)]


ONE_AND_TWO_THREADS = workers.Background("one_and_two_threads", _demo_subprocesses, timeout=600)


@pytest.fixture
def one_and_two_threads() -> list:
    """The demo's stdout under one thread and under two (started early: workers.Background)."""
    done = ONE_AND_TWO_THREADS.wait()
    for run in done:
        assert run.returncode == 0, run.stderr[-3000:]
    return [run.stdout for run in done]


def test_demo_losses_are_the_same_under_one_and_two_threads(one_and_two_threads):
    one, two = (_rows(printed) for printed in one_and_two_threads)
    assert one.keys() == two.keys() and "bf16" in one
    for name in one:
        # final loss, gap to bf16 and what follows up to the weight column; step ms may differ
        assert one[name][:2] == two[name][:2], (name, one[name], two[name])


def test_a_run_prints_the_same_losses_whichever_other_recipes_ran_before_it(capsys):
    # nvfp4 rounds gradients stochastically: its keys must not depend on the runs before it
    demo.main(SMALL + ["--only", "mxfp8_fwd_nvfp4_bwd"])
    alone = _rows(capsys.readouterr().out)
    demo.main(SMALL + ["--only", "nvfp4"])
    after_others = _rows(capsys.readouterr().out)
    for name in ("mxfp8_fwd_nvfp4_bwd", "+ high_precision bwd", "+ dequantized bwd"):
        assert alone[name][0] == after_others[name][0], (name, alone[name], after_others[name])


def test_table_shows_bf16_spread_over_seeds_beside_the_gaps(capsys):
    demo.main(SMALL + ["--only", "float8_current", "nvfp4", "--spread-seeds", "3"])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("recipe"))
    assert header.index("gap to bf16") < header.index("vs bf16 spread") < header.index("weight KiB")
    rows = _rows(out)
    bf16_losses = [float(columns[0]) for name, columns in rows.items() if name.startswith("bf16")]
    assert len(bf16_losses) == 4  # the baseline seed and 3 others
    # the bf16 row states the spread: highest minus lowest final loss of its seeds (printed to 4 places)
    spread = float(rows["bf16"][2])
    assert abs(spread - (max(bf16_losses) - min(bf16_losses))) <= 2e-4
    for name, columns in rows.items():
        if name.startswith("bf16"):
            continue
        gap, verdict = float(columns[1]), columns[2]
        if abs(abs(gap) - spread) <= 2e-4:
            continue  # too close to call at 4 places
        expected = "within" if abs(gap) < spread else ("worse" if gap > 0 else "better")
        assert verdict == expected, (name, columns)
    assert "vs bf16 spread: bf16 trained from 4 seeds" in out


def test_demo_leaves_torch_threads_and_determinism_as_it_found_them(capsys):
    import torch

    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    demo.main(SMALL + ["--only", "no-recipe", "--spread-seeds", "1"])
    capsys.readouterr()
    assert torch.get_num_threads() == threads
    assert torch.are_deterministic_algorithms_enabled() == deterministic
