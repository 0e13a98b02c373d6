"""Training scenarios run both in one process and under FSDP2 with 2 gloo ranks (test_fsdp.py).

`python tests/fsdp_cases.py OUT` is one rank of the distributed run (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set by the test); it runs every scenario and writes rank 0's results to OUT.
Every rank sees the same batches, so the averaged gradients equal the single-process ones and the
two runs must agree.
"""

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import qtensor

RECIPES = {
    "float8_current": qtensor.recipes.float8_current,
    "float8_delayed": qtensor.recipes.float8_delayed,
    "mxfp8": qtensor.recipes.mxfp8,
    "nvfp4": qtensor.recipes.nvfp4,
    "hybrid": qtensor.recipes.mxfp8_fwd_nvfp4_bwd,
    "float8_rowwise": qtensor.recipes.float8_rowwise,
}
# (recipe, weights, reshard_after_forward)
SCENARIOS = [(recipe, weights, True) for recipe in RECIPES for weights in ("dynamic", "quantized")] + [
    ("mxfp8", "dynamic", False),
    ("hybrid", "quantized", False),
    ("float8_current", "dynamic", False),  # gathered in place, the transpose rebuilt by every gather
]
STEPS = 3
# QTENSOR_TEST_DEVICE=cuda: NCCL with one GPU per rank (the device machine), the reference on the GPU too.
DEVICE = os.environ.get("QTENSOR_TEST_DEVICE", "cpu")
WIDTH, HIDDEN, OUT = 64, 128, 63  # 63 output rows: uneven shards (32 + 31) on 2 ranks


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class AttentionAndConv1D(nn.Module):
    """nn.MultiheadAttention (packed in_proj_weight) and a Hugging Face Conv1D ([in, out] weight)."""

    def __init__(self):
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.attention = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.conv = Conv1D(HIDDEN, WIDTH)
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        tokens = x.reshape(-1, 8, WIDTH)
        tokens = tokens + self.attention(tokens, tokens, tokens, need_weights=False)[0]
        return self.head(F.gelu(self.conv(tokens))).reshape(x.shape[0], OUT)


def train_layer_types(weights: str, mesh=None) -> list[float]:
    """A few steps of AttentionAndConv1D (sharded per layer when a mesh is given): the losses."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = AttentionAndConv1D().to(device())
    qtensor.quantize_(model, RECIPES["mxfp8"](), weights=weights)
    if mesh is not None:
        for layer in (model.attention, model.conv):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return train_losses(model, weights)


def train_losses(model: nn.Module, weights: str, outputs: int = OUT) -> list[float]:
    """The losses of AdamW steps (through MasterWeights for quantized weights) on `batches()`,
    fitting the first `outputs` target columns."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if weights == "quantized":
        optimizer = qtensor.optim.MasterWeights(optimizer)
    losses = []
    for x, target in batches():
        loss = F.mse_loss(model(x).float(), target[:, :outputs])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


DCP_CASES = [("float8_current", "quantized"), ("hybrid", "quantized"), ("nvfp4", "dynamic")]
# Compiled blocks under FSDP2; aot_eager on the CPU, where
# inductor's code generation would take minutes, inductor on the GPU.
COMPILED_CASES = [
    ("float8_current", "dynamic"), ("mxfp8", "quantized"), ("nvfp4", "dynamic"), ("hybrid", "dynamic"),
    ("float8_delayed", "dynamic"), ("float8_delayed", "quantized"),
]
COMPILE_BACKEND = os.environ.get("FSDP_COMPILE_BACKEND") or ("inductor" if os.environ.get("QTENSOR_TEST_DEVICE", "cpu") == "cuda" else "aot_eager")


def checkpointed(model: nn.Module) -> nn.Module:
    """`model` with each block's forward under activation checkpointing (recomputed in the backward)."""
    from torch.utils.checkpoint import checkpoint

    for block in model.layers:
        block.forward = lambda x, forward=block.forward: checkpoint(forward, x, use_reentrant=False)
    return model


