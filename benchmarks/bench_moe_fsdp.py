"""Expert stacks under FSDP2 (GPUs, NCCL): a training step of MoE experts layers sharded by experts.

    torchrun --nproc_per_node 2 benchmarks/bench_moe_fsdp.py [--layers 2] [--steps 8] [--systems ...]

Each rank runs `--layers` experts layers of bench_moe.py's Qwen3-30B-A3B-like shape (128 experts,
hidden 2048, width 768; 131,072 routed rows a rank, balanced groups), each layer and the root
`fully_shard`ed with bf16 parameters for compute (`MixedPrecisionPolicy(param_dtype=bf16)`), fp32
masters, AdamW. A step is forward, backward and the optimizer step. Systems:

- "bf16": the stacks gathered in bf16 and multiplied by `F.grouped_mm`;
- "<recipe>": dynamic stacks (`weights="dynamic"`): each rank casts its own experts and the gather
  brings their low-precision codes and scales;
- "<recipe> values": the same, but the stacks gathered as bf16 values and each rank casting the
  whole stack after the gather (how dynamic stacks gathered before: for comparison);
- "<recipe> quantized": stacks held quantized (`MasterWeights` recasts each rank's experts after a step).

"fast-backward" after the recipe adds `backward_fast_accumulation=True`. Rank 0 prints ms a step,
× bf16, peak GiB and the bytes the stacks' all-gathers sent a step.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qtensor  # noqa: E402
from bench_moe import SHAPES, Experts, quantize_as, routed_rows  # noqa: E402
from qtensor.distributed import fsdp as qtensor_fsdp  # noqa: E402
from qtensor.layers import quantized_stack  # noqa: E402
from timing import median_step_s  # noqa: E402

SYSTEMS = ["bf16", "float8_rowwise fast-backward", "float8_rowwise fast-backward values", "float8_rowwise quantized fast-backward", "nvfp4", "nvfp4 values"]


class Model(nn.Module):
    def __init__(self, layers: int, experts: int, hidden: int, width: int):
        super().__init__()
        self.layers = nn.ModuleList(Experts(experts, hidden, width) for _ in range(layers))

    def forward(self, x, offs):
        for layer in self.layers:
            x = x + layer(x, offs)
        return x


def measure(system: str, layers: int, steps: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rows, experts, hidden, width = SHAPES["qwen3"]
    torch.manual_seed(0)
    model = Model(layers, experts, hidden, width).cuda()
    words = system.split()
    gathers_as_experts = quantized_stack.gathers_as_experts
    if words[0] != "bf16":
        quantize_as(model, " ".join(w for w in words if w != "values"))
        if "values" in words:  # the gather of values, as before the experts' casts were gathered
            quantized_stack.gathers_as_experts = lambda *args: False
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    if "quantized" in words:
        optimizer = qtensor.optim.MasterWeights(optimizer)
    x, offs, grad = routed_rows(rows, experts, hidden)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x, offs)
        y.backward(grad)
        optimizer.step()
        optimizer.zero_grad()
        x.grad = None

    try:
        step()
        qtensor_fsdp.gather_stats(reset=True)
        step()
        sent = qtensor_fsdp.gather_stats(reset=True)
        seconds, peak = median_step_s(step, steps)
    finally:
        quantized_stack.gathers_as_experts = gathers_as_experts
    return {"ms": seconds * 1e3, "peak_gib": peak, "gathered_mib": sent["bytes"] / 2**20, "bf16_mib": sent["bf16_bytes"] / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{torch.cuda.get_device_name()} x{dist.get_world_size()}, torch {torch.__version__}; {args.layers} Qwen3-like experts layers under FSDP2, "
        f"forward+backward+AdamW, median of {args.steps} steps (rank 0)")
    say(f"{'system':<42} {'ms':>9} {'x bf16':>7} {'peak GiB':>9} {'gathered MiB/step':>18}")
    base = None
    for system in args.systems.split(","):
        try:
            row = measure(system, args.layers, args.steps)
        except Exception as error:  # one system's failure is a row
            say(f"{system:<42} failed: {type(error).__name__}: {str(error)[:160]}", flush=True)
            continue
        base = base or (row["ms"] if system == "bf16" else None)
        ratio = f"{base / row['ms']:7.2f}" if base else f"{'-':>7}"
        gathered = "-" if system == "bf16" else f"{row['gathered_mib']:,.0f}"
        say(f"{system:<42} {row['ms']:>9.2f} {ratio} {row['peak_gib']:>9.2f} {gathered:>18}", flush=True)
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
