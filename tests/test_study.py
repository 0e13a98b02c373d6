"""The convergence study: its corpus rule, schedule, model, runs, diagnosis and report, on the CPU.

The study itself trains on a GPU (docs/convergence.md); here its pieces are checked against
references written from the rules its documentation states, and a tiny study runs end to end.
"""

import csv
import hashlib
import json
import math
import pathlib
import re
import zlib

import numpy as np
import pytest
import torch
from torch import nn

import oracle
import qtensor
from qtensor import recipes
from qtensor.recipes import Recipe
from qtensor.study import __main__ as study_main
from qtensor.study.corpus import Batches, load_corpus, source_files, validation_starts, windows
from qtensor.study.diagnose import capture_operands, gemm_errors
from qtensor.study.model import Decoder, ModelConfig, parameter_count
from qtensor.study.report import SPIKE_JUMP, load_study, markdown_table, relative_jumps, summary_rows
from qtensor.study.train import MAIN_RUNS, Schedule, build_model, loss_of, study_runs

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "convergence"
TINY = ["--device", "cpu", "--blocks", "2", "--width", "64", "--heads", "4", "--hidden", "128", "--length", "32",
        "--batch", "4", "--warmup", "2", "--val-every", "3", "--val-windows", "4", "--final-val-windows", "8"]


def write_tree(root: pathlib.Path, files: dict[str, bytes]) -> None:
    for relative, data in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def a_validation_name() -> str:
    """A file name the documented rule (CRC-32 of the relative path divisible by 20) puts in validation."""
    return next(f"v{i}.py" for i in range(1000) if zlib.crc32(f"v{i}.py".encode()) % 20 == 0)


def test_corpus_follows_the_documented_rule(tmp_path):
    held_out = a_validation_name()
    files = {
        "b.py": b"print('b')\n", "a.py": b"x = 1\n", f"pkg/{held_out}": b"def f(): pass\n", held_out: b"y = 2\n",
        "site-packages/skip.py": b"no", "pkg/__pycache__/skip.py": b"no", "dist-packages/skip.py": b"no", "notes.txt": b"no",
    }
    write_tree(tmp_path, files)
    corpus = load_corpus(str(tmp_path))
    kept = sorted(["a.py", "b.py", f"pkg/{held_out}", held_out])
    is_held = {name: zlib.crc32(name.encode()) % 20 == 0 for name in kept}
    assert is_held[held_out] and not is_held["a.py"] and not is_held["b.py"]
    train = b"\x00".join(files[name] for name in kept if not is_held[name])
    validation = b"\x00".join(files[name] for name in kept if is_held[name])
    digest = hashlib.sha256(b"".join(name.encode() + b"\x00" + files[name] + b"\x00" for name in kept)).hexdigest()
    assert bytes(corpus.train.tolist()) == train and bytes(corpus.validation.tolist()) == validation
    assert (corpus.train_files, corpus.validation_files, corpus.sha256) == (
        sum(not v for v in is_held.values()), sum(is_held.values()), digest)
    assert corpus.sha256[:16] in corpus.describe()


def test_the_interpreters_standard_library_splits_by_file():
    corpus = load_corpus()
    files = source_files(corpus.root)
    assert corpus.train_files + corpus.validation_files == len(files) > 100
    assert 0.02 < corpus.validation_files / len(files) < 0.10
    assert not any(part in {"site-packages", "dist-packages", "__pycache__"} for f in files for part in f.split("/"))
    assert load_corpus().sha256 == corpus.sha256  # a fixed rule: the same corpus again


def test_a_corpus_too_small_to_split_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="No .py files"):
        load_corpus(str(tmp_path))
    write_tree(tmp_path, {"a.py": b"1"})
    with pytest.raises(ValueError, match="too few to split"):
        load_corpus(str(tmp_path))


def test_batches_are_the_same_for_the_same_seed_and_are_windows_of_the_data():
    data = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    first, again, other = Batches(data, 4, 16, seed=3), Batches(data, 4, 16, seed=3), Batches(data, 4, 16, seed=4)
    a, b = [first.next() for _ in range(3)], [again.next() for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], other.next())
    for row in a[0]:
        start = int(row[0])  # values are positions mod 256, so a row is a run of consecutive bytes
        assert row.tolist() == [(start + i) % 256 for i in range(17)]
    starts = validation_starts(data, 5, 16)
    assert starts.tolist() == [0, 245, 491, 737, 983]  # evenly from the first start to the last (1000 - 17)
    assert windows(data, starts, 16).shape == (5, 17)


