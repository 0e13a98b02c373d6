"""Training speed and memory under FSDP2: bf16, torchao's Float8 and every qtensor recipe, eager and compiled.

    torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py [--blocks 4] [--tokens 8192] [--steps 10]
        [--systems bf16,bf16 compiled,float8_current,float8_current compiled,...]

The configuration people train large models with: Llama-3-8B-shaped blocks (width 4096, GQA 32/8
heads, SwiGLU 14336, stock modules), `tokens` tokens per rank a step, fp32 parameters,
`fully_shard` on each block and on the root with `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`, fused AdamW, a full forward, backward and optimizer step each step.
"compiled": each block wrapped by `torch.compile` before `fully_shard`, as torchtitan does. torchao
(where importable): Float8 tensorwise with the float8 all-gather and
`precompute_float8_dynamic_scale_for_fsdp` after each step, and rowwise.

Rank 0 prints one row per system: tokens/s over all ranks (median step), × bf16 eager, × torchao
tensorwise compiled (when it ran), peak GiB (the largest over ranks), and for qtensor the bytes its
weights handed to all-gathers per step on this rank beside what bf16 would have sent. On the CPU
(gloo) it runs too, with `--width` and `--hidden` small, to check the script; its figures there mean
nothing.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_linear import Block, torchao_float8  # noqa: E402

import qtensor  # noqa: E402
from qtensor.distributed import fsdp as qtensor_fsdp  # noqa: E402

QTENSOR_RECIPES = ["float8_current", "float8_rowwise", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd"]


def default_systems() -> list[str]:
    systems = ["bf16", "bf16 compiled"]
    if torchao_float8() is not None:
        systems += ["torchao tensorwise", "torchao tensorwise compiled", "torchao rowwise compiled"]
    for recipe in QTENSOR_RECIPES:
        systems += [recipe, f"{recipe} compiled"]
    return systems


def build(system: str, args, device: torch.device, mesh):
    """(model, after-step hook) of one system, sharded."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    name = system.removesuffix(" compiled")
    torch.manual_seed(0)
    with device:
        model = nn.Sequential(*[Block(args.width, args.hidden) for _ in range(args.blocks)])
    after_step = None
    if name.startswith("torchao "):
        config_class, convert = torchao_float8()
        recipe = name.removeprefix("torchao ")
        config = config_class.from_recipe_name(recipe)
        if recipe == "tensorwise":
            config = config_class(enable_fsdp_float8_all_gather=True)
        convert(model, config=config)
        if recipe == "tensorwise":
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            def after_step():
                precompute_float8_dynamic_scale_for_fsdp(model)
    elif name != "bf16":
        qtensor.quantize_(model, getattr(qtensor.recipes, name)())
    if system.endswith(" compiled"):
        # As torchtitan: each block wrapped in its compiled module, then sharded. (`block.compile()`
        # would compile the block's call with FSDP2's hooks in it, which dynamo skips, breaking the
        # graph before every linear layer.)
        for index, block in enumerate(model):
            model[index] = torch.compile(block, backend=args.backend)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, after_step


