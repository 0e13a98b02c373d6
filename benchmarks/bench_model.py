"""End-to-end training speed of whole models: bf16, torchao's Float8 and each qtensor recipe,
eager and under torch.compile.

    python benchmarks/bench_model.py [--models stack,small,linear] [--systems S1,S2] [--recipes R1,R2]
        [--steps 10] [--mode reduce-overhead] [--csv results.csv] [--profile S1,S2] [--dry-run]

Models (a training step is forward, backward, fused AdamW step (lr 1e-5), zero_grad; fp32
parameters under bf16 autocast; the same batch every step):
  stack   8 Llama-3-8B-shaped decoder blocks (bench_linear.Block), 1 x 4096 tokens, random
          [1, 4096, 4096] input, loss out.float().square().mean() (bench_linear's block stack).
  small   the convergence study's decoder (qtensor/study/model.py) at GPT-2-small size: 12 blocks,
          width 768, 12 heads, SwiGLU 2048, learned positions, byte vocabulary (--vocab 256):
          85.7M parameters; 16 x 512 tokens, cross-entropy on random token ids. The output head
          stays in high precision; the blocks' 48 linear layers are quantized.
  linear  one nn.Linear (bf16, no bias) forward+backward at 4096 x 2048 x 2048 (M x K x N), also
          under mode="reduce-overhead" (CUDA graphs); ms per step against bf16 compiled.

Systems: bf16, "bf16 compiled", "torchao tensorwise compiled", "torchao rowwise compiled" (torchao's
convert_to_float8_training, where importable) and, for each recipe, "<recipe>" (eager) and "<recipe>
compiled". Compiled is torch.compile(model) of the whole model, in --mode when given (the names
then end in the mode). Each system: a fresh model from torch.manual_seed(0), 3 warm-up steps
(compiled systems compile there: their seconds are printed), then --steps steps each between
torch.cuda.synchronize() calls; tokens/s of the median step; peak memory over the timed steps.
Rows print as they are measured and are appended to --csv; ratios to a baseline this run did not
measure come from the CSV's latest row for the same device (marked *). "x torchao" compares each
system with torchao's Float8 of the same scaling, compiled: "torchao rowwise compiled" for the
row-wise recipes, "torchao tensorwise compiled" for the others.
"""

import argparse
import csv
import gc
import logging
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.cudagraph_utils import cudagraphs_log

import qtensor
from bench_linear import Block, torchao_float8
from qtensor.study.model import Decoder, ModelConfig
from timing import median_ms, varied

RECIPES = "float8_current,mxfp8,nvfp4,mxfp8_fwd_nvfp4_bwd"
WARMUP = 3
LINEAR = (4096, 2048, 2048)  # M x K x N
FIELDS = ["device", "torch", "model", "system", "tokens_per_s", "step_ms", "peak_gib", "warmup_s", "x_base", "base", "x_torchao", "note"]
TITLES = {
    "stack": "8 Llama-3-8B-shaped blocks, 1 x 4096 tokens a step",
    "small": "{params:.1f}M-parameter decoder (12 x 768, vocabulary {vocab}), 16 x 512 tokens a step",
    "linear": "one bf16 linear layer forward+backward, {0} x {1} x {2} (M x K x N; tokens: M)".format(*LINEAR),
}


def build(name, device, vocab):
    """(fp32 model, inputs, loss of (model, *inputs), tokens a step, layers kept in high precision)."""
    if name == "stack":
        with torch.device(device):
            model = nn.Sequential(*[Block() for _ in range(8)])
        return model, (torch.randn(1, 4096, 4096, device=device),), lambda m, x: m(x).float().square().mean(), 4096, ()
    if name == "small":
        with torch.device(device):
            model = Decoder(ModelConfig(blocks=12, width=768, heads=12, hidden=2048, length=512, vocabulary=vocab))
        tokens, targets = (torch.randint(vocab, (16, 512), device=device) for _ in range(2))
        loss = lambda m, t, y: F.cross_entropy(m(t).float().flatten(0, 1), y.flatten())
        return model, (tokens, targets), loss, 16 * 512, ("head",)
    m, k, n = LINEAR  # the linear layer is bf16 itself (no autocast needed); the step is timed in linear_step
    model = nn.Sequential(nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16))
    return model, (), None, m, ()


def prepare(model, system, keep):
    """The system applied to a fresh model: its Float8 or qtensor layers, then torch.compile."""
    base, _, mode = system.partition(" compiled")  # "nvfp4 compiled reduce-overhead": nvfp4, mode reduce-overhead
    if base.startswith("torchao "):
        config_class, convert = torchao_float8()
        config = config_class.from_recipe_name(base.removeprefix("torchao "))
        model = convert(model, config=config, module_filter_fn=lambda module, fqn: fqn not in keep)
    elif base != "bf16":
        qtensor.quantize_(model, getattr(qtensor.recipes, base)(), exclude=keep)
    return torch.compile(model, mode=mode.strip() or None) if base != system else model


