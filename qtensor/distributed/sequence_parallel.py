"""Sequence parallelism in low precision: the activation all-gather before the column-parallel layers
carries quantized bytes.

Under sequence parallelism each tensor-parallel rank holds its slice of the tokens between the
attention and MLP blocks, and torch's `PrepareModuleInput` all-gathers the whole sequence before
the column-parallel projections (q/k/v, gate/up), in the activation's dtype.
`PrepareQuantizedModuleInput` takes the same arguments and does the same, but gathers the quantized
activation instead:

- **Forward.** Each rank casts its own tokens once, with the input quantizer of the block's first
  quantized linear (`quantizer_from` names another). The tensor-wide amaxes are reduced over the
  group, so the pieces are the slices of one cast. One all-gather of the rowwise bytes then serves
  every projection reading the input: they multiply it as it arrived, without a cast of their own.
- **Backward.** The weight gradients read the activation's columnwise copy. Each rank keeps its own
  tokens' copy, made by the same cast, and the first weight gradient that needs it gathers it, once
  for all the projections. The saved activation is then one rank's share, not the whole sequence.
- **What stays in high precision.** The input gradient is a sum of the ranks' partial sums, so it is
  reduce-scattered in the activation gradient's dtype, as without quantization.

Pieces are reordered after the gather: a batch-first activation `[batch, tokens, ...]` split along
its tokens holds, on each rank, `batch` runs of rows of the whole 2-D view. Each run must hold whole
blocks of both directions (for MXFP8, 32 tokens per rank; checked, with an error naming the layer).

The projections find the gathered activation's `GatheredTokens` placement (core/placement.py) through
the activation itself: it checks what they read and keeps the columnwise copy for their backward.
A projection that cannot take the gathered cast raises, naming itself:
- one whose input quantizer differs from the one the gather cast with;
- one with `backward_override="high_precision"`, which needs the high-precision input;
- a delayed-scaling input quantizer, whose scale is each layer's own history.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass, field

import torch

from ..core.numerics import sharded_cast
from ..core.placement import Placement, place
from ..core.quantizer import fold_to_2d
from .packing import aligned, row_buffers, unpacked_rows
from ..core.storage import Storage
from ..core.tensor import split_rebuilt

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel
except ImportError:  # a torch built without distributed support
    PrepareModuleInput = RowwiseParallel = object

# A diagnostic counter for the whole process, written under a lock: bytes this process handed to the
# quantized sequence-parallel all-gathers, and what the same gathers would send in the activation's dtype.
_STATS = {"all_gathers": 0, "bytes": 0, "high_precision_bytes": 0}
_STATS_LOCK = threading.Lock()


def gather_stats(reset: bool = False) -> dict[str, int]:
    """{"all_gathers", "bytes", "high_precision_bytes"} since the last reset: what this process sent
    in quantized sequence-parallel all-gathers (forward and backward), and what gathering the same
    activations in their own dtype would have sent."""
    with _STATS_LOCK:
        stats = dict(_STATS)
        if reset:
            _STATS.update(all_gathers=0, bytes=0, high_precision_bytes=0)
    return stats


@dataclass(eq=False)
class TokenLayout:
    """How the rows of an activation's 2-D view are spread over a tensor-parallel group when the
    activation is split along one of its leading dimensions: each rank holds `outer` runs of `run`
    rows, and the whole tensor's rows are, run by run, rank 0's, rank 1's, ... .

    The columnwise copy that the backward gathers is kept here between the first weight gradient
    that asks for it and the last (`users` counts the saved references still to be unpacked)."""

    group: object
    world: int
    outer: int
    run: int
    high_precision_itemsize: int
    users: int = 0
    columnwise: Storage | None = field(default=None, repr=False)

    def gather(self, storages: list[Storage]) -> list[Storage]:
        """Every rank's `storages` (this rank's rows of each), in one all-gather of their per-row
        buffers as uint8 (tensor-wide ones are every rank's already), each joined in the whole
        tensor's row order."""
        buffers = [buffer for storage in storages for buffer in row_buffers(storage)]
        per_rank = sum(aligned(buffer.nbytes) for buffer in buffers)
        payload = torch.zeros(per_rank, dtype=torch.uint8, device=storages[0].device)
        offset = 0
        for buffer in buffers:
            payload[offset : offset + buffer.nbytes].copy_(buffer.reshape(-1).view(torch.uint8))
            offset += aligned(buffer.nbytes)
        output = torch.empty(per_rank * self.world, dtype=torch.uint8, device=payload.device)
        _all_gather(output, payload, self.group)
        with _STATS_LOCK:
            _STATS["all_gathers"] += 1
            _STATS["bytes"] += per_rank
            _STATS["high_precision_bytes"] += storages[0].rows * storages[0].cols * self.high_precision_itemsize
        offsets = [rank * per_rank for rank in range(self.world)]
        joined = []
        with torch.autocast(payload.device.type, enabled=False):  # torch.cat refuses float8 under autocast
            for storage in storages:
                ranks = []
                for rank in range(self.world):
                    piece, offsets[rank] = unpacked_rows(output, storage, storage.rows, offsets[rank])
                    ranks.append(piece)
                if self.outer > 1:  # batch-first: each rank's rows are `outer` runs, interleaved with the others'
                    ranks = [ranks[rank].slice_rows(i * self.run, (i + 1) * self.run) for i in range(self.outer) for rank in range(self.world)]
                joined.append(type(storage).cat_rows(ranks))
        return joined

    def gathered_columnwise(self, local: Storage) -> Storage:
        """The whole columnwise copy from this rank's `local` one: gathered by the first caller,
        kept for the others, and released when the last saved reference is unpacked."""
        gathered = self.columnwise if self.columnwise is not None else self.gather([local])[0]
        self.users -= 1
        self.columnwise = gathered if self.users > 0 else None
        return gathered


class GatheredTokens(Placement):
    """The placement of an activation gathered quantized over a tensor-parallel group: whole in its
    rowwise copy, which the projections multiply as it arrived, and this rank's rows of its
    columnwise copy (`local_columnwise`, None where no backward reads it), which the first weight
    gradient that reads it gathers over `layout`."""

    made_by = " by PrepareQuantizedModuleInput"
    instead = (
        "Name this layer in the style's quantizer_from, give the layers that read one input the same input "
        "quantizer and backward, or use PrepareModuleInput for this block."
    )

    def __init__(self, layout: TokenLayout, local_columnwise: Storage | None):
        super().__init__()
        self.layout, self.local_columnwise = layout, local_columnwise

    def arrived(self, quantizer, tensor, layer, role, *, directions):
        """The rowwise copy as it arrived; the columnwise one stays this rank's until the backward."""
        if "columnwise" in directions and self.local_columnwise is None:
            raise ValueError(
                f"layer {layer.name or '<root>'!r}: its weight gradient needs the columnwise copy of its input, which "
                "PrepareQuantizedModuleInput made for no gradient: it cast under torch.no_grad, for a block whose "
                "parameters need no gradient, or for one whose layers all override their backward. Run the block's "
                "forward with gradients enabled."
            )
        return super().arrived(quantizer, tensor, layer, role, directions=("rowwise",))

    def saved(self, tensor, direction):
        if direction != "columnwise" or self.local_columnwise is None:
            return super().saved(tensor, direction)
        self.layout.users += 1
        return self.local_columnwise, self

    def restored(self, storage: Storage) -> Storage:
        return self.layout.gathered_columnwise(storage)


class _GatherTokens(torch.autograd.Function):
    """Forward: this rank's tokens cast once and all-gathered as quantized bytes, returned as a
    replicated DTensor over the whole sequence. Backward: the partial sums of the input gradient
    reduce-scattered back to this rank's tokens."""

    @staticmethod
    def forward(ctx, x, quantizer, mesh, dim: int, columnwise: bool):
        group, world = mesh.get_group(), mesh.size()
        x2d = fold_to_2d(x)
        with sharded_cast(group):
            local = quantizer.quantize(x2d, rowwise=True, columnwise=columnwise)
        outer = math.prod(x.shape[:dim])
        layout = TokenLayout(group, world, outer, x2d.shape[0] // outer, x.element_size())
        shape = (*x.shape[:dim], x.shape[dim] * world, *x.shape[dim + 1 :])
        (rowwise,) = layout.gather([local.rowwise])
        whole = local.with_storages(rowwise, None, shape=torch.Size(shape))
        place(whole, GatheredTokens(layout, local.columnwise if columnwise else None))
        ctx.mesh, ctx.dim, ctx.layout = mesh, dim, layout
        return DTensor.from_local(whole, mesh, (Replicate(),), run_check=False)

    @staticmethod
    def backward(ctx, grad):
        # Every projection's backward has run (their gradients are this one's input): the gathered
        # columnwise copy is released even where a saved reference was never unpacked (a projection
        # recomputed under activation checkpointing packs its references twice).
        ctx.layout.columnwise, ctx.layout.users = None, 0
        # The projections' input gradients are partial sums (Partial): one reduce-scatter adds them.
        return grad.redistribute(ctx.mesh, (Shard(ctx.dim),)).to_local(), None, None, None, None


class PrepareQuantizedModuleInput(PrepareModuleInput):
    """`PrepareModuleInput` whose all-gathers of sequence-sharded activations carry quantized bytes.

    Same arguments as torch's style, plus `quantizer_from`: the name, relative to the module, of the
    quantized linear layer whose input quantizer casts the gathered activation (default: the first
    quantized linear below the module, as `module.modules()` lists them). An input placed
    `Shard(d)` (a leading dimension) and wanted `Replicate()` is cast on each rank and gathered as
    its quantized bytes; any other layout change is torch's.
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_output: bool = False, quantizer_from: str | None = None):
        super().__init__(input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
                         input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
                         use_local_output=use_local_output)
        self.quantizer_from = quantizer_from
        self._module = None

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        # parallelize_module may apply one style to many modules: each gets a copy that knows its own.
        bound = type(self).__new__(type(self))
        bound.__dict__.update(self.__dict__, _module=weakref.ref(module))
        return PrepareModuleInput._apply(bound, module, device_mesh)

    def _prepare_input_arg(self, input, mesh, input_layout, desired_layout):
        gathers = (
            isinstance(input_layout, Shard) and isinstance(desired_layout, Replicate)
            and isinstance(input, torch.Tensor) and input.is_floating_point()
        )
        if gathers and isinstance(input, DTensor) and tuple(input.placements) != (input_layout,):
            gathers = False  # not placed as input_layouts says: torch's style redistributes it as it is
        if not gathers or input.numel() == 0:
            return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)
        local = input.to_local() if isinstance(input, DTensor) else input
        dim = input_layout.dim % local.dim()
        if isinstance(input, DTensor) and input.shape[dim] != local.shape[dim] * mesh.size():
            raise ValueError(
                f"{type(self).__name__}: the input's {input.shape[dim]} tokens are split unevenly over {mesh.size()} "
                "ranks; a quantized all-gather takes equal shares. Use a sequence length divisible by the "
                "tensor-parallel size, or PrepareModuleInput."
            )
        if dim == local.dim() - 1:
            raise ValueError(
                f"{type(self).__name__}: the input is sharded along its last dimension ({input_layout}); a quantized "
                "all-gather joins rows (tokens), Shard(d) of a leading dimension d. Use PrepareModuleInput."
            )
        layer = self._layer()
        quantizer = layer.input
        self._check(layer, quantizer, local, dim, mesh.size())
        # The columnwise copy, for the weight gradients of the layers below that quantize their backward.
        module = self._module()
        below = [linear for m in module.modules() for linear, _ in m.__dict__.get("_qtensor_layers", {}).values()]
        columnwise = torch.is_grad_enabled() and any(linear.backward_override is None for linear in below) and any(
            p.requires_grad for p in module.parameters()
        )
        gathered = _GatherTokens.apply(local, quantizer, mesh, dim, columnwise)
        return gathered.to_local() if self.use_local_output else gathered

    def _layer(self):
        module = self._module()
        if self.quantizer_from is not None:
            found = [module.get_submodule(self.quantizer_from)]
        else:
            found = [m for m in module.modules() if m.__dict__.get("_qtensor_layers")]
        if not found or not found[0].__dict__.get("_qtensor_layers"):
            where = f"{self.quantizer_from!r} under it" if self.quantizer_from is not None else "no quantized linear below it"
            raise ValueError(
                f"{type(self).__name__} on {type(module).__name__}: {where} is not a quantized layer, so there is no "
                "input quantizer to cast the gathered activation with. Call qtensor.quantize_ on the model first, "
                "or name a quantized layer in quantizer_from."
            )
        (linear, _), *_ = found[0].__dict__["_qtensor_layers"].values()
        return linear

    def _check(self, layer, quantizer, local, dim, world) -> None:
        name = layer.name or "<root>"
        if quantizer is None:
            raise ValueError(f"{type(self).__name__}: layer {name!r} keeps its input in high precision; use PrepareModuleInput.")
        if not quantizer.casts_reproducibly():
            raise ValueError(
                f"{type(self).__name__}: layer {name!r} casts its input with {quantizer.describe()}, whose scale comes "
                "from the layer's own running state, so one cast cannot serve every layer reading the input. "
                "Use PrepareModuleInput, or a recipe with current scaling."
            )
        check_token_runs(quantizer, math.prod(local.shape[dim:-1]), world, name, "input", type(self).__name__, "PrepareModuleInput")


def check_token_runs(quantizer, run: int, world: int, name: str, what: str, style: str, instead: str) -> None:
    """ValueError unless `run`, the rows of one rank's run of tokens (its share of the sequence times
    the dimensions between it and the last), holds whole row blocks of `quantizer`'s copies: a
    quantized all-gather joins runs, and a block cut between two ranks' runs would be two casts."""
    block = quantizer.shard_block()[0]
    if run % block:
        raise ValueError(
            f"{style}: layer {name!r}'s {what} is gathered in runs of {run} rows from each of {world} ranks, which "
            f"cuts the {block}-row blocks of its {quantizer.describe()} quantization. Use a sequence length whose "
            f"share per rank is a multiple of {block}, or {instead}."
        )


def _all_gather(output: torch.Tensor, payload: torch.Tensor, group) -> None:
    import torch.distributed as dist

    # all_gather_single is all_gather_into_tensor's newer name (torch 2.13).
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, payload, group=group)


