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

# QTENSOR_TEST_DEVICE=cuda: NCCL with one GPU per rank (the device machine), the reference on the GPU too.
DEVICE = os.environ.get("QTENSOR_TEST_DEVICE", "cpu")

WIDTH, HEADS, TOKENS, BATCH = 64, 4, 64, 2
# On a 2 x 2 mesh FSDP2 splits each tensor-parallel shard again: 128 wide keeps every shard edge on
# MXFP8's 32-row blocks (a q shard of 64 rows, 32 per FSDP2 rank).
WIDTH_2D = 128
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
# Recipes whose input casts one all-gather can share (no running state): PrepareQuantizedModuleInput takes them.
CURRENT = [recipe for recipe in RECIPES if recipe != "float8_delayed"]
# (recipe, weights, sequence parallel: True with torch's styles, "quantized" with qtensor's quantized gathers)
SCENARIOS = (
    [(recipe, weights, True) for recipe in RECIPES for weights in ("dynamic", "quantized")]
    + [(recipe, "dynamic", False) for recipe in ("float8_current", "mxfp8", "hybrid")]
    + [(recipe, weights, "quantized") for recipe in CURRENT for weights in ("dynamic", "quantized")]
)


class Attention(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.o = nn.Linear(width, width)
        self.head_dim = width // HEADS

    def forward(self, x):
        batch, tokens, _ = x.shape
        # -1 heads: a column-parallel projection holds this rank's heads only.
        q, k, v = (proj(x).view(batch, tokens, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(attended.transpose(1, 2).reshape(batch, tokens, -1))


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.gate, self.up = nn.Linear(width, 2 * width, bias=False), nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(width), Attention(width)
        self.mlp_norm, self.mlp = nn.RMSNorm(width), MLP(width)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Net(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.layers = nn.ModuleList([Block(width), Block(width)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build(recipe: str, weights: str, seed: int = 0, width: int = WIDTH) -> nn.Module:
    torch.manual_seed(seed)
    model = Net(width).to(DEVICE)
    qtensor.quantize_(model, RECIPES[recipe](), weights=weights, strict=True)
    return model


# Recipes whose frozen held weights keep one copy, dgrad's rebuilt from it (qtensor.keep_forward_copies_).
FROZEN = ("float8_current", "nvfp4")


def frozen(recipe: str, seed: int = 0) -> nn.Module:
    """A fine-tuning base: the linears' held weights frozen, the norms training (as adapters would)."""
    model = build(recipe, "quantized", seed)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.endswith("norm.weight"))
    return model


def held_copies(model: nn.Module) -> dict:
    """{linear weight: (holds a rowwise copy, holds a columnwise copy)} of each (local) held weight."""
    local = lambda p: getattr(p, "_local_tensor", p)
    return {name: (local(p).rowwise is not None, local(p).columnwise is not None)
            for name, p in model.named_parameters() if hasattr(local(p), "rowwise")}


# A precision schedule's two recipes by weight mode: the held weights switch into per-tensor
# scaling, whose scale is the whole weight's (each rank casts its shard of the master at it).
SCHEDULED = {"dynamic": ("float8_current", "mxfp8"), "quantized": ("mxfp8", "float8_current")}


def scheduled(weights: str) -> tuple:
    """(Net, its precision schedule: SCHEDULED's first recipe, then its second from the last step on)."""
    torch.manual_seed(0)
    model = Net(WIDTH).to(DEVICE)
    first, then = (RECIPES[name]() for name in SCHEDULED[weights])
    phases = [qtensor.Phase(0, first), qtensor.Phase(STEPS - 1, then)]
    return model, qtensor.PrecisionSchedule(model, phases, weights=weights, strict=True)


def plan(sequence_parallel: bool | str) -> dict:
    """torch's parallel styles for one block, as torchtitan applies them to Llama."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    from qtensor.distributed.tensor_parallel import PrepareQuantizedModuleInput, QuantizedRowwiseParallel

    row_output = Shard(1) if sequence_parallel else Replicate()
    row = QuantizedRowwiseParallel if sequence_parallel == "quantized" else RowwiseParallel
    styles = {
        "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(), "attention.v": ColwiseParallel(),
        "attention.o": row(output_layouts=row_output),
        "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
        "mlp.down": row(output_layouts=row_output),
    }
    if sequence_parallel:
        gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        styles.update({
            "attention_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
        })
        prepare = PrepareQuantizedModuleInput if sequence_parallel == "quantized" else PrepareModuleInput
        styles.update({"attention": prepare(**gather), "mlp": prepare(**gather),
        })
    return styles


def parallelize(model: nn.Module, mesh, sequence_parallel: bool | str) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    for block in model.layers:
        parallelize_module(block, mesh, plan(sequence_parallel))
    return model


def batches(seed: int = 1, width: int = WIDTH):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        yield (torch.randn(BATCH, TOKENS, width, generator=generator).to(DEVICE),
               torch.randn(BATCH, TOKENS, width, generator=generator).to(DEVICE))


def train(model: nn.Module, weights: str, *, rank: int = 0, world: int = 1, sequence_parallel: bool | str = False, group=None, schedule=None) -> dict:
    """SGD steps on `batches()`: the losses, the output of a last forward, the weights after training.
    With sequence parallelism each rank (`rank` of `world` in the tensor-parallel `group`) feeds and
    scores its own slice of the tokens, and its loss is its slice's share of the whole batch's."""
    # foreach=False: without sequence parallelism the norms' weights stay plain tensors beside the
    # DTensor ones, and torch's multi-tensor SGD (the default on CUDA) refuses such a mix.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, foreach=False)
    if weights == "quantized":
        optimizer = qtensor.optim.MasterWeights(optimizer)
    if schedule is not None:  # a precision schedule, advanced by the optimizer's steps
        schedule.attach(optimizer)
    losses, width = [], model.layers[0].attention_norm.weight.shape[0]
    for x, target in batches(width=width):
        if sequence_parallel:
            x, target = x.chunk(world, dim=1)[rank], target.chunk(world, dim=1)[rank]
        loss = (model(x).float() - target).square().sum() / (BATCH * TOKENS * width)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_summed(loss.detach(), group) if sequence_parallel else loss.item())
    with torch.no_grad():
        # Random, not constant: with every token the same, one element that a float32 summation-order
        # difference moves across an NVFP4 rounding boundary would move every token's output at once.
        x = torch.randn(BATCH, TOKENS, width, generator=torch.Generator().manual_seed(2)).to(DEVICE)
        output = model(x.chunk(world, dim=1)[rank] if sequence_parallel else x)
    if sequence_parallel:
        output = _gathered_tokens(output, world, group)
    return {"losses": losses, "output": output, "weights": plain_weights(model)}


@contextlib.contextmanager
def counting_quantized_gemms():
    """Inside, [n]: how many forwards of the quantized linear ran (each layer's, each step)."""
    from qtensor.layers.linear import QuantizedLinearFunction

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
    """Every parameter's whole value as plain tensors (gathered when sharded); a quantized one as the
    exact fp32 values of each copy it holds (`name`, `name:columnwise`)."""
    from qtensor.distributed.fsdp import full_tensor

    found = {}
    for name, param in model.named_parameters():
        value = full_tensor(param, name)  # a quantized shard gathered as its bytes
        if isinstance(value, qtensor.QuantizedTensor) and value.columnwise is not None:
            found[f"{name}:columnwise"] = value.dequantize(torch.float32, "columnwise").detach().clone()
            value = value.dequantize()
        found[name] = (value.plain() if isinstance(value, qtensor.DynamicWeight) else value).detach().clone()
    return found


def _init_process_group() -> None:
    import torch.distributed as dist

    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ["RANK"]))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")


def _summed(value: torch.Tensor, group=None) -> float:
    import torch.distributed as dist

    value = value.to(DEVICE)  # NCCL reduces GPU tensors only
    dist.all_reduce(value, group=group)
    return value.item()


def _gathered_tokens(local: torch.Tensor, world: int, group=None) -> torch.Tensor:
    import torch.distributed as dist

    pieces = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=1)


def run_distributed(out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from qtensor.distributed import sequence_parallel as sequence_parallel_module

    _init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(DEVICE, (world,))
    results = {}
    for recipe, weights, sequence_parallel in SCENARIOS:
        model = parallelize(build(recipe, weights), mesh, sequence_parallel)
        shards = {name: (type(p).__name__, type(p._local_tensor).__name__, tuple(p._local_tensor.shape))
                  for name, p in model.named_parameters() if hasattr(p, "_local_tensor")}
        sequence_parallel_module.gather_stats(reset=True)
        with counting_quantized_gemms() as count:
            result = train(model, weights, rank=rank, world=world, sequence_parallel=sequence_parallel)
        results[(recipe, weights, sequence_parallel)] = {**result, "shards": shards, "quantized_linears": count[0],
                                                         "gathers": sequence_parallel_module.gather_stats()}
    # A frozen base keeping the forward's copies on each rank's shards, dgrad's rebuilt in each backward.
    for recipe in FROZEN:
        model = parallelize(frozen(recipe), mesh, False)
        kept = qtensor.keep_forward_copies_(model)
        result = train(model, "quantized", rank=rank, world=world)
        results[("frozen", recipe)] = {**result, "kept": kept, "held": held_copies(model)}
    # A precision schedule switching the column- and row-parallel layers' formats between steps.
    for weights in SCHEDULED:
        model, schedule = scheduled(weights)
        result = train(parallelize(model, mesh, False), weights, rank=rank, world=world, schedule=schedule)
        results[("schedule", weights)] = {**result, "switches": [(s.step, s.phase, len(s.changes)) for s in schedule.switches]}
    # Under bf16 autocast: which gathers stay quantized (an MXFP8 gradient's two copies are not fewer
    # bytes than its bf16 values), over one training step.
    for recipe in ("mxfp8", "nvfp4"):
        model = parallelize(build(recipe, "dynamic"), mesh, "quantized")
        x = next(batches())[0].chunk(world, dim=1)[rank]
        sequence_parallel_module.gather_stats(reset=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            model(x).float().square().mean().backward()
        results[("autocast_gathers", recipe)] = sequence_parallel_module.gather_stats()
    # Activation checkpointing inside the attention blocks (the gathering hook outside the region): the
    # projections' saved references are packed twice, and the gathered columnwise copy is still released.
    from torch.utils.checkpoint import checkpoint

    from qtensor.distributed import sequence_parallel as sp

    layouts, init = [], sp.TokenLayout.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        layouts.append(self)

    sp.TokenLayout.__init__ = recording
    try:
        model = parallelize(build("mxfp8", "dynamic"), mesh, "quantized")
        for block in model.layers:
            forward = block.attention.forward
            block.attention.forward = lambda x, forward=forward: checkpoint(forward, x, use_reentrant=False)
        x = next(batches())[0].chunk(world, dim=1)[rank]
        model(x).square().mean().backward()
        results["checkpointed_layouts"] = [(layout.users, layout.columnwise is None) for layout in layouts]
    finally:
        sp.TokenLayout.__init__ = init
    # QuantizedRowwiseParallel refuses a gradient quantizer with running state (delayed scaling).
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, SequenceParallel, parallelize_module

    from qtensor.distributed.tensor_parallel import QuantizedRowwiseParallel

    model = build("float8_delayed", "dynamic")
    for block in model.layers:
        parallelize_module(block, mesh, {
            "mlp_norm": SequenceParallel(), "attention_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(), "attention.v": ColwiseParallel(),
            "attention.o": QuantizedRowwiseParallel(output_layouts=Shard(1)),
            "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": QuantizedRowwiseParallel(output_layouts=Shard(1)),
        })
    try:
        model(next(batches())[0].chunk(world, dim=1)[rank]).square().mean().backward()
        results[("refused", "delayed_gradient")] = "no error"
    except ValueError as error:
        results[("refused", "delayed_gradient")] = str(error)
    # What PrepareQuantizedModuleInput refuses: delayed-scaling inputs, and tokens that cut the blocks.
    for recipe, tokens in (("float8_delayed", TOKENS), ("mxfp8", TOKENS // 2)):
        model = parallelize(build(recipe, "dynamic"), mesh, "quantized")
        try:
            model(torch.randn(BATCH, tokens // world, WIDTH, device=DEVICE))
            results[("refused", recipe)] = "no error"
        except ValueError as error:
            results[("refused", recipe)] = str(error)
    # A column-parallel MXFP8 weight whose shards cut its 32-row blocks (48 rows over 2 ranks).
    model = nn.Sequential(nn.Linear(64, 48)).to(DEVICE)
    qtensor.quantize_(model, qtensor.recipes.mxfp8())
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    parallelize_module(model, mesh, {"0": ColwiseParallel()})
    try:
        model(torch.randn(4, 64, device=DEVICE))
        results["cut_block"] = "no error"
    except ValueError as error:
        results["cut_block"] = str(error)
    # torch.compile over a tensor-parallel quantized layer is refused, naming the layer (dynamo
    # cannot follow the weight the layer swaps into its __dict__ for the forward).
    model = nn.Sequential(nn.Linear(64, 64)).to(DEVICE)
    qtensor.quantize_(model, qtensor.recipes.float8_current())
    parallelize_module(model, mesh, {"0": ColwiseParallel()})
    try:
        torch.compile(model, backend="eager", fullgraph=True)(torch.randn(4, 64, device=DEVICE))
        results["traced"] = "no error"
    except Exception as error:  # dynamo wraps what the traced code raised
        results["traced"] = f"{type(error).__name__}: {error}"
    torch._dynamo.reset()
    # Under bf16 autocast a row-parallel layer's output is bf16, as nn.Linear's (a float32 bias added
    # to the partial sums would promote it).
    from torch.distributed.tensor.parallel import RowwiseParallel

    model = nn.Sequential(nn.Linear(64, 32)).to(DEVICE)
    qtensor.quantize_(model, qtensor.recipes.mxfp8())
    parallelize_module(model, mesh, {"0": RowwiseParallel()})
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        results["row_parallel_autocast_dtype"] = model(torch.randn(4, 64 // world, device=DEVICE)).dtype  # this rank's columns
    # dist.broadcast of a quantized tensor: rank 0's bytes and scale on every rank.
    torch.manual_seed(rank)
    quantized = qtensor.Float8Quantizer().quantize((torch.randn(8, 16) * (rank + 1)).to(DEVICE))
    dist.broadcast(quantized, src=0)
    torch.manual_seed(0)
    expected = qtensor.Float8Quantizer().quantize(torch.randn(8, 16).to(DEVICE))
    results["broadcast"] = _summed(torch.tensor(float(
        torch.equal(quantized.rowwise.data.view(torch.uint8), expected.rowwise.data.view(torch.uint8))
        and torch.equal(quantized.rowwise.scale_inv, expected.rowwise.scale_inv)
    )))
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()


def two_d(recipe: str, weights: str, mesh, seed: int = 0) -> nn.Module:
    """The model on a ("dp", "tp") mesh as torchtitan lays it out: tensor parallelism first, then
    FSDP2 over the data-parallel dimension, per block and at the root."""
    from torch.distributed.fsdp import fully_shard

    # Quantized activation and gradient gathers where the recipe allows them (PrepareQuantizedModuleInput).
    model = parallelize(build(recipe, weights, seed, width=WIDTH_2D), mesh["tp"], "quantized" if recipe in CURRENT else True)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


@contextlib.contextmanager
def checking_weight_scales(model: nn.Module):
    """Inside, [checked, disagreeing]: at every linear's forward and backward, the tensor-wide scale
    buffers of the weight copy that GEMM reads (rowwise forward, columnwise backward) in FSDP2's
    gathered shard of the tensor-parallel shard, compared across all ranks: one tensor cast with one
    scale holds the same ones on every rank."""
    import torch.distributed as dist

    counts = [0, 0]

    def check(module, direction):
        storage = getattr(module._parameters["weight"]._local_tensor, direction)
        values = [getattr(storage, spec.name).float().reshape(-1) for spec in storage.buffer_specs() if spec.tensor_wide]
        if values:
            high = torch.cat(values)
            low = -high
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
            dist.all_reduce(low, op=dist.ReduceOp.MAX)
            counts[0] += 1
            counts[1] += int(not torch.equal(high, -low))

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    handles = [m.register_forward_pre_hook(lambda module, args: check(module, "rowwise")) for m in linears]
    handles += [m.register_full_backward_pre_hook(lambda module, grad: check(module, "columnwise")) for m in linears]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def run_two_d(out_path: str) -> None:
    """4 ranks: FSDP2 over "dp" (2) and tensor parallelism over "tp" (2). Every rank sees the same
    batches (the data-parallel replicas average equal gradients), each tensor-parallel rank its half
    of the tokens (sequence parallelism)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init_process_group()
    mesh = init_device_mesh(DEVICE, (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    folder, results = os.path.dirname(out_path), {}
    for recipe in RECIPES:
        for weights in ("dynamic", "quantized"):
            model = two_d(recipe, weights, mesh)
            with counting_quantized_gemms() as count, checking_weight_scales(model) as scales:
                result = train(model, weights, rank=tp.get_local_rank(), world=2, sequence_parallel=True, group=tp.get_group())
            # torch.distributed.checkpoint of the 2-D model, loaded here into FSDP2 over all 4 ranks
            # (4 x 1) and by the test into one process (2 x 2 -> 1).
            checkpoint = os.path.join(folder, f"dcp_{recipe}_{weights}")
            dcp.save(model.state_dict(), checkpoint_id=checkpoint)
            qtensor.save_model(model, os.path.join(folder, f"full_{recipe}_{weights}.safetensors"))  # every rank
            flat = build(recipe, weights, seed=7, width=WIDTH_2D)
            for block in flat.layers:
                fully_shard(block)
            fully_shard(flat)
            dcp.load(flat.state_dict(), checkpoint_id=checkpoint)
            results[(recipe, weights)] = {**result, "quantized_linears": count[0], "scales": scales,
                                          "four_by_one": plain_weights(flat)}
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()


if __name__ == "__main__":
    from workers import worker_main

    worker_main(run_two_d if os.environ.get("WORLD_SIZE") == "4" else run_distributed)