def test_schedule_warms_up_linearly_then_decays_on_a_cosine_to_the_floor():
    schedule = Schedule(steps=1000, peak=1e-3, warmup=100, floor=0.1)
    assert schedule.lr(1) == pytest.approx(1e-5) and schedule.lr(50) == pytest.approx(5e-4) and schedule.lr(100) == pytest.approx(1e-3)
    assert schedule.lr(1000) == pytest.approx(1e-4)
    assert schedule.lr(550) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert schedule.lr(325) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))))


def test_the_default_model_has_the_documented_size_and_its_linear_layers_quantize():
    config = ModelConfig()
    w, h, blocks = config.width, config.hidden, config.blocks
    per_block = 3 * w * w + w * w + 2 * w * h + h * w + 2 * w  # qkv, out, gate_up, down, two norms
    expected = blocks * per_block + config.vocabulary * w * 2 + config.length * w + w
    with torch.device("meta"):
        model = Decoder(config)
    assert parameter_count(model) == expected and round(expected / 1e6) == 156
    report = qtensor.quantize_(model, recipes.mxfp8(), exclude=["head"])
    assert len(report.quantized) == 4 * blocks and "head" in report.skipped


def test_runs_start_from_the_same_weights():
    config = ModelConfig(blocks=1, width=32, heads=2, hidden=64, length=8)
    a, b, c = (build_model(config, seed, torch.device("cpu")) for seed in (0, 0, 1))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.blocks[0].attention.qkv.weight, c.blocks[0].attention.qkv.weight)


def test_every_run_names_a_recipe_or_bf16_and_the_main_runs_are_the_issue_list():
    runs = study_runs()
    assert MAIN_RUNS == ["bf16", "bf16-seed1", "float8_current", "float8_delayed", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd",
                         "mxfp8_fwd_nvfp4_bwd-high_precision_bwd", "mxfp8_fwd_nvfp4_bwd-dequantized_bwd"]
    assert [runs[n].recipe.backward_override for n in MAIN_RUNS[-2:]] == ["high_precision", "dequantized"]
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+", name) for name in runs)  # file names


def test_a_tiny_study_trains_every_selected_run_and_writes_its_files(tmp_path, capsys):
    out = tmp_path / "study"
    study_main.main(["--out", str(out), "--runs", "bf16,bf16-rerun,mxfp8,nvfp4-bf16_last2", "--steps", "6", "--speed-steps", "2", "--diagnose", *TINY, "--blocks", "3"])
    printed = capsys.readouterr().out
    assert "corpus: " in printed and "| mxfp8 |" in printed
    rows = {name: list(csv.DictReader(open(out / f"{name}.csv"))) for name in ("bf16", "bf16-rerun", "mxfp8", "nvfp4-bf16_last2")}
    for name, run in rows.items():
        assert [int(r["step"]) for r in run] == list(range(1, 7))
        assert [r["step"] for r in run if r["val_loss"]] == ["3", "6"]
        assert all(math.isfinite(float(r["train_loss"])) for r in run)
        summary = json.load(open(out / f"{name}.json"))
        assert summary["steps"] == 6 and math.isfinite(summary["final_val_loss"])
    # Same seed, same batches, same weights, deterministic CPU kernels: bf16 twice is bf16 exactly.
    assert [r["train_loss"] for r in rows["bf16"]] == [r["train_loss"] for r in rows["bf16-rerun"]]
    # Same starting point: the first step's loss is bf16's up to the quantization's error.
    assert float(rows["mxfp8"][0]["train_loss"]) == pytest.approx(float(rows["bf16"][0]["train_loss"]), rel=0.01)
    assert json.load(open(out / "mxfp8.json"))["quantized_layers"] == 12
    assert json.load(open(out / "nvfp4-bf16_last2.json"))["quantized_layers"] == 4  # blocks 1 and 2 (the last two) kept
    speed = list(csv.DictReader(open(out / "speed.csv")))
    assert [r["name"] for r in speed] == ["bf16", "bf16-rerun", "mxfp8", "nvfp4-bf16_last2"]
    diagnosed = {r["recipe"] for r in csv.DictReader(open(out / "diagnose.csv"))}
    assert "mxfp8" in diagnosed and "nvfp4-bf16_last2" not in diagnosed and "float8_delayed" not in diagnosed