def measure(system: str, args, device: torch.device, mesh) -> dict:
    model, after_step = build(system, args, device, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    x = torch.randn(1, args.tokens, args.width, device=device)

    def step():
        loss = model(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    for _ in range(args.warmup):
        step()
    synchronize()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    qtensor_fsdp.gather_stats(reset=True)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    gathered = qtensor_fsdp.gather_stats()
    for wanted, run in ((args.profile, profile), (args.host_profile, host_profile), (args.memory, memory_at_peak)):
        if system not in wanted:
            continue
        if dist.get_rank() == 0:
            try:
                run(step, synchronize, system)
            except Exception as error:  # a diagnostic that failed must not cost the table
                print(f"--- {run.__name__} of {system} failed: {error!r}", flush=True)
        else:  # the other ranks take the same steps
            for _ in range(2):
                step()
            synchronize()
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    del model, optimizer
    # FSDP2's state and the modules reference each other, and compiled graphs hold their inputs:
    # without collecting both, the next system's peak would include this one's memory.
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "tokens_per_s": args.tokens * dist.get_world_size() / statistics.median(times),
        "peak_gib": float(peak),
        "gathered_mib": gathered["bytes"] / args.steps / 2**20,
        "bf16_mib": gathered["bf16_bytes"] / args.steps / 2**20,
    }


def profile(step, synchronize, system: str) -> None:
    """Two steps under the profiler (rank 0): the host's and the GPU's busiest operations."""
    from torch.profiler import ProfilerActivity, profile as profiler

    verbose = torch._C._profiler._ExperimentalConfig(verbose=True)  # records the Python stacks
    with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True, experimental_config=verbose) as prof:
        for _ in range(2):
            step()
        synchronize()
    events = prof.key_averages()
    print(f"--- profile of {system}: two steps, rank 0")
    print(events.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    print(events.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
    # Where the copies and conversions come from: each call site's GPU time.
    copies = [e for e in prof.key_averages(group_by_stack_n=6) if e.key in ("aten::copy_", "aten::_chunk_cat", "aten::mul", "aten::add_")]
    print(f"--- {system}: copy and elementwise call sites by GPU time (two steps)")
    for event in sorted(copies, key=lambda e: -e.device_time_total)[:10]:
        stack = " <- ".join(frame.split("/")[-1] for frame in event.stack if "built-in" not in frame)
        print(f"{event.device_time_total / 1e3:8.2f} ms {event.count:5d}x {event.key}: {stack}")
    gpu = sum(e.self_device_time_total for e in events) / 2 / 1e3
    print(f"--- {system}: GPU busy {gpu:.1f} ms a step (sum of kernel times)", flush=True)


def memory_at_peak(step, synchronize, system: str) -> None:
    """Two steps with the allocator's history recorded (rank 0): what was live at the peak, by the
    Python line that allocated it (`where`)."""
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    resident = torch.cuda.memory_allocated()
    for _ in range(2):
        step()
    synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live, total, peak, at_peak = {}, 0, 0, {}
    for event in (e for trace in snapshot["device_traces"] for e in trace):
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], where(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    groups: dict[str, int] = {}
    for size, place in at_peak.values():
        groups[place] = groups.get(place, 0) + size
    print(f"--- memory of {system} (rank 0): {resident / 2**30:.2f} GiB resident before the steps, "
          f"{peak / 2**30:.2f} GiB more at the peak, of which:")
    for place, size in sorted(groups.items(), key=lambda item: -item[1])[:18]:
        print(f"{size / 2**20:>10.1f} MiB  {place}")


def where(frames) -> str:
    """The allocating line: the innermost frame in qtensor, else in FSDP2 or the benchmarks, else the
    innermost one."""
    for places in (("/qtensor/",), ("/distributed/fsdp/", "/benchmarks/")):
        for frame in frames:
            if any(place in frame["filename"] for place in places):
                return f"{frame['filename'].split('/')[-1]}:{frame['line']} {frame['name']}"
    return f"{frames[0]['filename'].split('/')[-1]}:{frames[0]['line']} {frames[0]['name']}" if frames else "? (no Python frame: autograd's engine)"


def host_profile(step, synchronize, system: str) -> None:
    """Two steps under cProfile (rank 0): where the host's Python time goes."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(2):
        step()
    synchronize()
    profiler.disable()
    print(f"--- host profile of {system}: two steps, rank 0")
    stats = pstats.Stats(profiler).strip_dirs()
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=None, help="comma-separated (default: every system importable here)")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank a step")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=14336)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled systems")
    parser.add_argument("--profile", default="", help="comma-separated systems to profile for two more steps (rank 0 prints)")
    parser.add_argument("--host-profile", default="", help="comma-separated systems to run two more steps of under cProfile")
    parser.add_argument("--memory", default="", help="comma-separated systems whose peak memory is broken down by allocating line")
    args = parser.parse_args()
    args.profile = [name for name in args.profile.split(",") if name]
    args.host_profile = [name for name in args.host_profile.split(",") if name]
    args.memory = [name for name in args.memory.split(",") if name]
    if "RANK" not in os.environ:
        parser.error("run under torchrun: torchrun --nproc-per-node N benchmarks/bench_fsdp.py")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    systems = args.systems.split(",") if args.systems else default_systems()
    rank0 = dist.get_rank() == 0
    if rank0:
        what = torch.cuda.get_device_name() if cuda else "CPU (gloo): a check of the script, not a measurement"
        print(f"FSDP2 over {dist.get_world_size()} ranks, {what}, torch {torch.__version__}")
        print(f"{args.blocks} blocks (width {args.width}, hidden {args.hidden}), {args.tokens} tokens per rank, "
              f"bf16 params / fp32 reduce, fused AdamW, median of {args.steps} steps")
        print(f"{'system':<34}{'tokens/s':>11}{'x bf16':>8}{'x torchao':>11}{'peak GiB':>10}{'gathered MiB/step':>19}{'bf16 MiB':>10}")
    results = {}
    for system in systems:
        results[system] = result = measure(system, args, device, mesh)
        if not rank0:
            continue
        base = results.get("bf16", {}).get("tokens_per_s")
        anchor = results.get("torchao tensorwise compiled", {}).get("tokens_per_s")
        ratio = f"{result['tokens_per_s'] / base:.2f}" if base else "-"
        versus = f"{result['tokens_per_s'] / anchor:.2f}" if anchor else "-"
        gathered = f"{result['gathered_mib']:.1f}" if result["gathered_mib"] else "-"
        bf16 = f"{result['bf16_mib']:.1f}" if result["bf16_mib"] else "-"
        print(f"{system:<34}{result['tokens_per_s']:>11.0f}{ratio:>8}{versus:>11}{result['peak_gib']:>10.1f}{gathered:>19}{bf16:>10}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
