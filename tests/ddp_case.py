"""A worker of tests/test_ddp.py: a delayed-scaling model under DistributedDataParallel on 2 gloo
ranks, each rank fed its own batches. Rank 0 saves, per scenario, every rank's amax histories and
weights after the steps:

- "default": `quantize_` with no `amax_reduction_group`, called before `init_process_group` (the
  group is settled at each reduction, not by quantize_);
- "local": `amax_reduction_group="local"`, each rank keeping its own histories;
- "one_rank_group": a group of this rank alone, which does the same;
- "experts": a delayed-scaling expert stack through `F.grouped_mm`, routed differently on each rank
  (`expert_ends`): an expert empty on one rank only, and one empty on both.

The test runs the same steps in one process over the concatenated batches (`train(..., world=2)`).
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

import qtensor

WIDTH, ROWS, STEPS, HISTORY = 32, 8, 3, 4
LR = 0.5


def build(amax_reduction_group=None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 16))
    qtensor.quantize_(model, qtensor.recipes.float8_delayed(amax_history_len=HISTORY), amax_reduction_group=amax_reduction_group)
    return model


def batches(rank: int) -> list:
    """Rank `rank`'s batches: the larger values on one rank at one step, on the other at the next,
    so the max over the ranks comes from each rank in turn."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(ROWS, WIDTH, generator=generator) * (3.0 if (step + rank) % 2 else 1.0), torch.randn(ROWS, 16, generator=generator))
        for step in range(STEPS)
    ]


def train(model: nn.Module, data: list, world: int = 1) -> None:
    """SGD steps on `data`, the loss each rank's mean of its rows' squared errors. One process
    (`world` > 1) runs the ranks' concatenated batches as one: the sum of each rank's mean, so every
    row's gradient is the one its rank has, and the learning rate divided by `world`, as DDP averages
    the ranks' gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR / world)
    for x, target in data:
        per_row = (model(x) - target).square().sum(-1)
        per_row.view(world, -1).mean(1).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def state(model: nn.Module) -> dict:
    """Every delayed-scaling amax history of the model, by `<layer>.<role>.amax_history`, and its weights."""
    histories = {
        f"{name}.{role}": buffer.clone()
        for name, module in model.named_modules()
        if getattr(getattr(module, "weight", None), "linear_quantizers", None) is not None
        for role, buffer in module.weight.linear_quantizers.state_buffers().items()
    }
    weights = {name: getattr(p, "plain", lambda p=p: p)().detach().clone() for name, p in model.named_parameters()}
    return {"histories": histories, "weights": weights}


EXPERTS = 3


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight_stack = nn.Parameter(torch.randn(EXPERTS, 16, WIDTH) * WIDTH**-0.5)

    def forward(self, x, offs):
        return F.grouped_mm(x, self.weight_stack.transpose(-2, -1), offs=offs)


def expert_ends(rank: int) -> list[int]:
    """Rank 0 routes every row to expert 0; rank 1 three rows to expert 0, the rest to expert 1."""
    return [ROWS, ROWS, ROWS] if rank == 0 else [3, ROWS, ROWS]


def train_experts(model: nn.Module, rank: int) -> dict:
    """Two SGD steps on `rank`'s batches; each expert's input amax history after them."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    offs = torch.tensor(expert_ends(rank), dtype=torch.int32)
    for x, target in batches(rank)[:2]:
        model(x, offs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    stack = model.module.weight_stack if hasattr(model, "module") else model.weight_stack
    return {e: config.input.state_buffers()["amax_history"].clone() for e, config in enumerate(stack.linear_quantizers.experts)}


def run(out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank = int(os.environ["RANK"])
    default = build()  # before init_process_group, as a training script may
    dist.init_process_group("gloo")
    alone, _ = dist.new_subgroups(group_size=1)
    results = {}
    for scenario, model in (("default", default), ("local", build("local")), ("one_rank_group", build(alone))):
        train(DistributedDataParallel(model), batches(rank))
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, state(model))
        results[scenario] = per_rank
    experts = Experts()
    qtensor.quantize_(experts, qtensor.recipes.float8_delayed(amax_history_len=HISTORY))
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, train_experts(DistributedDataParallel(experts), rank))
    results["experts"] = per_rank
    if rank == 0:
        torch.save(results, out)
    dist.barrier()


if __name__ == "__main__":
    from workers import worker_main

    worker_main(run)
