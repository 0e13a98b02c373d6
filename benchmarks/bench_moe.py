"""Speed of a mixture of experts' expert stacks: bf16 grouped GEMMs against qtensor's recipes (GPU).

    python benchmarks/bench_moe.py [--shapes mixtral,qwen3] [--systems bf16,float8_current,...] [--steps 10] [--profile] [--gemms] [--cuda-graphs] [--compile]

One experts layer as torchtitan and transformers' `grouped_mm` implementation run it: tokens sorted
by expert, `gate_up = grouped_mm(x, gate_up_proj^T, offs)`, SiLU(gate)·up, `grouped_mm(h, down_proj^T,
offs)`; a forward and backward a step, bf16 autocast, fp32 parameters (bf16 and torchao multiply their bf16
casts, as autocast gives a linear). Shapes:

- mixtral: 32,768 routed rows, 8 experts, hidden 4096, expert width 14336 (top-2 of 16,384 tokens);
- qwen3: 131,072 routed rows, 128 experts, hidden 2048, expert width 768 (top-8 of 16,384 tokens);

groups balanced (equal sizes, multiples of 16). "torchao rowwise" (where importable) runs torchao's
`_to_fp8_rowwise_then_scaled_grouped_mm` for both GEMMs; "<recipe> quantized" holds the stacks in low
precision (`weights="quantized"`: each expert's two FP8 copies, no fp32 values); "... fast-backward" adds
`backward_fast_accumulation=True` (dgrad and wgrad on the FP8 tensor cores' fast accumulation, as
torchao runs them). Prints tokens/s
(routed rows), × bf16 and peak memory per system. `--compile` runs every system's layer through
`torch.compile` (inductor fuses the SiLU·mul and the autocast casts around the grouped GEMMs; each
call over a quantized stack runs eagerly, between graph breaks).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qtensor  # noqa: E402
from timing import median_step_s  # noqa: E402

SHAPES = {"mixtral": (32768, 8, 4096, 14336), "qwen3": (131072, 128, 2048, 768)}
RECIPES = ["float8_current", "float8_rowwise", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd"]


class Experts(nn.Module):
    def __init__(self, experts: int, hidden: int, width: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * width, hidden) * hidden**-0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, width) * width**-0.5)
        self.grouped_mm = F.grouped_mm
        self.casts_stacks = True  # False once quantize_ made the stacks quantized (quantize_as)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_proj, self.down_proj
        if self.casts_stacks:
            # grouped_mm is outside autocast: the fp32 parameters cast to bf16, as autocast casts a linear's
            # (decided outside forward: torch.compile reads hasattr of a stack's attribute as False)
            gate_up, down = gate_up.to(torch.bfloat16), down.to(torch.bfloat16)
        gate, up = self.grouped_mm(x, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return self.grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offs)


def torchao_grouped_mm():
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm
    except ImportError:
        return None
    # The benchmark's groups are multiples of 16 already (torchao 0.18 pads only when told not to).
    return lambda a, b, offs: _to_fp8_rowwise_then_scaled_grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)


def quantize_as(model: nn.Module, system: str) -> None:
    """`"<recipe>[ quantized][ fast-backward]"`: quantize_ the model with that recipe, its stacks
    dynamic or held quantized, dgrad and wgrad with fast accumulation where asked."""
    recipe, *words = system.split()
    chosen = qtensor.Recipe(getattr(qtensor.recipes, recipe)(), backward_fast_accumulation="fast-backward" in words)
    qtensor.quantize_(model, chosen, weights="quantized" if "quantized" in words else "dynamic")


def routed_rows(rows: int, experts: int, hidden: int):
    """(x, offs, grad): bf16 routed rows in balanced groups, their group ends, an output gradient."""
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (rows // experts)
    return x, offs, torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)


def layer_step(system: str, shape: str, graphs: bool = False, compiled: bool = False):
    """One experts layer of `system` at `shape` and its routed rows: a function that runs one
    forward and backward step on them (with `graphs`, the replay of the step captured in one CUDA
    graph: no host time, where nothing in the step waits for the GPU; with `compiled`, the layer
    through torch.compile)."""
    rows, experts, hidden, width = SHAPES[shape]
    torch.manual_seed(0)
    model = Experts(experts, hidden, width).cuda()
    if system == "torchao rowwise":
        model.grouped_mm = torchao_grouped_mm()
    elif system != "bf16":  # "<recipe>" quantizes at use from the fp32 stacks; "<recipe> quantized" holds them in low precision;
        # "... fast-backward" runs dgrad and wgrad with fast accumulation too (as torchao does)
        quantize_as(model, system)
        model.casts_stacks = False
    x, offs, grad = routed_rows(rows, experts, hidden)
    forward = torch.compile(model) if compiled else model

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not graphs):  # (a graph takes no cast cache)
            y = forward(x, offs)
        y.backward(grad)
        x.grad = None
        for p in model.parameters():
            p.grad = None

    return captured(step) if graphs else step


def captured(step):
    """`step` captured in one CUDA graph after warm-up steps on a side stream: its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def measure(system: str, shape: str, steps: int, profile: bool = False, graphs: bool = False, compiled: bool = False) -> dict:
    rows = SHAPES[shape][0]
    step = layer_step(system, shape, graphs, compiled)
    seconds, peak = median_step_s(step, steps)
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60), flush=True)
    return {"tokens_per_s": rows / seconds, "ms": seconds * 1e3, "peak_gib": peak}


