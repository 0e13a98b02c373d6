"""A worker of tests/test_experts.py: an MoE experts layer sharded by FSDP2 (2 gloo ranks; with
QTENSOR_TEST_DEVICE=cuda, NCCL and one GPU a rank) trains as one process on the same data. Rank 0 saves, per recipe, the losses, the gathered stacks and delayed
scaling's per-expert amax histories after the steps, sharded and not; delayed scaling also with two
micro-batches a step (gradient accumulation)."""

import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import qtensor
from workers import worker_main

DEVICE = os.environ.get("QTENSOR_TEST_DEVICE", "cpu")

RECIPES = {  # name: (recipe, micro-batches a step, weights); float8_rowwise casts every group at once
    "float8_current": ("float8_current", 1, "dynamic"), "float8_rowwise": ("float8_rowwise", 1, "dynamic"),
    "mxfp8": ("mxfp8", 1, "dynamic"), "nvfp4": ("nvfp4", 1, "dynamic"), "float8_delayed": ("float8_delayed", 1, "dynamic"),
    "float8_delayed, 2 micro-batches": ("float8_delayed", 2, "dynamic"),
    # stacks held quantized: shards of whole experts, gathered as their low-precision bytes
    "float8_current, quantized": ("float8_current", 1, "quantized"), "float8_rowwise, quantized": ("float8_rowwise", 1, "quantized"),
    "mxfp8, quantized": ("mxfp8", 2, "quantized"),
    # 3 experts over 2 ranks: FSDP2's shards of 2 and 1 experts, gathered packed into the padded shard's shape
    "float8_rowwise, quantized, 3 experts": ("float8_rowwise", 1, "quantized", 3),
    "nvfp4, 3 experts": ("nvfp4", 1, "dynamic", 3), "nvfp4, quantized, 3 experts": ("nvfp4", 1, "quantized", 3),
    # 1 expert over 2 ranks: rank 1 holds none (FSDP2's empty shard), and sends only padding
    "float8_rowwise, quantized, 1 expert": ("float8_rowwise", 1, "quantized", 1), "mxfp8, quantized, 1 expert": ("mxfp8", 1, "quantized", 1),
}


class Experts(nn.Module):
    """64 rows in groups by expert (one of them empty with 4 experts)."""

    ENDS = {4: [16, 16, 48, 64], 3: [16, 40, 64], 1: [64]}

    def __init__(self, experts=4, hidden=32, width=48):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * width, hidden) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, width) / width**0.5)

    def forward(self, x):
        offs = torch.tensor(self.ENDS[self.down_proj.shape[0]], dtype=torch.int32, device=x.device)
        gate, up = F.grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)


def train(model, steps=3, micro_batches=1):
    torch.manual_seed(1)  # NVFP4's stochastic rounding draws from the seed: the same draws for both runs
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if any(type(getattr(p, "_local_tensor", p)).__name__ == "QuantizedStack" for p in model.parameters()):
        optimizer = qtensor.optim.MasterWeights(optimizer)
    generator = torch.Generator().manual_seed(5)
    device = next(model.parameters()).device
    losses = []
    for _ in range(steps):
        for _ in range(micro_batches):
            x = torch.randn(64, 32, generator=generator).to(device)
            loss = model(x).square().mean()
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def histories(model):
    """Every amax history of the model's state_dict (one per expert and role with delayed scaling)."""
    found = {}
    for name, value in model.state_dict().items():
        if name.endswith("amax_history"):
            found[name] = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
    return found


def round_trips(sharded, single, recipe, path):
    """save_model of the sharded model (every rank; rank 0 writes) loads into a model of one process
    with the one-process model's bytes, and back into a freshly sharded model, whose output is then
    the one-process model's: (bytes equal, outputs equal)."""
    qtensor.save_model(sharded, path)
    device, experts = next(single.parameters()).device, single.down_proj.shape[0]
    one = Experts(experts).to(device)
    qtensor.quantize_(one, getattr(qtensor.recipes, recipe)(), weights="quantized")
    qtensor.load_model(one, path)
    same_bytes = all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for name, p in single.named_parameters() for a, b in zip(p.stacked.values(), one.get_parameter(name).stacked.values())
    )
    again = Experts(experts).to(device)
    qtensor.quantize_(again, getattr(qtensor.recipes, recipe)(), weights="quantized")
    from torch.distributed.fsdp import fully_shard

    fully_shard(again)
    qtensor.load_model(again, path)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(9)).to(device)
    with torch.no_grad():
        same_output = torch.equal(again(x), single(x))
    return same_bytes, same_output


