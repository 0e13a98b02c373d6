"""A worker of tests/test_experts.py: an MoE experts layer sharded by FSDP2 (2 gloo ranks) trains as
one process on the same data. Rank 0 saves, per recipe, the losses and the gathered stacks after the
steps, sharded and not."""

import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import qtensor
from workers import worker_main

RECIPES = ["float8_current", "float8_rowwise", "mxfp8", "nvfp4"]  # float8_rowwise: every group cast at once


class Experts(nn.Module):
    def __init__(self, experts=4, hidden=32, width=48):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * width, hidden) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, width) / width**0.5)

    def forward(self, x, offs):
        gate, up = F.grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)


def train(model, steps=3):
    torch.manual_seed(1)  # NVFP4's stochastic rounding draws from the seed: the same draws for both runs
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(5)
    offs = torch.tensor([16, 16, 48, 64], dtype=torch.int32)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=generator)
        loss = model(x, offs).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def run(out):
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    results = {}
    for recipe in RECIPES:
        torch.manual_seed(0)
        plain = Experts()
        single, sharded = copy.deepcopy(plain), copy.deepcopy(plain)
        for model in (single, sharded):
            qtensor.quantize_(model, getattr(qtensor.recipes, recipe)())
        fully_shard(sharded)
        single_losses, sharded_losses = train(single), train(sharded)
        gathered = {name: p.full_tensor().detach().clone() for name, p in sharded.named_parameters()}
        results[recipe] = dict(
            single=single_losses, sharded=sharded_losses, gathered=gathered,
            expected={name: p.detach().plain().clone() for name, p in single.named_parameters()},
            types={name: type(p._local_tensor).__name__ for name, p in sharded.named_parameters()},
        )
    # Delayed scaling of a stack (one history per expert) is refused under FSDP2, by name.
    sharded = Experts()
    qtensor.quantize_(sharded, qtensor.recipes.float8_delayed())
    fully_shard(sharded)
    try:
        train(sharded, steps=1)
        results["delayed"] = "trained"
    except NotImplementedError as error:
        results["delayed"] = str(error)
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker_main(run)
