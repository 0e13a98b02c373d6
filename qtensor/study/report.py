"""Read a study's CSVs back: the summary table, the loss spikes, the plots.

    python -m qtensor.study.report DIR [--plot FILE.png]

Works from the files alone (`{run}.csv`, `{run}.json`, `speed.csv`), so the documentation's figures
and the notebook are drawn from the committed results without training anything.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics

# A loss spike the baseline does not have: on the same batch (same seed, same data order), the run's
# training loss relative to the baseline's jumps by more than SPIKE_JUMP over its median of the
# previous SPIKE_WINDOW steps. Batches differ in difficulty (on this corpus a batch's loss can be 1.6
# times the median of the 50 before it), which a ratio to the baseline on the same batch cancels.
SPIKE_WINDOW = 50
SPIKE_JUMP = 1.10


def read_csv(path: str) -> list[dict]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def load_study(directory: str) -> dict[str, dict]:
    """name -> {"step", "train_loss", "grad_norm", "val_step", "val_loss", "summary", "speed"}, in
    the order the runs' summaries list them (the study's order), runs without a summary last."""
    speed = {}
    if os.path.exists(os.path.join(directory, "speed.csv")):
        speed = {row["name"]: row for row in read_csv(os.path.join(directory, "speed.csv"))}
    study = {}
    for file in sorted(os.listdir(directory)):
        if not file.endswith(".csv") or file in ("speed.csv", "summary.csv", "diagnose.csv"):
            continue
        name = file[: -len(".csv")]
        rows = read_csv(os.path.join(directory, file))
        summary_path = os.path.join(directory, f"{name}.json")
        summary = json.load(open(summary_path)) if os.path.exists(summary_path) else None
        study[name] = {
            "step": [int(r["step"]) for r in rows],
            "train_loss": [float(r["train_loss"]) for r in rows],
            "grad_norm": [float(r["grad_norm"]) for r in rows],
            "val_step": [int(r["step"]) for r in rows if r["val_loss"]],
            "val_loss": [float(r["val_loss"]) for r in rows if r["val_loss"]],
            "summary": summary,
            "speed": speed.get(name),
        }
    order = _run_order()
    return dict(sorted(study.items(), key=lambda item: order.get(item[0], len(order))))


def _run_order() -> dict[str, int]:
    from .train import study_runs  # the study's order; reading results needs no torch otherwise

    return {name: index for index, name in enumerate(study_runs())}


def relative_jumps(losses: list[float], baseline: list[float], after: int) -> list[float]:
    """For each step past `after`: (loss / baseline loss) over the median of that ratio in the
    previous SPIKE_WINDOW steps. 1.0 is no change; SPIKE_JUMP and above counts as a spike."""
    ratio = [a / b for a, b in zip(losses, baseline)]
    start = max(SPIKE_WINDOW, after)
    return [ratio[i] / statistics.median(ratio[i - SPIKE_WINDOW : i]) for i in range(start, len(ratio))]


def bf16_spread(study: dict[str, dict], baseline: str = "bf16") -> tuple[float, float, float]:
    """(lowest, mean, highest) final validation loss of the baseline's runs (every seed, the rerun)."""
    finals = [run["summary"]["final_val_loss"] for name, run in study.items() if name.startswith(baseline) and run["summary"]]
    return min(finals), statistics.mean(finals), max(finals)


def summary_rows(study: dict[str, dict], baseline: str = "bf16") -> list[dict]:
    """One row per run: final validation loss and its gap to the baseline's (same seed: same initial
    weights and batches), to the mean of the baseline's seeds, and whether it lies within their
    spread; loss spikes the baseline does not have (same-seed runs); solo tokens/s; peak memory."""
    base = study[baseline]
    warmup = base["summary"]["options"]["warmup"]
    low, mean, high = bf16_spread(study, baseline)
    base_speed = float(base["speed"]["tokens_per_s"]) if base["speed"] else None
    rows = []
    for name, run in study.items():
        if run["summary"] is None:
            continue
        final = run["summary"]["final_val_loss"]
        same_seed = run["summary"]["seed"] == base["summary"]["seed"] and len(run["train_loss"]) == len(base["train_loss"])
        # The baseline against itself has no jumps by construction: "-" as for another seed.
        same_seed = same_seed and name != baseline
        jumps = relative_jumps(run["train_loss"], base["train_loss"], warmup) if same_seed else []
        speed = float(run["speed"]["tokens_per_s"]) if run["speed"] else None
        rows.append({
            "run": name,
            "seed": run["summary"]["seed"],
            "steps": run["summary"]["steps"],
            "final_val_loss": final,
            "gap_pct": 100 * (final / base["summary"]["final_val_loss"] - 1),
            "vs_bf16_mean_pct": 100 * (final / mean - 1),
            "bf16_spread": "within" if low <= final <= high else ("above" if final > high else "below"),
            "spikes": sum(jump > SPIKE_JUMP for jump in jumps) if same_seed else None,
            "largest_jump": max(jumps) if jumps else None,
            "tokens_per_s": speed,
            "speed_vs_baseline": speed / base_speed if speed and base_speed else None,
            "peak_gib": float(run["speed"]["peak_gib"]) if run["speed"] and run["speed"]["peak_gib"] else run["summary"]["peak_gib"],
        })
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| run | final val loss | vs bf16 (same seed) | vs bf16 mean | bf16 spread | spikes (largest jump) | tokens/s (× bf16) | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        speed = f"{row['tokens_per_s']:,.0f} ({row['speed_vs_baseline']:.2f}×)" if row["tokens_per_s"] else "-"
        peak = f"{row['peak_gib']:.1f}" if row["peak_gib"] else "-"
        spikes = f"{row['spikes']} ({row['largest_jump']:.3f})" if row["largest_jump"] else "-"
        gap = f"{row['gap_pct']:+.2f}%" if row["seed"] == rows[0]["seed"] else f"{row['gap_pct']:+.2f}% (seed {row['seed']})"
        lines.append(
            f"| {row['run']} | {row['final_val_loss']:.4f} | {gap} | {row['vs_bf16_mean_pct']:+.2f}% | {row['bf16_spread']} | {spikes} | {speed} | {peak} |"
        )
    return "\n".join(lines)