def through_dcp(sharded, recipe, weights, path):
    """torch.distributed.checkpoint over the ranks: the sharded model's state_dict saved, loaded into a
    freshly sharded model of the same recipe and weight mode, whose output then equals the saved
    model's (True where bit for bit)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    dcp.save(sharded.state_dict(), checkpoint_id=path)
    device, experts = next(sharded.parameters()).device, sharded.down_proj.shape[0]
    fresh = Experts(experts).to(device)
    with torch.no_grad():  # other values than the saved ones, so that a load that does nothing shows
        for p in fresh.parameters():
            p.mul_(-1)
    qtensor.quantize_(fresh, getattr(qtensor.recipes, recipe)(), weights=weights)
    fully_shard(fresh)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(9)).to(device)
    with torch.no_grad():
        equal = torch.equal(fresh(x), sharded(x))
    sharded.reshard()  # FSDP2 leaves the root unsharded after a forward
    return equal


class Holder(nn.Module):
    """A root over an experts layer, so that FSDP2 reshards the layer after its forward (and gathers
    it again before its backward); with `checkpointed`, the layer's forward is recomputed in the
    backward (activation checkpointing)."""

    def __init__(self, experts, checkpointed=False):
        super().__init__()
        self.experts, self.checkpointed = experts, checkpointed

    def forward(self, x):
        if self.checkpointed:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self.experts, x, use_reentrant=False)
        return self.experts(x)


def scenarios(device) -> dict:
    """The layer under a root, resharded after its forward, for a stack held quantized and a dynamic
    one: plain, with activation checkpointing, and with two micro-batches of gradient accumulation
    without resharding after the backward (FSDP2's accumulation pattern). Each: (largest gradient
    difference against one process relative to the gradient's largest magnitude, the losses)."""
    from torch.distributed.fsdp import fully_shard

    found = {}
    for weights in ("quantized", "dynamic"):
        for how in ("resharded", "checkpointed", "accumulated"):
            torch.manual_seed(0)
            plain = Experts().to(device)
            single, sharded = copy.deepcopy(plain), copy.deepcopy(plain)
            for model in (single, sharded):
                qtensor.quantize_(model, qtensor.recipes.mxfp8(), weights=weights)
            fully_shard(sharded, reshard_after_forward=True)
            root, reference = fully_shard(Holder(sharded, how == "checkpointed")), Holder(single, how == "checkpointed")
            if how == "accumulated":
                root.set_reshard_after_backward(False)
            generator, losses = torch.Generator().manual_seed(5), []
            for micro_batch in range(2 if how == "accumulated" else 1):
                x = torch.randn(64, 32, generator=generator).to(device)
                if how == "accumulated":
                    root.set_requires_gradient_sync(micro_batch == 1)
                for model in (reference, root):
                    loss = model(x).square().mean()
                    loss.backward()
                    losses.append(loss.item())
            root.reshard()
            sharded.reshard()  # the layer too (a module of its own): its sharded parameters hold the gradients
            worst = 0.0
            for (name, p), q in zip(single.named_parameters(), sharded.parameters()):
                assert q.grad is not None, (weights, how, name)
                expected, got = p.grad.float(), q.grad.full_tensor().float()
                worst = max(worst, ((got - expected).abs().max() / expected.abs().max()).item())
            found[f"{weights}, {how}"] = (worst, losses)
    return found


def dist_gather(local, experts):
    """The whole stack from every rank's experts (FSDP2's chunks: the last may hold fewer)."""
    padded = -(-experts // dist.get_world_size())
    mine = local.new_zeros((padded, *local.shape[1:]))
    mine[: local.shape[0]] = local
    pieces = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, mine)
    return torch.cat(pieces)[:experts]


def run(out):
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    device = torch.device(DEVICE, dist.get_rank()) if DEVICE == "cuda" else torch.device("cpu")
    if DEVICE == "cuda":
        torch.cuda.set_device(device)
    results = {}
    for name, (recipe, micro_batches, weights, *count) in RECIPES.items():
        experts = count[0] if count else 4
        torch.manual_seed(0)
        plain = Experts(experts).to(device)
        single, sharded = copy.deepcopy(plain), copy.deepcopy(plain)
        for model in (single, sharded):
            qtensor.quantize_(model, getattr(qtensor.recipes, recipe)(), weights=weights)
        fully_shard(sharded)
        unsharded = {}  # what FSDP2's gather made, as the forward sees it
        sharded.register_forward_pre_hook(lambda module, args: unsharded.update(
            {n: (type(p).__name__, sorted({str(t.dtype) for t in getattr(p, "stacked", {}).values()})) for n, p in module.named_parameters()}
        ))
        single_losses = train(single, micro_batches=micro_batches)
        qtensor.distributed.fsdp.gather_stats(reset=True)
        sharded_losses = train(sharded, micro_batches=micro_batches)
        stats = qtensor.distributed.fsdp.gather_stats(reset=True)
        reloaded = None
        # Under delayed scaling a forward records amaxes: two models compare only after the same steps.
        dcp_equal = None if recipe == "float8_delayed" else through_dcp(
            sharded, recipe, weights, os.path.join(os.path.dirname(out), f"dcp_{name.replace(', ', '_').replace(' ', '_')}"),
        )
        if weights == "quantized":  # the stacks' values after the steps, each expert as its bytes give it
            reloaded = round_trips(sharded, single, recipe, os.path.join(os.path.dirname(out), f"{recipe}.safetensors"))
            gathered = {name: dist_gather(p.to_local().dequantize(), experts) for name, p in sharded.named_parameters()}
            expected = {name: p.dequantize() for name, p in single.named_parameters()}
        else:
            gathered = {name: p.full_tensor().detach().clone() for name, p in sharded.named_parameters()}
            expected = {name: p.detach().plain().clone() for name, p in single.named_parameters()}
        results[name] = dict(
            single=single_losses, sharded=sharded_losses, gathered=gathered, expected=expected,
            types={name: type(p._local_tensor).__name__ for name, p in sharded.named_parameters()}, unsharded=unsharded,
            reloaded=reloaded, dcp_equal=dcp_equal, gathered_bytes=(stats["bytes"], stats["bf16_bytes"]),
            histories=(histories(single), histories(sharded)) if weights == "dynamic" else ({}, {}),
        )
    results["scenarios"] = scenarios(device)
    if dist.get_rank() == 0:
        to_cpu = lambda value: value.cpu() if isinstance(value, torch.Tensor) else value
        from torch.utils._pytree import tree_map

        torch.save(tree_map(to_cpu, results), out)
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker_main(run)
