"""Tensor parallelism over 2 GPUs: tokens/s of a training step of Llama-3-8B-shaped blocks.

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py [--blocks 4] [--sequence 8192] [--systems ...]

Each block is parallelized as torchtitan parallelizes Llama: q/k/v and gate/up column-wise, o and
down row-wise, the norms sequence-parallel. A system is `bf16` (no quantization), a recipe with
torch's styles (`mxfp8`: the sequence-parallel gathers carry bf16), or a recipe with qtensor's
quantized gathers (`mxfp8 quantized-sp`: PrepareQuantizedModuleInput and QuantizedRowwiseParallel).
A step is the forward and backward under bf16 autocast (no optimizer) of one sequence of
`--sequence` tokens, each rank holding its half; the median of `--steps` timed steps after warm-up.
Rank 0 prints one row per system: tokens/s, ms a step, x bf16, peak GiB, and the bytes each rank
sent in quantized sequence-parallel all-gathers a step against the same gathers in bf16.
"""

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import qtensor
from bench_linear import Attention
from qtensor.distributed import sequence_parallel
from qtensor.distributed.tensor_parallel import PrepareQuantizedModuleInput, QuantizedRowwiseParallel


class MLP(nn.Module):
    def __init__(self, dim=4096, hidden=14336):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(4096), Attention()
        self.mlp_norm, self.mlp = nn.RMSNorm(4096), MLP()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def plan(quantized_gathers: bool) -> dict:
    prepare = PrepareQuantizedModuleInput if quantized_gathers else PrepareModuleInput
    row = QuantizedRowwiseParallel if quantized_gathers else RowwiseParallel
    gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "attention_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
        "attention": prepare(**gather), "mlp": prepare(**gather),
        "attention.q_proj": ColwiseParallel(), "attention.k_proj": ColwiseParallel(), "attention.v_proj": ColwiseParallel(),
        "attention.o_proj": row(output_layouts=Shard(1)),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": row(output_layouts=Shard(1)),
    }


def measure(system: str, args, mesh) -> dict:
    recipe, _, variant = system.partition(" ")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = nn.Sequential(*[Block() for _ in range(args.blocks)])
    if recipe != "bf16":
        qtensor.quantize_(model, getattr(qtensor.recipes, recipe)())
    for block in model:
        parallelize_module(block, mesh, plan(variant == "quantized-sp"))
    local_tokens = args.sequence // mesh.size()
    x = torch.randn(1, local_tokens, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(mesh.get_local_rank()))

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    sequence_parallel.gather_stats(reset=True)
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    stats = sequence_parallel.gather_stats()
    ms = torch.tensor(statistics.median(times), device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slower rank sets the step
    del model
    torch.cuda.empty_cache()
    return {
        "ms": ms.item(), "tokens_s": args.sequence / ms.item() * 1e3, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "gathered_mib": stats["bytes"] / args.steps / 2**20, "bf16_mib": stats["high_precision_bytes"] / args.steps / 2**20,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--sequence", type=int, default=8192, help="tokens a step, split over the ranks")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--systems", default="bf16,float8_current,float8_current quantized-sp,mxfp8,mxfp8 quantized-sp,"
                        "nvfp4,nvfp4 quantized-sp,mxfp8_fwd_nvfp4_bwd,mxfp8_fwd_nvfp4_bwd quantized-sp")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    rows, bf16 = [], None
    for system in args.systems.split(","):
        row = measure(system, args, mesh)
        bf16 = row["tokens_s"] if system == "bf16" else bf16
        rows.append((system, row))
        if rank == 0:
            ratio = f"{row['tokens_s'] / bf16:.2f}" if bf16 else "-"
            gathered = f"{row['gathered_mib']:.1f} ({row['bf16_mib']:.1f})" if row["bf16_mib"] else "-"
            print(f"{system:36s} {row['tokens_s']:9.0f} {row['ms']:8.1f} {ratio:>6s} {row['peak_gib']:6.1f}  {gathered}", flush=True)
    if rank == 0:
        print(f"\nTP-{mesh.size()}, {args.blocks} Llama-3-8B-shaped blocks, {args.sequence} tokens a step, forward+backward, bf16 autocast")
        print(f"{'system':36s} {'tokens/s':>9s} {'ms':>8s} {'x bf16':>6s} {'GiB':>6s}  quantized gathers MiB/step/rank (bf16)")
        for system, row in rows:
            ratio = f"{row['tokens_s'] / bf16:.2f}" if bf16 else "-"
            gathered = f"{row['gathered_mib']:.1f} ({row['bf16_mib']:.1f})" if row["bf16_mib"] else "-"
            print(f"{system:36s} {row['tokens_s']:9.0f} {row['ms']:8.1f} {ratio:>6s} {row['peak_gib']:6.1f}  {gathered}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