def systems_for(name, args, have_torchao):
    """The systems run on one model, baselines first (so that each row prints with its ratios)."""
    if name == "linear":  # bf16 compiled against each recipe eager, compiled and with CUDA graphs
        suffixes, torchao = ("", " compiled", " compiled reduce-overhead"), [f"torchao {g} compiled" for g in ("tensorwise", "rowwise")]
    else:
        suffixes = ("", " compiled" + (f" {args.mode}" if args.mode else ""))
        torchao = [f"torchao {g}{suffixes[1]}" for g in ("tensorwise", "rowwise")]
    names = [f"bf16{s}" for s in suffixes] + torchao * have_torchao + [f"{r}{s}" for r in args.recipes.split(",") for s in suffixes]
    wanted = args.systems.split(",")  # names with or without the --mode suffix
    return [s for s in names if args.systems == "all" or s in wanted or (args.mode and s.removesuffix(f" {args.mode}") in wanted)]


def measure(name, system, args):
    """One system's row: tokens/s of the median step, its ms, peak GiB, warm-up (compile) seconds."""
    torch.manual_seed(0)
    model, inputs, loss_fn, tokens, keep = build(name, "cuda", args.vocab)
    model = prepare(model, system, keep)
    if name == "linear":
        step = linear_step(model)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

        def step():
            torch.compiler.cudagraph_mark_step_begin()  # CUDA graphs (reduce-overhead): a new iteration
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model, *inputs)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    start = time.perf_counter()
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    torch.cuda.reset_peak_memory_stats()
    if name == "linear":  # CUDA events, the host may run ahead as in training
        seconds = median_ms(step, repeats=5 * args.steps, overlapped=True) / 1e3
    else:
        times = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30
    if system in args.profile:
        kernel_table(step, system)
    return dict(tokens_per_s=tokens / seconds, step_ms=seconds * 1e3, peak_gib=peak, warmup_s=warmup_s)