def test_a_study_run_with_a_late_switch_trains_as_its_first_recipe_until_the_switch(tmp_path):
    """`nvfp4-mxfp8_fwd_last15`: NVFP4, the forward in MXFP8 from 85% of the steps (step 5 of 6 on):
    the same losses as the `nvfp4` run, step for step, until the switch, another one after it."""
    out = tmp_path / "study"
    study_main.main(["--out", str(out), "--runs", "nvfp4,nvfp4-mxfp8_fwd_last15", "--steps", "6", "--speed-steps", "0", *TINY, "--blocks", "2"])
    plain, switched = (list(csv.DictReader(open(out / f"{name}.csv"))) for name in ("nvfp4", "nvfp4-mxfp8_fwd_last15"))
    assert [r["train_loss"] for r in plain[:5]] == [r["train_loss"] for r in switched[:5]]
    assert plain[5]["train_loss"] != switched[5]["train_loss"]
    summary = json.load(open(out / "nvfp4-mxfp8_fwd_last15.json"))
    assert summary["late"]["from_step"] == 5 and "forward_in" in summary["late"]["recipe"]


def test_unknown_runs_are_named():
    with pytest.raises(SystemExit, match="unknown run"):
        study_main.selected_runs("bf16,fp7")


def _operands(seed=0, rows=64, k=64, n=32):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=generator) * 0.05).to(torch.bfloat16)
    dy = (torch.randn(rows, n, generator=generator) * 1e-3).to(torch.bfloat16)
    return {"x": x, "w": w, "dy": dy}


def test_gemm_errors_match_an_independent_mxfp8_reference():
    ops = _operands()
    errors = gemm_errors("layer", ops, Recipe(recipes.mxfp8()))
    x, w, dy = (ops[k].float().numpy() for k in ("x", "w", "dy"))

    def relative(approx, exact):
        return np.linalg.norm(approx - exact) / np.linalg.norm(exact)

    deq = lambda t, direction: oracle.mxfp8(t, direction).deq.astype(np.float64)
    x64, w64, dy64 = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    assert errors["fprop"] == pytest.approx(relative(deq(x, "rowwise") @ deq(w, "rowwise").T, x64 @ w64.T), rel=1e-9)
    assert errors["dgrad"] == pytest.approx(relative(deq(dy, "rowwise") @ deq(w, "columnwise"), dy64 @ w64), rel=1e-9)
    assert errors["wgrad"] == pytest.approx(relative(deq(dy, "columnwise").T @ deq(x, "columnwise"), dy64.T @ x64), rel=1e-9)
    assert 0 < errors["fprop"] < 0.05


def test_backward_overrides_measure_the_operands_their_backward_uses():
    ops = _operands(1)
    hybrid = recipes.mxfp8_fwd_nvfp4_bwd()
    quantized = gemm_errors("layer", ops, Recipe(hybrid))
    high = gemm_errors("layer", ops, Recipe(hybrid, backward_override="high_precision"))
    dequantized = gemm_errors("layer", ops, Recipe(hybrid, backward_override="dequantized"))
    assert high["dgrad"] == high["wgrad"] == 0.0
    assert high["fprop"] == quantized["fprop"] == dequantized["fprop"]
    assert 0 < dequantized["dgrad"] < quantized["dgrad"] and 0 < dequantized["wgrad"] < quantized["wgrad"]


@pytest.mark.parametrize("recipe", [
    Recipe(recipes.mxfp8()),
    Recipe(recipes.nvfp4(stochastic_rounding=False)),
    Recipe(recipes.mxfp8_fwd_nvfp4_bwd(stochastic_rounding=False), backward_override="dequantized"),
], ids=["mxfp8", "nvfp4", "hybrid-dequantized_bwd"])
def test_the_diagnosis_measures_what_a_quantized_layer_computes(recipe):
    """The errors the diagnosis reports are those of a quantized nn.Linear's own forward and backward
    on the same operands (up to the layer's bf16 output rounding, well under the quantization's)."""
    ops = _operands(2)
    layer = nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(ops["w"])
    qtensor.quantize_(layer, recipe)
    x = ops["x"].clone().requires_grad_()
    layer(x).backward(ops["dy"])
    with torch.no_grad():
        y = layer(ops["x"])
    x64, w64, dy64 = (ops[k].double() for k in ("x", "w", "dy"))
    relative = lambda approx, exact: float(torch.linalg.norm(approx.double() - exact) / torch.linalg.norm(exact))
    measured = {"fprop": relative(y, x64 @ w64.T), "dgrad": relative(x.grad, dy64 @ w64), "wgrad": relative(layer.weight.grad, dy64.T @ x64)}
    reported = gemm_errors("layer", ops, recipe)
    for gemm in ("fprop", "dgrad", "wgrad"):
        assert measured[gemm] == pytest.approx(reported[gemm], rel=0.05), gemm


