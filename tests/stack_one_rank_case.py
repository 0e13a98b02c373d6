"""A worker of tests/test_experts.py: FSDP2 over a single gloo rank of an experts layer whose stacks
are held quantized (their buffers gathered packed in one input), against the same layer unsharded.
Saves both runs' losses."""

import copy
import os

import torch
import torch.distributed as dist

import qtensor
from experts_fsdp_case import Experts, train
from workers import worker_main


def run(out):
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    losses = {}
    for recipe in ("float8_rowwise", "mxfp8"):
        torch.manual_seed(0)
        single = Experts()
        qtensor.quantize_(single, getattr(qtensor.recipes, recipe)(), weights="quantized")
        sharded = copy.deepcopy(single)
        fully_shard(sharded)
        losses[recipe] = (train(single), train(sharded))
    torch.save(losses, out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker_main(run)
