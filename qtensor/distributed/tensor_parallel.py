"""Tensor parallelism: a quantized layer under torch's parallel styles runs quantized GEMMs on its shard.

`parallelize_module` with `ColwiseParallel` / `RowwiseParallel` makes a layer's weight a DTensor
whose local tensor is the layer weight's shard (a `DynamicWeight`, or a quantized weight split along
its rows or columns). A DTensor computes F.linear by dispatching its pieces (a transpose and an
addmm) to the local tensors, below autograd, where the backward's GEMMs would never meet the
quantizers. So for the length of each forward the module's weight attribute is the shard itself
(`enter`, `leave`), placed by a `TensorParallelShard`: the layer's `LayerPlacement`
(core/placement.py), which gives the quantized linear its local operands and the placement of each
of its tensors, and makes the layer's output from the local one:

- column-parallel (weight `Shard(0)`): the replicated input times the local rows of the weight; the
  output is sharded along its last dimension, and the input's gradient is a partial sum;
- row-parallel (weight `Shard(1)`): the input's local columns times the weight's; the output is a
  partial sum, reduced by the style's output layout, and the replicated bias is added once;
- a replicated weight: the local linear, replicated.

A tensor sharded across the group (the weight, the row-parallel input, the column-parallel output
gradient) is quantized with its tensor-wide amaxes reduced over the group, and with shard edges on
block boundaries (checked, with an error naming the layer), so each rank holds exactly its slice of
what one process would quantize. The style's hooks move activations and gradients between layouts.

Under FSDP2 on a 2-D mesh, FSDP2 gathers its own dimension before these hooks run: the local shard is
then FSDP2's gathered tensor-parallel shard, whose cast reduced its amaxes over both dimensions
(`fsdp_state.shard_groups`).
"""

from __future__ import annotations

import math

import torch

from ..core.placement import LayerPlacement, Placement
from .sequence_parallel import PrepareQuantizedModuleInput, QuantizedRowwiseParallel, check_token_runs, scatter_tokens  # noqa: F401 (styles)

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # a torch built without distributed support: no DTensor to meet
    DTensor = None


def is_distributed(weight) -> bool:
    return DTensor is not None and isinstance(weight, DTensor)