def test_capture_takes_each_linear_layers_operands_from_one_step():
    config = ModelConfig(blocks=1, width=32, heads=2, hidden=64, length=8)
    model = build_model(config, 0, torch.device("cpu"))
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    operands = capture_operands(model, tokens, loss_of)
    assert sorted(operands) == ["blocks.0.attention.out", "blocks.0.attention.qkv", "blocks.0.mlp.down", "blocks.0.mlp.gate_up"]
    qkv = operands["blocks.0.attention.qkv"]
    assert qkv["x"].shape == (16, 32) and qkv["w"].shape == (96, 32) and qkv["dy"].shape == (16, 96)
    assert all(p.grad is None for p in model.parameters())


def _write_run(directory, name, losses, seed, final, val=None):
    with open(directory / f"{name}.csv", "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["step", "tokens", "lr", "train_loss", "grad_norm", "val_loss", "seconds"])
        for step, loss in enumerate(losses, 1):
            writer.writerow([step, step, 0.1, loss, 1.0, (val or {}).get(step, ""), step])
    json.dump({"final_val_loss": final, "seed": seed, "steps": len(losses), "options": {"warmup": 10}, "peak_gib": None},
              open(directory / f"{name}.json", "w"))


def test_report_gaps_spread_and_spikes_from_the_files(tmp_path):
    rng = np.random.default_rng(0)
    base = list(2 + rng.random(200))  # batches of differing difficulty
    spiky = [b * 1.01 for b in base]
    spiky[150] *= 1.2  # one step 20% above its usual ratio to bf16
    _write_run(tmp_path, "bf16", base, 0, 1.00, {100: 2.0})
    _write_run(tmp_path, "bf16-seed1", list(2 + rng.random(200)), 1, 0.96, {100: 2.1})
    _write_run(tmp_path, "mxfp8", spiky, 0, 1.01, {100: 2.05})
    _write_run(tmp_path, "nvfp4", base, 0, 0.90, {100: 1.9})
    rows = {row["run"]: row for row in summary_rows(load_study(str(tmp_path)))}
    assert rows["mxfp8"]["gap_pct"] == pytest.approx(1.0)
    assert rows["mxfp8"]["vs_bf16_mean_pct"] == pytest.approx(100 * (1.01 / 0.98 - 1))
    assert [rows[n]["bf16_spread"] for n in ("bf16-seed1", "mxfp8", "nvfp4")] == ["within", "above", "below"]
    assert rows["mxfp8"]["spikes"] == 1 and rows["mxfp8"]["largest_jump"] == pytest.approx(1.2)
    assert rows["nvfp4"]["spikes"] == 0 and rows["bf16-seed1"]["spikes"] is None  # other batches: no same-batch ratio
    jumps = relative_jumps(spiky, base, after=10)
    assert sum(j > SPIKE_JUMP for j in jumps) == 1


def test_the_committed_results_are_the_documented_ones():
    """docs/convergence.md quotes the committed files: every run of the study finished its 3000 steps,
    and the page's table is the report's table of those files."""
    study = load_study(str(RESULTS))
    assert set(study) == set(study_runs())
    assert all(run["summary"]["steps"] == 3000 and run["step"][-1] == 3000 for run in study.values())
    assert {run["summary"]["corpus"]["sha256"] for run in study.values()} == {study["bf16"]["summary"]["corpus"]["sha256"]}
    table = markdown_table(summary_rows(study))
    page = (RESULTS.parent / "convergence.md").read_text()
    assert table in page


def test_the_committed_switch_runs_switched_late_and_the_page_quotes_them():
    """The two precision-schedule runs recorded their switch at 85% of the steps, train as nvfp4 from
    the same seed until the GPU's reductions part them, and docs/convergence.md's table of their
    validation loss before and after the switch is read from their files."""
    study = load_study(str(RESULTS))
    page = (RESULTS.parent / "convergence.md").read_text()
    for name in ("nvfp4", "nvfp4-mxfp8_fwd_last15", "nvfp4-hp_fwd_last15"):
        run = study[name]
        if name != "nvfp4":
            assert run["summary"]["late"]["from_step"] == 2550
            assert run["train_loss"][:5] == study["nvfp4"]["train_loss"][:5]
        val = dict(zip(run["val_step"], run["val_loss"]))
        row = (
            f"| `{name}` | {val[2500]:.4f} | {val[3000]:.4f} | {val[3000] - val[2500]:.4f} | {run['summary']['final_val_loss']:.4f} |"
        ).replace("-0.", "−0.")
        assert row in page