def write_summary(directory: str) -> list[dict]:
    rows = summary_rows(load_study(directory))
    with open(os.path.join(directory, "summary.csv"), "w", newline="") as file:
        writer = csv.DictWriter(file, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(study: dict[str, dict], runs: list[str] | None = None, baseline: str = "bf16", window: int = 50):
    """Three panels: training loss (trailing mean over `window` steps), validation loss, and each
    run's validation loss against the mean of the baseline's runs at the same step, over the band
    those runs span (the baseline's own spread). Returns the figure."""
    import matplotlib.pyplot as plt

    runs = runs or list(study)
    family = [name for name in study if name.startswith(baseline)]
    figure, (train_axis, val_axis, gap_axis) = plt.subplots(1, 3, figsize=(17, 5))
    steps = study[baseline]["val_step"]
    by_step = [[study[name]["val_loss"][i] for name in family] for i in range(len(steps))]
    mean = [statistics.mean(values) for values in by_step]
    gap_axis.fill_between(
        steps, [100 * (min(v) / m - 1) for v, m in zip(by_step, mean)], [100 * (max(v) / m - 1) for v, m in zip(by_step, mean)],
        color="gray", alpha=0.25, label=f"{baseline}: {len(family)} runs' spread",
    )
    for name in runs:
        run = study[name]
        if name == baseline:
            style = {"color": "black", "linewidth": 2}
        elif name in family:
            style = {"color": "gray", "linestyle": ":", "linewidth": 1.2}
        else:
            style = {"linewidth": 1.3}
        train_axis.plot(run["step"], smooth(run["train_loss"], window), label=name, **style)
        val_axis.plot(run["val_step"], run["val_loss"], label=name, **style)
        if name not in family or name == baseline or name.endswith("-rerun"):
            gap_axis.plot(run["val_step"], [100 * (v / m - 1) for v, m in zip(run["val_loss"], mean)], label=name, **style)
    final = min(min(study[name]["val_loss"]) for name in runs)
    train_axis.set(title=f"training loss (mean of {window} steps)", xlabel="step", ylabel="nats per byte", ylim=(final * 0.75, final * 3))
    val_axis.set(title="validation loss", xlabel="step", ylabel="nats per byte", yscale="log", ylim=(final * 0.95, final * 3))
    gap_axis.set(title=f"validation loss vs the mean of {baseline}'s runs (same step)", xlabel="step", ylabel="%", ylim=(-10, 12))
    gap_axis.axhline(0, color="black", linewidth=0.8)
    for axis in (train_axis, val_axis, gap_axis):
        axis.grid(alpha=0.3)
    val_axis.legend(fontsize=7)
    gap_axis.legend(fontsize=7)
    figure.tight_layout()
    return figure


def plot_gemm_errors(rows: list[dict]):
    """Bars: each recipe's mean relative error per GEMM over the layers (diagnose.csv)."""
    import matplotlib.pyplot as plt

    recipes = list(dict.fromkeys(row["recipe"] for row in rows))
    figure, axis = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / 3
    for offset, gemm in enumerate(("fprop", "dgrad", "wgrad")):
        means = [statistics.mean(float(r["relative_error"]) for r in rows if r["recipe"] == name and r["gemm"] == gemm) for name in recipes]
        axis.bar([i + (offset - 1) * width for i in range(len(recipes))], [100 * m for m in means], width, label=gemm)
    axis.set_xticks(range(len(recipes)), recipes, rotation=25, ha="right", fontsize=8)
    axis.set(ylabel="relative error, % (mean over layers)", title="each GEMM's error on the trained bf16 model's operands")
    axis.grid(alpha=0.3, axis="y")
    axis.legend()
    figure.tight_layout()
    return figure


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--plot", help="write the curves to this image file")
    parser.add_argument("--runs", help="the runs to draw, separated by commas (default: all)")
    args = parser.parse_args(argv)
    rows = write_summary(args.directory)
    print(markdown_table(rows))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        runs = args.runs.split(",") if args.runs else None
        plot(load_study(args.directory), runs).savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()
