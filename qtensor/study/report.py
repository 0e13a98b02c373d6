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

SPIKE_WINDOW = 50
SPIKE_RATIO = 1.10


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


def spike_steps(steps: list[int], losses: list[float], after: int) -> set[int]:
    """Steps past `after` whose training loss exceeds the median of the previous SPIKE_WINDOW steps'
    by more than SPIKE_RATIO."""
    found = set()
    for i in range(SPIKE_WINDOW, len(losses)):
        if steps[i] > after and losses[i] > SPIKE_RATIO * statistics.median(losses[i - SPIKE_WINDOW : i]):
            found.add(steps[i])
    return found


def summary_rows(study: dict[str, dict], baseline: str = "bf16") -> list[dict]:
    """One row per run: final validation loss, its gap to the baseline's, the spikes the baseline
    does not have, solo tokens/s against the baseline's, peak memory."""
    base = study[baseline]
    warmup = base["summary"]["options"]["warmup"] if base["summary"] else 0
    base_spikes = spike_steps(base["step"], base["train_loss"], warmup)
    base_speed = float(base["speed"]["tokens_per_s"]) if base["speed"] else None
    rows = []
    for name, run in study.items():
        if run["summary"] is None:
            continue
        final = run["summary"]["final_val_loss"]
        spikes = spike_steps(run["step"], run["train_loss"], warmup)
        speed = float(run["speed"]["tokens_per_s"]) if run["speed"] else None
        rows.append({
            "run": name,
            "steps": run["summary"]["steps"],
            "final_val_loss": final,
            "gap_pct": 100 * (final / base["summary"]["final_val_loss"] - 1),
            "spikes": len(spikes),
            "spikes_not_in_baseline": len(spikes - base_spikes),
            "tokens_per_s": speed,
            "speed_vs_baseline": speed / base_speed if speed and base_speed else None,
            "peak_gib": float(run["speed"]["peak_gib"]) if run["speed"] and run["speed"]["peak_gib"] else run["summary"]["peak_gib"],
        })
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| run | final val loss | gap to bf16 | spikes (not in bf16) | tokens/s (× bf16) | peak GiB |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        speed = f"{row['tokens_per_s']:,.0f} ({row['speed_vs_baseline']:.2f}×)" if row["tokens_per_s"] else "-"
        peak = f"{row['peak_gib']:.1f}" if row["peak_gib"] else "-"
        lines.append(
            f"| {row['run']} | {row['final_val_loss']:.4f} | {row['gap_pct']:+.2f}% | {row['spikes']} ({row['spikes_not_in_baseline']}) | {speed} | {peak} |"
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
    run's validation loss relative to the baseline's at the same step. Returns the figure."""
    import matplotlib.pyplot as plt

    runs = runs or list(study)
    figure, (train_axis, val_axis, gap_axis) = plt.subplots(1, 3, figsize=(17, 5))
    base = dict(zip(study[baseline]["val_step"], study[baseline]["val_loss"]))
    for name in runs:
        run = study[name]
        style = {"color": "black", "linewidth": 2} if name == baseline else {"linewidth": 1.2}
        if name.startswith(baseline) and name != baseline:
            style = {"color": "gray", "linestyle": ":", "linewidth": 1.5}
        train_axis.plot(run["step"], smooth(run["train_loss"], window), label=name, **style)
        val_axis.plot(run["val_step"], run["val_loss"], label=name, **style)
        shared = [(s, v) for s, v in zip(run["val_step"], run["val_loss"]) if s in base]
        gap_axis.plot([s for s, _ in shared], [100 * (v / base[s] - 1) for s, v in shared], label=name, **style)
    final = min(min(run["val_loss"]) for run in (study[n] for n in runs) if run["val_loss"])
    train_axis.set(title=f"training loss (mean of {window} steps)", xlabel="step", ylabel="nats per byte")
    train_axis.set_ylim(final * 0.9, final * 2.0)
    val_axis.set(title="validation loss", xlabel="step", ylabel="nats per byte")
    val_axis.set_ylim(final * 0.95, final * 1.6)
    gap_axis.set(title=f"validation loss vs {baseline} (same step)", xlabel="step", ylabel="%")
    gap_axis.axhline(0, color="black", linewidth=0.8)
    gap_axis.set_ylim(-3, 12)
    for axis in (train_axis, val_axis, gap_axis):
        axis.grid(alpha=0.3)
    gap_axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--plot", help="write the curves to this image file")
    args = parser.parse_args(argv)
    rows = write_summary(args.directory)
    print(markdown_table(rows))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        plot(load_study(args.directory)).savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
