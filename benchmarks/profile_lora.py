"""One LoRA step of benchmarks/bench_lora.py's 1.1B Llama under the profiler: the kernels by GPU
time, for each system (GPU).

    python benchmarks/profile_lora.py [--systems bf16,float8_current] [--batch 4] [--top 15] [--compile]

Each system's step is also timed without the profiler (median of 5), so the GPU's time in a step
reads against the step's wall time: where the wall time is longer, the GPU waited on the host; and
so is the host's own time, until step() returns with the step queued.
`--compile` compiles each block, as bench_lora.py's `--compile` (with `--cuda-graphs`, as CUDA graphs). `--trace DIR` also
writes one step's host and GPU timeline per system (a Chrome trace). `--host N` profiles the host
instead: the N functions with the most own time in one step (cProfile) and the N operators with the
most host time (the profiler's CPU activity), where a step's wall time exceeds its GPU time.
"""

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lora import SHAPES, build  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="bf16,float8_current")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    parser.add_argument("--cuda-graphs", action="store_true", help="with --compile: mode='reduce-overhead'")
    parser.add_argument("--host", type=int, default=0, metavar="N", help="profile the host: top N functions and operators")
    parser.add_argument("--trace", metavar="DIR", help="also write each system's step as a Chrome trace (host and GPU) into DIR")
    args = parser.parse_args()
    for system in args.systems.split(","):
        compiled = "reduce-overhead" if args.compile and args.cuda_graphs else args.compile
        profile(system, args.batch, args.seq, args.top, compiled, args.host, args.trace)
        torch.cuda.empty_cache()


def profile(system: str, batch: int, seq: int, top: int, compiled: bool | str = False, host: int = 0, trace: str | None = None) -> None:
    model = build(system, "1b", "cuda", checkpointing=True, compiled=compiled)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    tokens = torch.randint(0, SHAPES["1b"]["vocab_size"], (batch, seq), device="cuda")

    def step():
        if compiled == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times, queued = [], []
    for _ in range(5):
        start = time.perf_counter()
        step()
        queued.append(time.perf_counter() - start)  # the host's own time, until the step is queued
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    wall = sorted(times)[2] * 1e3
    print(f"== {system}: {wall:.1f} ms of wall time a step, the host done after {sorted(queued)[2] * 1e3:.1f} ms (medians of 5)", flush=True)
    if trace:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        os.makedirs(trace, exist_ok=True)
        prof.export_chrome_trace(os.path.join(trace, system.replace(" ", "_") + ".json"))
    if host:
        profile_host(system, step, wall, host)
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    total = sum(event.self_device_time_total for event in prof.key_averages()) / 1e3
    print(f"== {system}{' (blocks compiled)' if compiled else ''}{' as CUDA graphs' if compiled == 'reduce-overhead' else ''}: {total:.1f} ms of GPU time in one step, "
          f"{wall:.1f} ms of wall time (median of 5, no profiler)", flush=True)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=70), flush=True)



def profile_host(system: str, step, wall: float, top: int) -> None:
    """Where one step's host time goes: Python functions by own time, then operators by host time."""
    profiler = cProfile.Profile()
    profiler.enable()
    step()
    torch.cuda.synchronize()
    profiler.disable()
    print(f"== {system}: host profile of one step ({wall:.1f} ms wall without the profiler)", flush=True)
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumtime").print_stats(top)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=70), flush=True)


if __name__ == "__main__":
    main()
