"""Tensor-parallel training scenarios, run in one process and with 2 gloo ranks (test_tensor_parallel.py).

`python tests/tp_cases.py OUT` is one rank of the distributed run (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set by the test); it runs every scenario and writes rank 0's results to OUT.

The model is two Llama-style blocks of stock modules (RMSNorm, q/k/v/o projections with causal
attention, a SwiGLU MLP of gate/up/down), parallelized with torch's own styles the way torchtitan
does: q/k/v and gate/up column-wise, o and down row-wise; with sequence parallelism the norms are
`SequenceParallel` and the attention and MLP inputs gathered by `PrepareModuleInput`.
"""

import contextlib
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import qtensor

WIDTH, HEADS, HIDDEN, TOKENS, BATCH = 64, 4, 128, 32, 2
STEPS = 3


def _nvfp4():
    # Stochastic rounding draws by element position within the cast tensor: a rank's shard of the
    # column-parallel output gradient would draw other numbers than one process (docs/tensor-parallel.md).
    return qtensor.recipes.nvfp4(stochastic_rounding=False)


def _hybrid():
    return qtensor.recipes.mxfp8_fwd_nvfp4_bwd(stochastic_rounding=False)


RECIPES = {
    "float8_current": qtensor.recipes.float8_current,
    "float8_delayed": qtensor.recipes.float8_delayed,
    "mxfp8": qtensor.recipes.mxfp8,
    "nvfp4": _nvfp4,
    "hybrid": _hybrid,
}
# (recipe, weights, sequence parallel)
SCENARIOS = [(recipe, weights, True) for recipe in RECIPES for weights in ("dynamic", "quantized")] + [
    (recipe, "dynamic", False) for recipe in ("float8_current", "mxfp8", "hybrid")
]


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3))
        self.o = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        batch, tokens, _ = x.shape
        # -1 heads: a column-parallel projection holds this rank's heads only.
        q, k, v = (proj(x).view(batch, tokens, -1, WIDTH // HEADS).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(attended.transpose(1, 2).reshape(batch, tokens, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(WIDTH, HIDDEN, bias=False), nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(WIDTH), Attention()
        self.mlp_norm, self.mlp = nn.RMSNorm(WIDTH), MLP()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build(recipe: str, weights: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = Net()
    qtensor.quantize_(model, RECIPES[recipe](), weights=weights, strict=True)
    return model


def plan(sequence_parallel: bool) -> dict:
    """torch's parallel styles for one block, as torchtitan applies them to Llama."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    row_output = Shard(1) if sequence_parallel else Replicate()
    styles = {
        "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(), "attention.v": ColwiseParallel(),
        "attention.o": RowwiseParallel(output_layouts=row_output),
        "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=row_output),
    }
    if sequence_parallel:
        gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        styles.update({
            "attention_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
            "attention": PrepareModuleInput(**gather), "mlp": PrepareModuleInput(**gather),
        })
    return styles


def parallelize(model: nn.Module, mesh, sequence_parallel: bool) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    for block in model.layers:
        parallelize_module(block, mesh, plan(sequence_parallel))
    return model


def batches(seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        yield torch.randn(BATCH, TOKENS, WIDTH, generator=generator), torch.randn(BATCH, TOKENS, WIDTH, generator=generator)


def train(model: nn.Module, weights: str, *, rank: int = 0, world: int = 1, sequence_parallel: bool = False) -> dict:
    """SGD steps on `batches()`: the losses, the output of a last forward, the weights after training.
    With sequence parallelism each rank feeds and scores its own slice of the tokens, and its loss
    is its slice's share of the whole batch's."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if weights == "quantized":
        optimizer = qtensor.optim.MasterWeights(optimizer)
    losses = []
    for x, target in batches():
        if sequence_parallel:
            x, target = x.chunk(world, dim=1)[rank], target.chunk(world, dim=1)[rank]
        loss = (model(x).float() - target).square().sum() / (BATCH * TOKENS * WIDTH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_summed(loss.detach()) if sequence_parallel else loss.item())
    with torch.no_grad():
        x = torch.ones(BATCH, TOKENS, WIDTH)
        output = model(x.chunk(world, dim=1)[rank] if sequence_parallel else x)
    if sequence_parallel:
        output = _gathered_tokens(output, world)
    return {"losses": losses, "output": output, "weights": plain_weights(model)}


@contextlib.contextmanager
def counting_quantized_gemms():
    """Inside, [n]: how many forwards of the quantized linear ran (each layer's, each step)."""
    from qtensor.linear import QuantizedLinearFunction

    count, forward = [0], QuantizedLinearFunction.forward

    def counted(*args, **kwargs):
        count[0] += 1
        return forward(*args, **kwargs)

    QuantizedLinearFunction.forward = staticmethod(counted)
    try:
        yield count
    finally:
        QuantizedLinearFunction.forward = staticmethod(forward)


def plain_weights(model: nn.Module) -> dict:
    """Every parameter's whole value, dequantized, as plain tensors (gathered when sharded)."""
    found = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        value = value.dequantize() if isinstance(value, qtensor.QuantizedTensor) else value
        found[name] = (value.plain() if isinstance(value, qtensor.DynamicWeight) else value).detach().clone()
    return found


def _summed(value: torch.Tensor) -> float:
    import torch.distributed as dist

    dist.all_reduce(value)
    return value.item()


def _gathered_tokens(local: torch.Tensor, world: int) -> torch.Tensor:
    import torch.distributed as dist

    pieces = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(pieces, local.contiguous())
    return torch.cat(pieces, dim=1)


def run_distributed(out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for recipe, weights, sequence_parallel in SCENARIOS:
        model = parallelize(build(recipe, weights), mesh, sequence_parallel)
        shards = {name: (type(p).__name__, type(p._local_tensor).__name__, tuple(p._local_tensor.shape))
                  for name, p in model.named_parameters() if hasattr(p, "_local_tensor")}
        with counting_quantized_gemms() as count:
            result = train(model, weights, rank=rank, world=world, sequence_parallel=sequence_parallel)
        results[(recipe, weights, sequence_parallel)] = {**result, "shards": shards, "quantized_linears": count[0]}
    # A column-parallel MXFP8 weight whose shards cut its 32-row blocks (48 rows over 2 ranks).
    model = nn.Sequential(nn.Linear(64, 48))
    qtensor.quantize_(model, qtensor.recipes.mxfp8())
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    parallelize_module(model, mesh, {"0": ColwiseParallel()})
    try:
        model(torch.randn(4, 64))
        results["cut_block"] = "no error"
    except ValueError as error:
        results["cut_block"] = str(error)
    # FSDP2 over tensor parallelism (a 2-D mesh, here 1 x 2): refused at the first forward, naming the layer.
    from torch.distributed.fsdp import fully_shard

    mesh_2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    model = parallelize(build("float8_current", "dynamic"), mesh_2d["tp"], True)
    for block in model.layers:
        fully_shard(block, mesh=mesh_2d["dp"])
    try:
        model(torch.randn(BATCH, TOKENS // world, WIDTH))
        results["two_d"] = "no error"
    except NotImplementedError as error:
        results["two_d"] = str(error)
    # dist.broadcast of a quantized tensor: rank 0's bytes and scale on every rank.
    torch.manual_seed(rank)
    quantized = qtensor.Float8Quantizer().quantize(torch.randn(8, 16) * (rank + 1))
    dist.broadcast(quantized, src=0)
    torch.manual_seed(0)
    expected = qtensor.Float8Quantizer().quantize(torch.randn(8, 16))
    results["broadcast"] = _summed(torch.tensor(float(
        torch.equal(quantized.rowwise.data.view(torch.uint8), expected.rowwise.data.view(torch.uint8))
        and torch.equal(quantized.rowwise.scale_inv, expected.rowwise.scale_inv)
    )))
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()


if __name__ == "__main__":
    from workers import worker_main

    worker_main(run_distributed)