# ---- the backward's gradient all-gather ------------------------------------------------------------
# Whether a gradient cast sends fewer bytes than the gradient itself, by (quantizer, 2-D shape, dtype).
_GRADIENT_GATHER_PAYS: dict[tuple, bool] = {}


class _ScatterTokens(torch.autograd.Function):
    """Forward: a row-parallel layer's partial sums reduce-scattered to this rank's tokens, in their
    dtype. Backward: the gradient of this rank's tokens cast once by the layer's grad_output quantizer
    (tensor-wide amaxes reduced over the group) and all-gathered as quantized bytes, both copies the
    layer's backward reads (Float8 sends one and rebuilds the other); in the gradient's own dtype
    where a format's two copies are not fewer bytes than that (MXFP8: 2 + 1/16 bytes an element)."""

    @staticmethod
    def forward(ctx, y, linear, mesh, dim: int, directions: tuple):
        ctx.linear, ctx.mesh, ctx.dim, ctx.directions = linear, mesh, dim, directions
        partial = DTensor.from_local(y, mesh, (Partial(),), run_check=False)
        return partial.redistribute(mesh, (Shard(dim),)).to_local()

    @staticmethod
    def backward(ctx, grad):
        quantizer, mesh, dim = ctx.linear.grad_output, ctx.mesh, ctx.dim
        grad2d = fold_to_2d(grad)
        key = (quantizer, tuple(grad2d.shape), grad.dtype, ctx.directions)
        if _GRADIENT_GATHER_PAYS.get(key, True):
            with sharded_cast(mesh.get_group()):
                local = quantizer.quantize(grad2d, rowwise="rowwise" in ctx.directions, columnwise="columnwise" in ctx.directions)
            rebuilt, sent = split_rebuilt(local, ctx.directions)
            sent_bytes = sum(b.nbytes for d in sent for b in local.storage_for(d).buffers.values())
            if len(_GRADIENT_GATHER_PAYS) >= 1024:  # one entry per gradient shape: bounded, as storage's layout cache
                _GRADIENT_GATHER_PAYS.clear()
            _GRADIENT_GATHER_PAYS[key] = sent_bytes < grad.numel() * grad.element_size()
        if not _GRADIENT_GATHER_PAYS[key]:
            whole = DTensor.from_local(grad, mesh, (Shard(dim),), run_check=False).redistribute(mesh, (Replicate(),))
            return whole.to_local(), None, None, None, None
        outer = math.prod(grad.shape[:dim])
        layout = TokenLayout(mesh.get_group(), mesh.size(), outer, grad2d.shape[0] // outer, grad.element_size())
        gathered = dict(zip(sent, layout.gather([local.storage_for(d) for d in sent])))
        for direction in rebuilt:
            gathered[direction] = gathered["rowwise"].to_direction(direction)
        shape = (*grad.shape[:dim], grad.shape[dim] * mesh.size(), *grad.shape[dim + 1 :])
        whole = local.with_storages(gathered.get("rowwise"), gathered.get("columnwise"), shape=torch.Size(shape))
        return whole, None, None, None, None


def scatter_tokens(y: torch.Tensor, linear, mesh, dim: int, directions: tuple) -> torch.Tensor:
    """A row-parallel layer's output `y` (this rank's partial sums over the whole sequence) as this
    rank's tokens of the sum, with the backward's gradient all-gather in low precision."""
    return _ScatterTokens.apply(y, linear, mesh, dim, directions)


class QuantizedRowwiseParallel(RowwiseParallel):
    """`RowwiseParallel` whose backward all-gathers the output gradient as quantized bytes, under
    sequence parallelism (`output_layouts=Shard(d)` of a leading dimension d): each rank casts its
    tokens' gradient once with the layer's grad_output quantizer, and the layer's backward GEMMs
    multiply the gathered cast. Same arguments as torch's style; any other output layout is torch's."""

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        (layout,) = self.output_layouts
        if isinstance(layout, Shard):
            module.__dict__["_qtensor_scatter_tokens"] = layout
        return super()._apply(module, device_mesh)