def gemms(shape: str, steps: int) -> None:
    """The six grouped GEMMs of a step alone: bf16 `torch._grouped_mm` against FP8
    `torch._scaled_grouped_mm` with the split accumulator and with fast accumulation."""
    rows, experts, hidden, width = SHAPES[shape]
    offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (rows // experts)
    fp8 = lambda *size: torch.randn(*size, device="cuda").to(torch.float8_e4m3fn)
    ones = lambda *size: torch.ones(*size, device="cuda")
    for name, out, inner in (("gate_up", 2 * width, hidden), ("down", hidden, width)):
        cases = {  # (A, B as the GEMM reads it, scales of A, of B)
            "fprop/dgrad [M,K]x[E,K,N]": (fp8(rows, inner), fp8(experts, out, inner).transpose(-2, -1), ones(rows), ones(experts, out)),
            "wgrad [N,M]x[M,K]": (fp8(out, rows), fp8(inner, rows).t(), ones(out * experts), ones(inner * experts)),
        }
        for case, (a, b, sa, sb) in cases.items():
            a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
            timed = {
                "bf16": lambda: torch._grouped_mm(a16, b16, offs=offs),
                "fp8 split": lambda: torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16),
                "fp8 fast": lambda: torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True),
            }
            times = {k: median_step_s(f, steps)[0] * 1e3 for k, f in timed.items()}
            print(f"{shape:<8} {name:<8} {case:<28} " + "  ".join(f"{k} {v:6.3f} ms" for k, v in times.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="mixtral,qwen3")
    parser.add_argument("--systems", default=None, help="comma-separated (default: bf16, torchao rowwise where importable, every recipe)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="after each system, its kernels of one step by GPU time")
    parser.add_argument("--gemms", action="store_true", help="time the grouped GEMMs alone (bf16, FP8 split and fast accumulation)")
    parser.add_argument("--cuda-graphs", action="store_true", help="each system's step captured in one CUDA graph and replayed")
    parser.add_argument("--compile", action="store_true", help="each system's layer through torch.compile")
    args = parser.parse_args()
    if args.gemms:
        for shape in args.shapes.split(","):
            gemms(shape, args.steps)
        return
    systems = args.systems.split(",") if args.systems else ["bf16", *(["torchao rowwise"] if torchao_grouped_mm() else []), *RECIPES]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; forward+backward of one experts layer, median of {args.steps} steps"
          + (", each captured in a CUDA graph" if args.cuda_graphs else "") + (", the layer compiled" if args.compile else ""))
    print(f"{'shape':<8} {'system':<38} {'rows/s':>12} {'ms':>9} {'x bf16':>7} {'peak GiB':>9}")
    for shape in args.shapes.split(","):
        base = None
        for system in systems:
            try:
                row = measure(system, shape, args.steps, args.profile, args.cuda_graphs, args.compile)
            except Exception as error:  # one system's failure is a row
                print(f"{shape:<8} {system:<38} failed: {type(error).__name__}: {str(error)[:120]}", flush=True)
                continue
            base = base or (row["tokens_per_s"] if system == "bf16" else None)
            ratio = f"{row['tokens_per_s'] / base:7.2f}" if base else f"{'-':>7}"
            peak = f"{'-':>9}" if args.cuda_graphs else f"{row['peak_gib']:>9.2f}"  # (a graph's memory is taken at its capture)
            print(f"{shape:<8} {system:<38} {row['tokens_per_s']:>12,.0f} {row['ms']:>9.2f} {ratio} {peak}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