def train_reading_cached_casts(model: nn.Module) -> dict:
    """The losses of AdamW steps on `batches()`, and after each backward (before the optimizer
    step) the parameters whose FSDP2 shard still holds its cast (`DynamicWeight.shard_cast`)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, cached = [], []
    for x, target in batches():
        loss = F.mse_loss(model(x).float(), target)
        loss.backward()
        model.reshard()  # the root keeps its weights gathered after the backward: read the shards
        cached.append(sorted(
            name for name, parameter in model.named_parameters() if getattr(parameter._local_tensor, "shard_cast", None) is not None
        ))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "cached_casts": cached}


def recording_backend():
    """(a torch.compile backend, the code of every forward and backward graph it compiles, or None):
    on the CPU aot_eager keeping each graph's code; on the GPU inductor, whose compiled backward
    itself fails on a process-group constant (it copies the graph)."""
    if COMPILE_BACKEND != "aot_eager":
        return COMPILE_BACKEND, None
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module.code)
        return make_boxed_func(graph_module.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record), graphs


def frozen_one_copy(model: nn.Module) -> nn.Module:
    """`model` with its last block frozen, as a LoRA base: its held weights keep the forward's copy
    only (`update_usage(columnwise=False)`); the first block's gradients still flow through it."""
    model.layers[1].requires_grad_(False)
    for param in model.layers[1].parameters():
        if isinstance(param, qtensor.QuantizedTensor):
            param.update_usage(columnwise=False)
    return model


def held_copies(model: nn.Module) -> dict:
    """The directions each quantized weight holds (its local shard's, on a sharded model)."""
    found = {}
    for name, param in model.named_parameters():
        local = getattr(param, "_local_tensor", param)
        if isinstance(local, qtensor.QuantizedTensor):
            found[name] = [d for d in ("rowwise", "columnwise") if getattr(local, d) is not None]
    return found


ONE_COPY_RECIPES = ("float8_current", "nvfp4")  # per-tensor FP8's transpose; NVFP4's 16x16 weight tiles


# A precision schedule's two recipes by weight mode: the held weights switch into per-tensor
# scaling, whose scale is the whole weight's (each rank casts its shard of the master at it).
SCHEDULED = {"dynamic": ("float8_current", "mxfp8"), "quantized": ("mxfp8", "float8_current")}


def scheduled(weights: str) -> tuple:
    """(Net, its precision schedule: SCHEDULED's first recipe, then its second from the last step
    on, a record of the format of the first layer's weight at each forward)."""
    torch.manual_seed(0)
    model = Net().to(device())
    first, then = SCHEDULED[weights]
    phases = [qtensor.Phase(0, RECIPES[first]()), qtensor.Phase(STEPS - 1, RECIPES[then]())]
    schedule = qtensor.PrecisionSchedule(model, phases, weights=weights, strict=True)
    seen = []
    model.layers[0].up.register_forward_pre_hook(lambda module, args: seen.append(_format_class(_used_weight(module.weight))))
    return model, schedule, seen


def _used_weight(weight):
    """What a layer's forward multiplies: a gathered quantized weight, or a dynamic weight's cast."""
    weight = getattr(weight, "_local_tensor", weight)
    return weight.quantized(columnwise=False, cached=False) if getattr(weight, "quantized_at_use", False) else weight


