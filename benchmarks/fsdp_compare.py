"""Per-step losses of the main job's model, on one process or sharded with FSDP2, to compare them.

    python benchmarks/fsdp_compare.py [--recipe float8_current] [--steps 20] [--no-autocast]
    torchrun --nproc-per-node 2 benchmarks/fsdp_compare.py [same options]

Every rank trains on the same batches, so the two runs should print the same losses; the first step
where they part shows where a difference enters (step 1: the forward or the first backward).
"""

import argparse
import copy
import os

import torch

import qtensor
from qtensor import recipes
from qtensor.demo import VOCABULARY, TinyLM, sums_stream, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", default="float8_current")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-autocast", action="store_true")
    parser.add_argument("--no-foreach", action="store_true", help="AdamW(foreach=False) in both runs")
    args = parser.parse_args()
    sharded = "RANK" in os.environ
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if sharded:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            device = torch.device("cuda", torch.cuda.current_device())
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    torch.manual_seed(0)
    base = TinyLM(len(VOCABULARY), 64, 2, 4, 64)
    model = copy.deepcopy(base).to(device)
    factory = getattr(recipes, args.recipe)()
    qtensor.quantize_(model, lambda role: None if role.name == "head" else factory(role))
    if sharded:
        for layer in model.blocks.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    # On CUDA AdamW picks its foreach implementation for plain and DTensor parameters but not for a
    # DynamicWeight (a wrapper subclass): --no-foreach makes both runs use the same one.
    foreach = False if args.no_foreach else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, foreach=foreach)
    generator = torch.Generator().manual_seed(0)
    lead = not sharded or dist.get_rank() == 0
    for step in range(1, args.steps + 1):
        tokens = sums_stream(16, 64, generator).to(device)
        loss = train_step(model, optimizer, tokens, autocast=not args.no_autocast)
        if lead:
            print(f"step {step:3d} loss {loss.item():.9f}", flush=True)
    if sharded:
        dist.barrier()
        dist.destroy_process_group()
        os._exit(0)


if __name__ == "__main__":
    main()
