"""The convergence study: train the byte-level decoder once per recipe on the standard library's
sources, and write the losses as CSV.

    python -m qtensor.study --out DIR                      the main runs (--runs main), one after another
    python -m qtensor.study --out DIR --jobs 9             the same, each in its own process, all at once
    python -m qtensor.study --out DIR --runs bf16,mxfp8    some runs
    python -m qtensor.study.report DIR --plot curves.png   the table and the curves, from the files

Writes, per run, `{run}.csv` (one row per step: tokens, learning rate, training loss, gradient
norm, validation loss every --val-every steps, training seconds) and `{run}.json` (the final
validation loss over --final-val-windows windows, peak memory, the whole setup, the corpus's
checksum); then `speed.csv` (each run's tokens/s and peak memory measured alone on the device,
--speed-steps steps, since --jobs runs share it), `summary.csv`, and with --diagnose
`diagnose.csv` (each GEMM's error under each recipe, on the trained bf16 model's operands).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from dataclasses import fields

import torch

from .corpus import load_corpus
from .model import ModelConfig
from .train import MAIN_RUNS, TrainOptions, loss_of, measure_speed, study_runs, train


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the CSVs (made if missing)")
    parser.add_argument("--runs", default="main", help=f"'main' ({', '.join(MAIN_RUNS)}), 'all', or names separated by commas")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once, each in its own process (default 1)")
    parser.add_argument("--corpus", help="a folder of .py files to read instead of this interpreter's standard library")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--speed-steps", type=int, default=20, help="steps timed per run alone after training (0: none)")
    parser.add_argument("--diagnose", action="store_true", help="after bf16 trains, measure each recipe's GEMM errors on its operands")
    parser.add_argument("--speed-only", action="store_true", help="train nothing: only time the runs alone (speed.csv)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one run of a --jobs study: no table
    for field in fields(ModelConfig):
        if field.name != "vocabulary":
            parser.add_argument(f"--{field.name}", type=int, default=field.default, help=f"model: {field.name} (default {field.default})")
    for field in fields(TrainOptions):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default, help=f"default {field.default}")
    return parser.parse_args(argv)


def selected_runs(spec: str) -> list[str]:
    known = study_runs()
    names = MAIN_RUNS if spec == "main" else list(known) if spec == "all" else [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"qtensor.study: unknown run(s) {unknown}; the runs are: {', '.join(known)}.")
    return names


def config_of(args) -> ModelConfig:
    return ModelConfig(**{f.name: getattr(args, f.name) for f in fields(ModelConfig) if f.name != "vocabulary"})


def options_of(args) -> TrainOptions:
    return TrainOptions(**{f.name: getattr(args, f.name) for f in fields(TrainOptions)})


def child_command(args, name: str) -> list[str]:
    """The command that trains run `name` alone, with this study's settings."""
    command = [sys.executable, "-m", "qtensor.study", "--out", args.out, "--runs", name, "--device", args.device, "--speed-steps", "0", "--child"]
    if args.corpus:
        command += ["--corpus", args.corpus]
    if args.diagnose:
        command += ["--diagnose"]
    for field in [*fields(ModelConfig), *fields(TrainOptions)]:
        if field.name != "vocabulary":
            command += [f"--{field.name.replace('_', '-')}", str(getattr(args, field.name))]
    return command


def train_in_processes(args, names: list[str]) -> None:
    """Train the runs `args.jobs` at a time, each in a process of its own logging to `{run}.log`;
    print the progress lines as they come."""
    waiting, running, failed = list(names), {}, []
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    while waiting or running:
        while waiting and len(running) < args.jobs:
            name = waiting.pop(0)
            log = open(os.path.join(args.out, f"{name}.log"), "w")
            running[name] = (subprocess.Popen(child_command(args, name), stdout=log, stderr=subprocess.STDOUT, env=environment), log, [0])
        time.sleep(2)
        for name, (process, log, printed) in list(running.items()):
            with open(log.name) as file:
                lines = file.read().splitlines()
            for line in lines[printed[0]:]:
                print(line, flush=True)
            printed[0] = len(lines)
            if process.poll() is not None:
                log.close()
                del running[name]
                if process.returncode != 0:
                    failed.append(name)
    if failed:
        raise SystemExit(f"qtensor.study: run(s) {failed} failed; their logs are in {args.out}.")


def run_diagnosis(model, corpus, config, options, device, out) -> None:
    from .corpus import Batches
    from .diagnose import capture_operands, diagnose

    # A run that keeps its last blocks in high precision has its base recipe's errors on the other layers.
    runs = {name: run.recipe for name, run in study_runs().items() if run.recipe is not None and not run.high_precision_last and run.late is None}
    tokens = Batches(corpus.train, 4, config.length, options.seed + 12345).next().to(device)
    operands = capture_operands(model, tokens, loss_of)
    diagnose(operands, runs, os.path.join(out, "diagnose.csv"))
    print(f"diagnose.csv: GEMM errors of {len(runs)} recipes on {len(operands)} layers", flush=True)


def main(argv=None) -> None:
    args = parse(argv)
    names = selected_runs(args.runs)
    os.makedirs(args.out, exist_ok=True)
    corpus = load_corpus(args.corpus)
    config, options, device = config_of(args), options_of(args), torch.device(args.device)
    print(corpus.describe(), flush=True)
    if args.speed_only:
        pass  # the runs were trained before: time them alone
    elif args.jobs > 1 and len(names) > 1:
        train_in_processes(args, names)
    else:
        for name in names:
            result = train(study_runs()[name], corpus, config, options, device, args.out, progress=lambda line: print(line, flush=True))
            if args.diagnose and name == "bf16":
                run_diagnosis(result["model"], corpus, config, options, device, args.out)
            del result
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.speed_steps > 0:
        speeds = []
        for name in names:
            speeds.append(measure_speed(study_runs()[name], corpus, config, options, device, args.speed_steps))
            peak = f", peak {speeds[-1]['peak_gib']:.1f} GiB" if speeds[-1]["peak_gib"] != "" else ""
            print(f"{name:<42} {speeds[-1]['tokens_per_s']:>10,.0f} tokens/s alone{peak}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        with open(os.path.join(args.out, "speed.csv"), "w", newline="") as file:
            writer = csv.DictWriter(file, list(speeds[0]))
            writer.writeheader()
            writer.writerows(speeds)
    if not args.child and os.path.exists(os.path.join(args.out, "bf16.json")):
        from .report import markdown_table, write_summary

        print(markdown_table(write_summary(args.out)), flush=True)


if __name__ == "__main__":
    main()