def build(recipe: str, weights: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = Net().to(device())
    recipe = RECIPES[recipe] if recipe in RECIPES else globals()[recipe]
    qtensor.quantize_(model, recipe(), weights=weights, strict=True)
    return model


def device() -> torch.device:
    if DEVICE == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sharded(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batches(seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        x = torch.randn(16, WIDTH, generator=generator)
        yield x.to(device()), torch.randn(16, OUT, generator=generator).to(device())


def probe_logits(model: nn.Module) -> torch.Tensor:
    """The model's output on a fixed batch, without autograd (plain on every rank)."""
    with torch.no_grad():
        logits = model(torch.ones(4, WIDTH, device=device()))
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


def layer_histories(model: nn.Module) -> dict:
    """Every delayed-scaling amax history this process holds, by (layer, role), as lists. The
    quantizers travel on each layer's weight (on a sharded model, on its local shard); a quantized
    weight records its own casts in its own quantizer."""
    found = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        local = getattr(weight, "_local_tensor", weight)
        linear = getattr(local, "linear_quantizers", None)
        if linear is None:
            continue
        for role in ("input", "weight", "grad_output"):
            quantizer = local.quantizer if role == "weight" and isinstance(local, qtensor.QuantizedTensor) else getattr(linear, role)
            found[(name, role)] = quantizer.amax_history.tolist()
    return found


def train(model: nn.Module, weights: str, *, evaluate_between_steps: bool = False, batch_seed: int = 1, schedule=None) -> dict:
    """Losses of a few steps, then the logits on a fixed batch. `evaluate_between_steps`: an
    evaluation forward on that batch before the first step and between steps. `schedule`: a
    precision schedule attached to the optimizer."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if weights == "quantized":
        optimizer = qtensor.optim.MasterWeights(optimizer)
    if schedule is not None:
        schedule.attach(optimizer)
    torch.manual_seed(2)  # stochastic rounding draws from here, the same in both runs
    losses = []
    for x, target in batches(batch_seed):
        if evaluate_between_steps:
            probe_logits(model)
        loss = F.mse_loss(model(x).float(), target)  # the loss in fp32 (bf16 logits under MixedPrecisionPolicy)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "logits": probe_logits(model)}


# Dynamic weights under FSDP2 reduce the tensor-wide amaxes of all their shards' casts in one
# all-reduce per step (dynamic_weight.py): the recipes whose weights have such amaxes, and how many
# each of the model's 5 weights has (the hybrid's NVFP4 child: the global and the transformed amax).
AMAX_RECIPES = {"float8_current": 1, "nvfp4": 1, "hybrid": 1, "nvfp4_rht_weights": 2}
QUANTIZED_LAYERS = 5


def nvfp4_rht_weights():
    """NVFP4 everywhere, the weights' columnwise copies with the Hadamard transform too: a weight
    cast that reduces two tensor-wide amaxes (the global and the transformed values' one)."""
    from qtensor.formats.nvfp4 import NVFP4Quantizer

    maker = lambda: NVFP4Quantizer(rht=True)  # noqa: E731
    return qtensor.recipes.ByTensorType("nvfp4_rht_weights", input=maker, weight=maker, grad_output=maker)


def train_counting_amax_reductions(model: nn.Module, *, evaluate: bool = False, micro_batches: int = 1) -> dict:
    """`train`'s AdamW steps on dynamic weights, each step optionally after an evaluation forward and
    over `micro_batches` micro-batches (gradient accumulation), counting the amax all-reduces each
    step issues: `dist.all_reduce` with MAX, what every amax reduction uses (FSDP2's gradients go
    through reduce-scatter and clip_grad_norm_'s norm is a SUM). Returns the losses, the number of
    elements of each counted all-reduce by step ([] per step on one process), the trained weights
    (whole, on every rank) and the logits."""
    import torch.distributed as dist

    log: list = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        op = kwargs.get("op", args[0] if args else dist.ReduceOp.SUM)
        if op == dist.ReduceOp.MAX:
            log.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(2)  # stochastic rounding draws from here, the same in both runs
    losses, per_step = [], []
    dist.all_reduce = counting
    try:
        for x, target in batches():
            log.clear()
            if evaluate:
                probe_logits(model)
            for part, part_target in zip(x.chunk(micro_batches), target.chunk(micro_batches)):
                loss = F.mse_loss(model(part).float(), part_target) / micro_batches
                loss.backward()
                losses.append(loss.item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            optimizer.zero_grad()
            per_step.append(list(log))
    finally:
        dist.all_reduce = original
    trained = {}
    for name, parameter in model.named_parameters():
        whole = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter
        trained[name] = (whole.plain() if isinstance(whole, qtensor.DynamicWeight) else whole).detach().clone()
    return {"losses": losses, "reductions": per_step, "weights": trained, "logits": probe_logits(model)}


GATHER_LOG: list = []


def _counting(original):
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        inputs, metadata = original(self, mesh, outer_size, outer_stride, module, mp_policy)
        plan = metadata[0]
        GATHER_LOG.append(
            {
                "bytes": sum(t.numel() * t.element_size() for t in inputs),
                "bf16_bytes": 2 * -(-outer_size[0] // mesh.size()) * outer_size[1:].numel(),
                "directions": list(plan.directions) if plan is not None else [],
                "packed": bool(plan and plan.packed),
                "rows": outer_size[0],
            }
        )
        return inputs, metadata

    return fsdp_pre_all_gather


def count_all_gather_bytes():
    """Record, per all-gather, the bytes handed to it against the bf16 bytes of the same shard."""
    from qtensor.layers.weight import QuantizedWeight  # a quantized layer weight (weights="quantized")

    for cls in (QuantizedWeight, qtensor.DynamicWeight):
        cls.fsdp_pre_all_gather = _counting(cls.fsdp_pre_all_gather)


def _format_class(tensor) -> str:
    """The format's tensor class of a quantized layer weight (what files store), else the type."""
    return type(tensor).data_class.__name__ if isinstance(tensor, qtensor.QuantizedTensor) else type(tensor).__name__


def run_distributed(out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ["RANK"]))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
    results = {}
    count_all_gather_bytes()
    only = os.environ.get("FSDP_CASES_ONLY")  # "recipe,weights,reshard" while debugging one scenario
    skip = os.environ.get("FSDP_CASES_SKIP", "").split()  # scenario kinds left out (e.g. "compiled") while debugging
    for recipe, weights, reshard in SCENARIOS:
        if only and only != f"{recipe},{weights},{reshard}":
            continue
        model = build(recipe, weights)
        GATHER_LOG.clear()
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        result = train(model, weights)
        result["all_gathers"] = list(GATHER_LOG)
        results[(recipe, weights, reshard)] = result
    # Where FSDP2's state cannot be read (fsdp_state.regathers_before_backward finds no parameter group),
    # the forward gather also brings what the backward reads: correct, more bytes.
    if not only or only == "unknown_regather":
        found = qtensor.distributed.fsdp_state._param_group_of
        qtensor.distributed.fsdp_state._param_group_of = lambda module: (None, ())
        try:
            model = build("mxfp8", "dynamic")
            GATHER_LOG.clear()
            results["unknown_regather"] = {**train(sharded(model, mesh), "dynamic"), "all_gathers": list(GATHER_LOG)}
        finally:
            qtensor.distributed.fsdp_state._param_group_of = found
    # MixedPrecisionPolicy(param_dtype=bf16): the gathered weight is a bf16 quantized tensor.
    from torch.distributed.fsdp import MixedPrecisionPolicy

    for weights in ("dynamic", "quantized"):
        if only and only != "mixed":
            break
        model = build("mxfp8", weights)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        seen = {}
        model.layers[0].up.register_forward_pre_hook(
            lambda module, args: seen.update(weight=(_format_class(module.weight), module.weight.dtype))
        )
        result = train(model, weights)
        result["gathered_weight"] = seen["weight"]
        results[("mixed", weights)] = result
    # The amax all-reduces of each training step (dynamic weights): one per step for all the weights.
    variants = {"plain": {}, "evaluating": dict(evaluate=True, micro_batches=2)}
    for recipe in AMAX_RECIPES:
        for variant, options in variants.items():
            if only and only != "amax_reductions":
                break
            model = sharded(build(recipe, "dynamic"), mesh)
            results[("amax_reductions", recipe, variant)] = train_counting_amax_reductions(model, **options)
    if not only or only == "amax_reductions":
        # The same steps with each cast reducing its own amaxes (the batching turned off): one
        # all-reduce per layer and step, so the count above is seen to change.
        from qtensor.layers import dynamic_weight

        batched = dynamic_weight._batched_amaxes
        dynamic_weight._batched_amaxes = lambda *arguments: None
        try:
            model = sharded(build("float8_current", "dynamic"), mesh)
            results[("amax_reductions", "float8_current", "unbatched")] = train_counting_amax_reductions(model)
        finally:
            dynamic_weight._batched_amaxes = batched
        # A frozen block: its weights' amaxes are reduced with the others' at the first step only.
        model = build("float8_current", "dynamic")
        model.layers[0].requires_grad_(False)
        results[("amax_reductions", "float8_current", "frozen")] = train_counting_amax_reductions(sharded(model, mesh))
        # A frozen block in the middle (its backward runs, for the first block's gradients): which
        # weights still hold their shard's cast after training.
        model = build("float8_current", "dynamic")
        model.layers[1].requires_grad_(False)
        results["frozen_middle"] = train_reading_cached_casts(sharded(model, mesh))
        # MixedPrecisionPolicy(param_dtype=bf16): the amaxes are those of the bf16 values each cast reads.
        model = build("float8_current", "dynamic")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        results[("amax_reductions", "float8_current", "mixed")] = train_counting_amax_reductions(model)
        # Compiled blocks (FSDP2's hooks run outside the compiled graphs): batched as in eager.
        torch._dynamo.reset()
        model = build("float8_current", "dynamic")
        for block in model.layers:
            block.compile(backend=COMPILE_BACKEND)
        results[("amax_reductions", "float8_current", "compiled")] = train_counting_amax_reductions(sharded(model, mesh))
    # Activation checkpointing inside each sharded block (torchtitan's order): the forward runs
    # again inside the backward, after FSDP2's re-gather.
    for recipe, reshard in (("float8_current", True), ("mxfp8", False), ("mxfp8", True)):
        if only and only != "checkpointed":
            break
        model = checkpointed(build(recipe, "dynamic"))
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh)
        try:
            results[("checkpointed", recipe, reshard)] = {"losses": train_losses(model, "dynamic")}
        except RuntimeError as error:  # every rank refuses at the same recomputed forward
            results[("checkpointed", recipe, reshard)] = {"error": str(error)}
    # A precision schedule switching formats between steps: the gathers after the switch bring the
    # new format, made at their new sizes.
    for weights in SCHEDULED:
        if only and only != "schedule":
            break
        model, schedule, seen = scheduled(weights)
        result = train(sharded(model, mesh), weights, schedule=schedule)
        results[("schedule", weights)] = {**result, "formats": list(seen)}
    # A frozen block holding one copy of each weight (a LoRA base): the gathers bring that copy, the
    # backward rebuilds dgrad's from it.
    for recipe in ONE_COPY_RECIPES:
        if only and only != "one_copy":
            break
        model = sharded(frozen_one_copy(build(recipe, "quantized")), mesh)
        GATHER_LOG.clear()
        result = train(model, "quantized")
        results[("one_copy", recipe)] = {**result, "copies": held_copies(model), "all_gathers": list(GATHER_LOG)}
    # torchtitan's order for models too large for one device: meta, quantize_, fully_shard, to_empty, init.
    for recipe, weights in (("float8_current", "quantized"), ("hybrid", "dynamic")):
        if only and only != "meta":
            break  # noqa
        with torch.device("meta"):
            model = Net()
        qtensor.quantize_(model, RECIPES[recipe](), weights=weights)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device=device())
        torch.manual_seed(dist.get_rank())  # each rank initialises its own shards differently
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()
        result = train(model, weights)
        local = model.layers[0].up.weight._local_tensor
        result["local_type"] = _format_class(local)
        if isinstance(local, qtensor.QuantizedTensor):
            scales = [torch.zeros((), device=device()) for _ in range(dist.get_world_size())]
            dist.all_gather(scales, local.rowwise.scale_inv.clone())
            result["scales"] = [float(x) for x in scales]
        results[("meta", recipe, weights)] = result
    # torchtitan's order with torch.compile: quantize_, compile each block whole (fullgraph: a graph
    # break raises) in place of the block, fully_shard; the graph breaks and graphs are counted.
    from torch._dynamo.utils import counters

    for recipe, weights in COMPILED_CASES:
        if only and only != "compiled" or "compiled" in skip:
            break
        torch._dynamo.reset()
        counters.clear()
        model = build(recipe, weights)
        backend, graphs = recording_backend()
        for index, block in enumerate(model.layers):
            model.layers[index] = torch.compile(block, backend=backend, fullgraph=True)
        try:
            result = train(sharded(model, mesh), weights)
        except Exception:  # this scenario's test fails with it; the other scenarios still run (every rank fails alike)
            import traceback

            results[("compiled", recipe, weights)] = {"error": traceback.format_exc()[-4000:]}
            continue
        result["graph_breaks"] = sum(counters["graph_break"].values())
        result["graphs"] = counters["stats"]["unique_graphs"]
        # Collectives traced into the graphs (the backward's amax reduction, delayed scaling): by
        # process group name, never as a ProcessGroup object, which the compiled backward cannot copy.
        if graphs is not None:
            result["process_group_constants"] = sum(code.count("_torchbind_obj") for code in graphs)
            result["collectives"] = sum(code.count("_c10d_functional.all_reduce") for code in graphs)
        results[("compiled", recipe, weights)] = result
    # torch.distributed.checkpoint: 2 -> 2 here, 1 -> 2 from the test's single-process saves, and
    # the 2-rank saves for the test to load into one process (2 -> 1).
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    folder = os.path.dirname(out_path)
    for recipe, weights in DCP_CASES:
        if only and only != "dcp":
            break
        model = sharded(build(recipe, weights), mesh)
        train(model, weights)
        dcp.save(model.state_dict(), checkpoint_id=os.path.join(folder, f"dcp2_{recipe}_{weights}"))
        qtensor.save_model(model, os.path.join(folder, f"full_{recipe}_{weights}.safetensors"))  # every rank
        fresh = sharded(build(recipe, weights, seed=7), mesh)
        dcp.load(fresh.state_dict(), checkpoint_id=os.path.join(folder, f"dcp2_{recipe}_{weights}"))
        from_one = sharded(build(recipe, weights, seed=8), mesh)
        dcp.load(from_one.state_dict(), checkpoint_id=os.path.join(folder, f"dcp1_{recipe}_{weights}"))
        results[("dcp", recipe, weights)] = {
            "saved": probe_logits(model),
            "reloaded": probe_logits(fresh),
            "from_one_rank": probe_logits(from_one),
        }
    # Optimizer state through DCP (dynamic weights, plain AdamW): a reloaded run takes the same next step.
    if not only or only == "dcp":
        runs = []
        for seed in (0, 9):
            model = sharded(build("mxfp8", "dynamic", seed=seed), mesh)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            runs.append((model, optimizer))
        model, optimizer = runs[0]
        x, target = next(batches())
        F.mse_loss(model(x).float(), target).backward()
        optimizer.step()
        optimizer.zero_grad()
        state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=os.path.join(folder, "dcp_optim"))
        other, other_optimizer = runs[1]
        F.mse_loss(other(x).float(), target).backward()  # creates the optimizer state to load into
        other_optimizer.step()
        other_optimizer.zero_grad()
        loaded = {"model": other.state_dict(), "optim": get_optimizer_state_dict(other, other_optimizer)}
        dcp.load(loaded, checkpoint_id=os.path.join(folder, "dcp_optim"))
        set_optimizer_state_dict(other, other_optimizer, loaded["optim"])
        losses = []
        for m, o in ((model, optimizer), (other, other_optimizer)):
            loss = F.mse_loss(m(x).float(), target)
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(F.mse_loss(m(x).float(), target).item())
        results["dcp_optimizer"] = losses
    # MasterWeights' state (sharded masters, the wrapped optimizer's moments) through DCP.
    if not only or only == "dcp":
        runs = []
        for seed in (0, 9):
            model = sharded(build("float8_current", "quantized", seed=seed), mesh)
            runs.append((model, qtensor.optim.MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2))))
        x, target = next(batches())
        for model, optimizer in runs:  # a step each, so both optimizers hold state
            F.mse_loss(model(x).float(), target).backward()
            optimizer.step()
            optimizer.zero_grad()
        (model, optimizer), (other, other_optimizer) = runs
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=os.path.join(folder, "dcp_masters"))
        loaded = {"model": other.state_dict(), "optim": other_optimizer.state_dict()}
        dcp.load(loaded, checkpoint_id=os.path.join(folder, "dcp_masters"))
        other_optimizer.load_state_dict(loaded["optim"])
        losses = []
        for m, o in runs:
            F.mse_loss(m(x).float(), target).backward()
            o.step()
            o.zero_grad()
            losses.append(F.mse_loss(m(x).float(), target).item())
        results["dcp_masters"] = losses
    # Fewer rows than ranks: a 1-row layer leaves rank 1 an empty shard.
    if not only or only == "layer_types":
        for weights in ("dynamic", "quantized"):
            results[("layer_types", weights)] = train_layer_types(weights, mesh)
    if not only or only == "tiny":
        for weights in ("dynamic", "quantized"):
            torch.manual_seed(0)
            tiny = nn.Sequential(nn.Linear(WIDTH, 1)).to(device())
            qtensor.quantize_(tiny, RECIPES["float8_current"](), weights=weights)
            fully_shard(tiny, mesh=mesh)
            results[("tiny", weights)] = train_losses(tiny, weights, outputs=1)
    # A shard edge that cuts an MXFP8 columnwise block (48 rows per rank, blocks of 32).
    torch.manual_seed(0)
    bad = nn.Sequential(nn.Linear(32, 96)).to(device())
    qtensor.quantize_(bad, qtensor.recipes.mxfp8())
    fully_shard(bad, mesh=mesh)
    try:
        bad(torch.randn(4, 32, device=device())).sum().backward()
        results["block_error"] = None
    except ValueError as error:
        results["block_error"] = str(error)
    # Evaluation forwards between the steps (the same batches on every rank, as above).
    for recipe in RECIPES:
        for weights in ("dynamic", "quantized"):
            if only and only != "evaluating":
                break
            model = sharded(build(recipe, weights), mesh)
            results[("evaluating", recipe, weights)] = train(model, weights, evaluate_between_steps=True)
    # Delayed scaling with different batches on each rank: every rank must end with the same histories.
    for weights in ("dynamic", "quantized"):
        if only and only != "own_batches":
            break
        model = sharded(build("float8_delayed", weights), mesh)
        trained = train(model, weights, batch_seed=100 + dist.get_rank())
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, {"histories": layer_histories(model), "logits": trained["logits"].cpu()})
        results[("own_batches", weights)] = per_rank
    # DistributedDataParallel: quantize_(..., amax_reduction_group=) names the group that reduces
    # the amaxes (FSDP2 uses its mesh); different batches on each rank again.
    if not only or only == "ddp":
        model = build("float8_delayed", "dynamic")
        qtensor.dequantize_(model)
        qtensor.quantize_(model, RECIPES["float8_delayed"](), amax_reduction_group=dist.group.WORLD)
        trained = train(torch.nn.parallel.DistributedDataParallel(model), "dynamic", batch_seed=100 + dist.get_rank())
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, {"histories": layer_histories(model), "logits": trained["logits"].cpu()})
        results["ddp_own_batches"] = per_rank
    # A quantized MXFP8 weight whose shard edge cuts a columnwise block (48 rows per rank, blocks of 32).
    from collections import OrderedDict

    torch.manual_seed(0)
    bad = nn.Sequential(OrderedDict(proj=nn.Linear(32, 96))).to(device())
    qtensor.quantize_(bad, qtensor.recipes.mxfp8(), weights="quantized")
    try:
        fully_shard(bad, mesh=mesh)
        bad(torch.randn(4, 32, device=device())).sum().backward()
        results[("block_error", "quantized")] = None
    except ValueError as error:
        results[("block_error", "quantized")] = str(error)
    if dist.get_rank() == 0:
        torch.save(results, out_path)  # (tensors stay on their device; the test loads them there)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from workers import worker_main

    worker_main(run_distributed)
