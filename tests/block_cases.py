"""Block-scaled FP8 under FSDP2 and tensor parallelism: 2 gloo ranks (test_float8_block.py).

`python tests/block_cases.py OUT` is one rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by the
test); rank 0 writes the results to OUT. Widths of 256 put every shard edge on the 128-row tiles of
`float8_blockwise`'s weights; a 192-row weight cuts them.
"""

import os
import sys

import torch
from torch import nn

import qtensor

STEPS = 3


def build(recipe: str, weights: str, out_features: int = 256) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, out_features))
    qtensor.quantize_(model, getattr(qtensor.recipes, recipe)(), weights=weights, strict=True)
    return model


def train(model: nn.Module, weights: str) -> dict:
    """SGD steps on one batch of 256 rows, the same on every rank (FSDP2 averages the replicas' equal
    gradients; a rank's own share of a batch would be cast with its own scales); the losses, and the
    weights after training gathered whole."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if weights == "quantized":
        optimizer = qtensor.optim.MasterWeights(optimizer)
    generator = torch.Generator().manual_seed(1)
    x, target = torch.randn(256, 256, generator=generator), torch.randn(256, 256, generator=generator)
    losses = []
    for _ in range(STEPS):
        loss = (model(x) - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    from tp_cases import plain_weights

    return {"losses": losses, "weights": plain_weights(model)}


def run(out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for recipe in ("float8_blockwise", "float8_rowwise"):
        for weights in ("dynamic", "quantized"):
            model = build(recipe, weights)
            for layer in (model[0], model[2]):
                fully_shard(layer)
            fully_shard(model)
            results[("fsdp2", recipe, weights)] = train(model, weights)
    # Tensor parallelism: every rank sees the whole batch; the first layer column-parallel, the second row-parallel.
    for recipe in ("float8_blockwise", "float8_rowwise"):
        model = build("float8_blockwise", "dynamic") if recipe == "float8_blockwise" else build(recipe, "dynamic")
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        try:
            results[("tp", recipe)] = train(model, "dynamic")
        except ValueError as error:
            results[("tp", recipe)] = str(error)
    # A 192-row weight: FSDP2's shards of 96 rows cut the 128-row tiles.
    model = build("float8_blockwise", "quantized", out_features=192)
    try:
        fully_shard(model[2])
        model(torch.randn(4, 256))
        results["cut"] = "no error"
    except ValueError as error:
        results["cut"] = str(error)
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from workers import worker_main

    worker_main(run)