class TensorParallelShard(LayerPlacement):
    """How a tensor-parallel layer's call is placed, for the length of one forward: from the DTensor
    parameter (its mesh and placement) and the layer's quantizers (`LinearQuantizers`). A tensor
    split across the group (`Placement(group)`) is cast with its tensor-wide amaxes reduced over it."""

    def __init__(self, parameter, linear, owner: str, scatter_tokens=None):
        self.parameter, self.linear_quantizers = parameter, linear
        # QuantizedRowwiseParallel's output placement Shard(d): the output gradient is gathered quantized.
        self.scatter_tokens = scatter_tokens
        self.mesh = parameter.device_mesh
        if self.mesh.ndim != 1:
            raise NotImplementedError(
                f"layer {linear.name or '<root>'!r}: its weight {linear.parameter_name} is a DTensor on a "
                f"{self.mesh.ndim}-D mesh at forward time; tensor parallelism shards a quantized layer over one "
                "mesh dimension (FSDP2 gathers the others before the forward)."
            )
        (self.placement,) = parameter.placements
        fsdp = linear.running.fsdp
        if fsdp is not None and not any(g == self.mesh.get_group() for g in fsdp.shard_groups):
            # FSDP2 gathered this weight over another mesh dimension, and its hooks could not tell that
            # tensor parallelism splits it too: its casts would take the amaxes of this rank's piece only.
            raise NotImplementedError(
                f"layer {linear.name or '<root>'!r}: its weight {linear.parameter_name} is sharded by both FSDP2 "
                "and tensor parallelism, and FSDP2's state (which tells qtensor the tensor-parallel mesh its "
                "shard's scale must be reduced over) could not be read on this torch (distributed/fsdp_state.py). "
                "Keep the layer out of quantize_ (filter_fn) or out of parallelize_module."
            )
        if linear.transposed or owner == "MultiheadAttention":
            raise NotImplementedError(
                f"layer {linear.name or '<root>'!r} ({owner}): tensor parallelism of a quantized layer takes "
                "nn.Linear layers (torch's ColwiseParallel / RowwiseParallel do too); keep this layer out of "
                "parallelize_module or out of quantize_ (filter_fn)."
            )
        if isinstance(self.placement, Shard):
            self.kind = {0: "column", 1: "row"}[self.placement.dim % 2]
        elif isinstance(self.placement, Replicate):
            self.kind = "replicated"
        else:
            raise NotImplementedError(
                f"layer {linear.name or '<root>'!r}: its weight {linear.parameter_name} is placed {self.placement} "
                "for tensor parallelism; a quantized layer's weight is Shard(0) (ColwiseParallel), Shard(1) "
                "(RowwiseParallel) or Replicate()."
            )
        split = Placement(self.mesh.get_group())
        if self.kind == "column":  # the weight's rows, and so the output's (and its gradient's) columns
            self.weight = self.grad_output = split
        elif self.kind == "row":  # the weight's columns, and so the input's
            self.input = self.weight = split

    def local_operands(self, x, bias):
        """`x` and `bias` as the style hands them (DTensors), as this rank's GEMMs read them."""
        self._check_block_edges()
        if self.kind == "row":  # the replicated bias is added once, to the reduced output
            return self._input(x, Shard(x.dim() - 1)), None
        bias_local = bias.to_local() if is_distributed(bias) else bias
        if self.kind == "column":
            return self._input(x, Replicate(), grad=Partial()), bias_local
        return self._input(x, Replicate()), bias_local

    def output(self, y, x, weight, bias):
        """The layer's output (a DTensor) from this rank's `y`."""
        if self.kind == "column":
            return DTensor.from_local(y, self.mesh, (Shard(y.dim() - 1),), run_check=False)
        if self.kind == "replicated":
            return DTensor.from_local(y, self.mesh, (Replicate(),), run_check=False)
        dim = self.scatter_tokens.dim % y.dim() if self.scatter_tokens is not None else y.dim() - 1
        if dim < y.dim() - 1:  # sequence parallelism: the backward gathers the gradient quantized
            directions = self._gradient_directions(x, weight, y, dim)
            out = DTensor.from_local(scatter_tokens(y, self.linear_quantizers, self.mesh, dim, directions), self.mesh, (Shard(dim),), run_check=False)
        else:
            out = DTensor.from_local(y, self.mesh, (Partial(),), run_check=False)
        # In the output's dtype, as F.linear adds it under autocast (a float32 bias would promote a
        # bf16 output, and double what the style's reduction sends).
        return out if bias is None else out + bias.to(y.dtype)

    def _check_block_edges(self) -> None:
        """Every tensor split across the group must be split on its format's block edges: a shard
        cast alone then holds exactly its slice of the whole tensor's cast."""
        linear, size = self.linear_quantizers, self.mesh.size()
        if self.kind == "replicated" or size == 1:
            return
        out_features, in_features = self.parameter.shape
        quantized_grad = linear.grad_output if linear.backward_override is None else None
        # (what is split, its role's quantizer, rows or columns of its 2-D view, their count)
        if self.kind == "column":
            splits = [(f"its weight {linear.parameter_name}", linear.weight, 0, out_features),
                      ("its output gradient", quantized_grad, 1, out_features)]
        else:
            splits = [(f"its weight {linear.parameter_name}", linear.weight, 1, in_features),
                      ("its input", linear.input, 1, in_features)]
        for what, quantizer, axis, length in splits:
            if quantizer is None:
                continue
            block = quantizer.shard_block()[axis]
            shard = -(-length // size)
            if block is None and shard < length:
                raise ValueError(
                    f"layer {linear.name or '<root>'!r}: its {quantizer.describe()} quantization scales whole rows of "
                    f"{what}, so tensor parallelism cannot split its {length} columns over {size} ranks (each rank "
                    "would need every row's amax over all of them). Use another recipe for this layer, or keep it "
                    "out of quantize_ (filter_fn) or of parallelize_module."
                )
            if block is not None and shard % block and shard < length:
                lines = ("rows", "columns")[axis]
                raise ValueError(
                    f"layer {linear.name or '<root>'!r}: tensor parallelism over {size} ranks splits the {length} "
                    f"{lines} of {what} into shards of {shard}, which cuts the {block}-{lines[:-1]} blocks of its "
                    f"{quantizer.describe()} quantization. Use a size whose shards are multiples of {block}, fewer "
                    "ranks, or keep this layer out of quantize_ (filter_fn) or of parallelize_module."
                )

    def _gradient_directions(self, x_local, weight, y, dim) -> tuple:
        """The copies of the output gradient this layer's backward reads, gathered in its dtype
        (and cast by the layer) where it keeps its gradient in high precision."""
        linear = self.linear_quantizers
        quantizer = linear.grad_output if linear.backward_override is None else None
        if quantizer is None or not y.requires_grad:
            return ()
        name, world = linear.name or "<root>", self.mesh.size()
        if quantizer.state_buffers():
            raise ValueError(
                f"layer {name!r}: QuantizedRowwiseParallel casts each rank's share of the output gradient, and "
                f"its {quantizer.describe()} quantizer keeps running state (delayed scaling) that a shard's cast "
                "would write alone. Use RowwiseParallel for this layer, or a recipe with current scaling."
            )
        if y.shape[dim] % world:
            raise ValueError(
                f"layer {name!r}: QuantizedRowwiseParallel splits {y.shape[dim]} tokens unevenly over {world} ranks; "
                "a quantized all-gather takes equal shares. Use a sequence length divisible by the tensor-parallel "
                "size, or RowwiseParallel."
            )
        check_token_runs(quantizer, math.prod(y.shape[dim:-1]) // world, world, name, "output gradient", "QuantizedRowwiseParallel", "RowwiseParallel")
        return tuple(d for d, needed in (("rowwise", x_local.requires_grad), ("columnwise", weight.requires_grad)) if needed)

    def _input(self, x, placement, grad=None):
        name = self.linear_quantizers.name or "<root>"
        if not is_distributed(x):
            raise ValueError(
                f"layer {name!r}: a tensor-parallel layer takes a DTensor input placed {placement} (its parallel "
                "style's input hook makes one); got a plain tensor."
            )
        if tuple(x.placements) != (placement,):
            raise ValueError(
                f"layer {name!r}: its input is placed {tuple(x.placements)}, and its weight "
                f"({self.placement}) needs ({placement},); set the style's input_layouts."
            )
        return x.to_local(grad_placements=(grad,) if grad is not None else None)


def install(module: torch.nn.Module) -> None:
    """Give a quantized module whose weight is a DTensor the forward hooks below (once); `dequantize_`
    removes them with the module's other hooks."""
    if module.__dict__.get("_qtensor_tensor_parallel"):
        return
    module._qtensor_tensor_parallel = True
    module._qtensor_hooks += [
        module.register_forward_pre_hook(enter),
        module.register_forward_hook(leave, always_call=True),
    ]


def _on_parameter_registered(module: torch.nn.Module, name: str, parameter) -> None:
    """Called for every parameter a module registers: `parallelize_module` registers a quantized
    layer's weight as a DTensor, and the layer then needs its hooks."""
    if is_distributed(parameter) and name in module.__dict__.get("_qtensor_layers", {}):
        install(module)


if DTensor is not None:
    torch.nn.modules.module.register_module_parameter_registration_hook(_on_parameter_registered)


def enter(module: torch.nn.Module, args) -> None:
    """Forward pre-hook of a quantized module whose weight is a DTensor (`install`): a weight that is a DTensor at forward time was
    placed by tensor parallelism (FSDP2 gathers its own dimension before this hook). For this forward
    the weight attribute is the local shard, placed by its `TensorParallelShard`; its gradient flows
    back to the DTensor parameter."""
    for attribute, (linear, _) in module.__dict__.get("_qtensor_layers", {}).items():
        parameter = module._parameters.get(attribute)
        if not is_distributed(parameter):
            continue
        if torch.compiler.is_compiling():
            raise NotImplementedError(
                f"layer {linear.name or '<root>'!r}: torch.compile over a tensor-parallel quantized layer is not "
                "supported; run the tensor-parallel model eagerly, or compile the blocks of a model that is not "
                "tensor-parallel."
            )
        local = parameter.to_local()
        local.placement = TensorParallelShard(parameter, linear, type(module).__name__, module.__dict__.get("_qtensor_scatter_tokens"))
        module.__dict__[attribute] = local  # found before the parameter by attribute lookup


def leave(module: torch.nn.Module, args, output) -> None:
    """Forward hook (also when the forward raised): the parameter is the module's weight again."""
    if torch.compiler.is_compiling():
        # `enter` placed nothing (it refuses tensor parallelism when traced), and a traced
        # `module.__dict__.pop` would break the graph and send the whole module back to eager.
        return
    for attribute in module.__dict__.get("_qtensor_layers", {}):
        module.__dict__.pop(attribute, None)