def kernel_table(step, system, steps=3):
    """`steps` more steps under the profiler: the GPU's kernels by total time, per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    print(f"--- host of {system}: {sum(e.self_cpu_time_total for e in host) / steps / 1e3:.2f} ms of self CPU time a step", flush=True)
    for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:12]:
        print(f"{e.self_cpu_time_total / steps / 1e3:>9.3f} ms {e.count // steps:>6}x  {e.key[:110]}")
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / steps / 1e3
    launches = sum(e.count for e in kernels) / steps
    print(f"--- kernels of {system}: {busy:.2f} ms of GPU time and {launches:.0f} kernels a step", flush=True)
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"{e.self_device_time_total / steps / 1e3:>9.3f} ms {e.count // steps:>6}x  {e.key[:110]}")


def linear_step(model):
    """A forward+backward of the one-layer model on a static input (the same tensors every step, as
    CUDA graphs want them), each weight marked written as an optimizer step would (a dynamic
    qtensor weight then casts again: bench_linear.make_linear)."""
    m, k, n = LINEAR
    x = varied(m, k).requires_grad_(True)
    grad = varied(m, n)
    torch._dynamo.mark_static_address(x)
    params = list(model.parameters())

    def step():
        torch.compiler.cudagraph_mark_step_begin()
        for p in params:
            torch.autograd.graph.increment_version(p)
        model(x).backward(grad)
        x.grad = None
        for p in params:
            p.grad = None

    return step


def first_line(text):
    return (text.strip().splitlines() or [""])[0][:160]


def line(system, row):
    if "tokens_per_s" not in row:
        return f"{system:<44}  failed: {row['note']}"
    ratios = "".join(f"{row[k]:>{w - 1}.2f}{'*' if row[k + '*'] else ' '}" if k in row else f"{'-':>{w}}" for k, w in (("x_base", 9), ("x_torchao", 11)))
    return f"{system:<44}{row['tokens_per_s']:>12,.0f}{row['step_ms']:>10.2f}{ratios}{row['peak_gib']:>10.2f}{row['warmup_s']:>11.1f}  {row['note']}"


def torchao_twin(system, compiled):
    """The torchao system a qtensor system is compared with: torchao's Float8 of the same scaling
    (rowwise for the row-wise recipes, tensorwise for the others), compiled."""
    return f"torchao {'rowwise' if system.startswith('float8_rowwise') else 'tensorwise'} {compiled}"


def run_model(name, args, have_torchao, earlier, write):
    """Measures each system on one model, printing and writing each row at once, then the table."""
    compiled = "compiled" + (f" {args.mode}" if args.mode and name != "linear" else "")
    base = "bf16 compiled" if name == "linear" else "bf16"
    skips, handler = [], logging.Handler()  # inductor's "skipping cudagraphs due to ..." warnings
    handler.emit = lambda record: skips.append(record.getMessage())
    cudagraphs_log.addHandler(handler)
    title = f"{name}: {TITLES[name].format(params=args.params[name] / 1e6, vocab=args.vocab)}; {torch.cuda.get_device_name()}"
    header = f"{'system':<44}{'tokens/s':>12}{'step ms':>10}{'x base':>9}{'x torchao':>11}{'peak GiB':>10}{'warm-up s':>11}"
    print(f"\n{title}\n{header}", flush=True)
    rows = {}
    for system in systems_for(name, args, have_torchao):
        skips.clear()
        try:
            row = measure(name, system, args)
            row["note"] = first_line(skips[0]) if skips else ""  # CUDA graphs skipped: why
        except Exception as error:  # one system's failure is a row; the others still run
            row = dict(note=f"{type(error).__name__}: {first_line(str(error))}")
        gc.collect()  # the model and optimizer are gone with measure's frame
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        row.update(device=torch.cuda.get_device_name(), torch=torch.__version__, model=name, system=system, base=base)
        rows[system] = row
        for key, reference in (("x_base", base), ("x_torchao", torchao_twin(system, compiled))):
            found = rows.get(reference) or earlier.get((row["device"], name, reference))
            if "tokens_per_s" in row and found and found.get("tokens_per_s"):
                row[key] = row["tokens_per_s"] / float(found["tokens_per_s"])
                row[key + "*"] = reference not in rows
        print(line(system, row), flush=True)
        write(row)
    cudagraphs_log.removeHandler(handler)
    mode = f", compiled in mode {args.mode}" if args.mode and name != "linear" else ""
    print(f"\n{title}, median of {args.steps * (5 if name == 'linear' else 1)} steps{mode}")
    print(f"x base: tokens/s over {base}'s; x torchao: over torchao's Float8 of the same scaling, compiled (rowwise for "
          f"the row-wise recipes, tensorwise for the others; * from an earlier call's CSV row)\n{header}")
    print("\n".join(line(system, row) for system, row in rows.items()), flush=True)


def read_earlier(path):
    """(device, model, system) -> the latest successful CSV row, for baselines measured in an earlier call."""
    if not path or not os.path.exists(path):
        return {}
    with open(path, newline="") as file:
        return {(r["device"], r["model"], r["system"]): r for r in csv.DictReader(file) if r.get("tokens_per_s")}


def main():
    start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="stack,small", help="comma-separated: stack, small, linear")
    parser.add_argument("--systems", default="all", help='comma-separated system names, e.g. "bf16,bf16 compiled,nvfp4 compiled"')
    parser.add_argument("--recipes", default=RECIPES, help="qtensor recipes (comma-separated)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (linear: 5x as many)")
    parser.add_argument("--mode", default=None, help="torch.compile mode of the compiled systems (e.g. reduce-overhead)")
    parser.add_argument("--vocab", type=int, default=256, help="the small model's vocabulary")
    parser.add_argument("--csv", default=None, help="append the rows to this CSV file (header when new)")
    parser.add_argument("--profile", default="", help="comma-separated systems whose busiest host operations and GPU kernels are listed (3 more steps)")
    parser.add_argument("--dry-run", action="store_true", help="build each model on the meta device, count, list the systems, exit")
    args = parser.parse_args()
    args.profile = [name for name in args.profile.split(",") if name]
    models = args.models.split(",")
    if unknown := set(models) - set(TITLES):
        parser.error(f"unknown models {sorted(unknown)}; choose from {sorted(TITLES)}")
    have_torchao = torchao_float8() is not None
    args.params = {}
    for name in models:  # parameter counts, on the meta device (nothing allocated)
        model, _, _, _, keep = build(name, "meta", args.vocab)
        args.params[name] = sum(p.numel() for p in model.parameters())
        report = qtensor.quantize_(model, qtensor.recipes.float8_current(), exclude=keep)
        print(f"{name}: {args.params[name]:,} parameters; quantized linear layers: {len(report.quantized)}; in high precision: {', '.join(keep) or 'none'}")
        print(f"  systems: {', '.join(systems_for(name, args, have_torchao))}")
    chosen = {s.removesuffix(f" {args.mode}") for name in models for s in systems_for(name, args, have_torchao)}
    if args.systems != "all" and (unknown := set(args.systems.split(",")) - chosen - {f"{s} {args.mode}" for s in chosen}):
        print(f"no such system here (misspelt, or torchao missing): {sorted(unknown)}")
    print(f"torch {torch.__version__}, " + (f"torchao {__import__('torchao').__version__}" if have_torchao else "torchao not importable: its systems are left out"), flush=True)
    if args.dry_run:
        return
    earlier = read_earlier(args.csv)
    new = args.csv and not os.path.exists(args.csv)
    with open(args.csv or os.devnull, "a", newline="") as file:
        writer = csv.DictWriter(file, FIELDS, lineterminator="\n", extrasaction="ignore")
        if new:
            writer.writeheader()

        def write(row):  # at once, so that a call cut off by its time limit keeps its rows
            writer.writerow({key: f"{value:.6g}" if isinstance(value, float) else value for key, value in row.items()})
            file.flush()

        for name in models:
            run_model(name, args, have_torchao, earlier, write)
    print(f"\nelapsed {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
