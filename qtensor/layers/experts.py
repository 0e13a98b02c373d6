"""Expert stacks: a mixture of experts' fused 3-D weights, quantized as E separate matrices.

A stack is one parameter `[experts, out_features, in_features]` (`gate_up_proj`, `down_proj`), or
`[experts, in_features, out_features]` where its module multiplies it as stored (a module with
`is_transposed = True`, as gpt-oss's experts). `quantize_` makes it a dynamic weight over the whole
stack carrying one `LinearQuantizers` (with delayed scaling, one per expert besides:
`LinearQuantizers.experts`, each expert's own quantizers and histories); every use of it multiplies
one expert's matrix at a time, cast on its own (its own per-tensor scale, its own row-wise, block or
MX scales), as that expert's quantized linear would (linear.py). routing.py recognises the three
ways a model multiplies a stack and brings them here:

- `F.linear(x, w[e])` (or `x @ w[e]` for a stack kept `[in, out]`): `w[e]` is a 2-D dynamic weight
  of the stack (dynamic_weight.py), and F.linear is that expert's quantized linear.
- `torch.bmm` over `w[expert_ids]` (gathered experts, one per row): the gather is not made;
  `GatheredExperts` remembers the stack and the ids, and the bmm runs each expert's quantized linear
  over its rows (in the order they come) and puts the rows back.
- `F.grouped_mm` / `torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)` over rows sorted by
  expert (or transformers' own grouped GEMM op): each group `x[ends[e - 1]:ends[e]]` through expert
  e's linear, all in one autograd Function (grouped_linear.py; delayed scaling: each expert's dense
  quantized linear in turn). An empty group multiplies nothing; rows past the last end come out
  zero (grouped_mm leaves them unwritten). `w.transpose(-2, -1)` is a view of the stack
  (dynamic_weight.py), and which way round a grouped GEMM reads it is told by its strides.

Each group's input (and gradient) is cast as one tensor: a per-tensor scale covers the group's rows,
blocks along the rows (the columnwise copies wgrad reads) run over the group's rows in their order.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import replace

import torch

from . import grouped_linear as grouped
from .config import LayerRunning, carries_quantizers
from .linear import quantized_linear


def is_stack(tensor) -> bool:
    """A quantized layer's weight that is a stack of expert matrices."""
    return carries_quantizers(tensor) and tensor.dim() == 3


def reads_in_out(stack) -> bool:
    """Whether `stack` (or the view of it a model passes) holds its matrices as [in, out]: a stack kept
    so (`is_transposed`), or `stack.transpose(-2, -1)` of an [out, in] one, a view whose last two
    dimensions run the other way round in memory (and the reverse)."""
    swapped = stack.stride(-1) != 1 and stack.stride(-2) == 1
    return stack.linear_quantizers.transposed != swapped


def stack_orientation(module) -> bool:
    """Whether `module` multiplies its stacks as stored (`[experts, in, out]`): transformers marks
    such experts modules `is_transposed`."""
    return bool(getattr(module, "is_transposed", False))


# Run eagerly inside a compiled model (a graph break each): the groups' rows are read from `offs`,
# data the compiled graph does not know.
@torch.compiler.disable
def grouped_linear(x: torch.Tensor, stack: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`grouped_mm(x, stack as [experts, in, out], offs=offs)`: rows `offs[e - 1]:offs[e]` through
    expert e's quantized linear; rows past `offs[-1]` zero."""
    in_out = reads_in_out(stack)
    if grouped.sizes_on_device(x, stack, offs):  # the host never reads the offsets: checked on the device
        _check_offsets_on_device(offs, stack, x)
        return grouped.grouped_linear(x, stack, None, in_out, offs)
    ends = _host_ends(offs)
    if len(ends) != stack.shape[0] or any(b < a for a, b in zip([0, *ends], ends)) or (ends and ends[-1] > x.shape[0]):
        raise ValueError(
            f"{stack.linear_quantizers.name or 'An expert stack'}: grouped GEMM offsets {ends} must be {stack.shape[0]} "
            f"non-decreasing group ends within the input's {x.shape[0]} rows."
        )
    # A stack without running state to note: one Function.
    if not stack.linear_quantizers.records_amaxes:
        return grouped.grouped_linear(x, stack, ends, in_out, offs)  # the whole stack in one autograd Function
    # Each expert's linear records its amaxes, reduced over the layer's group where it has one: then
    # every expert runs, with no rows too, so every rank joins the same reductions in the same order
    # whatever its routing (an expert no rank gave a row records amax 0 that step).
    every_expert = _reduces_over_ranks(stack.linear_quantizers)
    pieces, start = [], 0
    for expert, end in enumerate(ends):
        if end > start or every_expert:
            pieces.append(_expert_linear(x[start:end], stack, expert, in_out))
        start = end
    return _joined(pieces, x, stack, x.shape[0] - start, in_out)


def _check_offsets_on_device(offs: torch.Tensor, stack, x: torch.Tensor) -> None:
    """The checks of `grouped_linear`'s offsets, made on the device where the host does not read
    them: a failing one stops the program at the GPU's next synchronisation with this message."""
    name = stack.linear_quantizers.name or "An expert stack"
    if offs.dim() != 1 or offs.shape[0] != stack.shape[0]:
        raise ValueError(f"{name}: grouped GEMM offsets of shape {list(offs.shape)} must be {stack.shape[0]} group ends.")
    ordered = (torch.diff(offs, prepend=offs.new_zeros(1)) >= 0).all() & (offs[-1] <= x.shape[0])
    torch._assert_async(ordered, f"{name}: grouped GEMM offsets must be non-decreasing group ends within the input's {x.shape[0]} rows.")


def _reduces_over_ranks(linear) -> bool:
    group = linear.layers()[0].running.group()
    return group is not None and torch.distributed.get_world_size(group) > 1


# The group ends last read to the host: (the offsets tensor, its version, the ends). A mixture of
# experts' two grouped GEMMs (gate_up, then down) share one `offs`; the second reads the ends kept
# here instead of waiting for the GPU again (`offs.tolist()` is a sync: the host stops launching
# until the GPU has caught up, and the GPU then idles while the next casts are launched).
_last_ends: tuple = (None, -1, [])


def _host_ends(offs: torch.Tensor) -> list[int]:
    global _last_ends
    if offs.is_inference():  # no version counter to tell an in-place change by
        return [int(end) for end in offs.tolist()]
    kept, version, ends = _last_ends
    if kept is not None and kept() is offs and version == offs._version:
        _last_ends = (None, -1, [])  # used once: the layer's second GEMM; nothing stale outlives it
        return ends
    ends = [int(end) for end in offs.tolist()]
    _last_ends = (weakref.ref(offs), offs._version, ends)
    return ends


@torch.compiler.disable
def rows_through_experts(x: torch.Tensor, stack: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Row i of `x` through expert `ids[i]`'s quantized linear: each expert's rows, in the order they
    come, as one group."""
    if ids.shape[0] != x.shape[0]:
        raise ValueError(f"torch.bmm over gathered experts: {ids.shape[0]} experts for {x.shape[0]} rows.")
    order = torch.sort(ids, stable=True).indices  # each expert's rows in the order they come
    counts = torch.bincount(ids, minlength=stack.shape[0])
    grouped = grouped_linear(x[order], stack, counts.cumsum(0))  # gathered experts: the stack as kept
    return grouped[torch.argsort(order)]


def _expert_linear(x: torch.Tensor, stack: torch.Tensor, expert: int, in_out: bool) -> torch.Tensor:
    if in_out != stack.linear_quantizers.transposed:  # a view of the stack the other way round
        stack = stack.transpose(-2, -1)  # the stack as it is kept (a view of it)
    return quantized_linear(x, stack[expert])  # stack[expert]: that expert's 2-D weight


def _joined(pieces, x, stack, missing_rows: int, in_out: bool) -> torch.Tensor:
    if missing_rows or not pieces:
        out_features = stack.shape[-1] if in_out else stack.shape[-2]
        dtype = pieces[0].dtype if pieces else x.dtype
        pieces.append(x.new_zeros((missing_rows, out_features), dtype=dtype))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def stacks_of(module) -> list[tuple[str, int, int, int, bool]]:
    """The expert stacks `module` itself holds: (attribute, experts, in_features, out_features,
    stored [in, out]) of every 3-D floating-point parameter. A convolution's 3-D weight (nn.Conv1d)
    is no stack of experts."""
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return []
    found = []
    for attribute, param in module.named_parameters(recurse=False):
        if param.dim() == 3 and param.dtype.is_floating_point:
            transposed = stack_orientation(module)
            experts, rows, cols = param.shape
            found.append((attribute, experts, rows if transposed else cols, cols if transposed else rows, transposed))
    return found


def is_router(module) -> bool:
    """A mixture of experts' router (transformers' `...TopKRouter`, a `...Router`): its weight scores
    the experts, which every low-precision recipe keeps in high precision (a rounding there changes
    which experts a token goes to)."""
    return type(module).__name__.endswith(("Router", "TopKRouter"))


def unquantized_stack_reason(module, param) -> str:
    """Why a parameter of more than two dimensions that is not an expert stack stays in high precision."""
    *stack, rows, cols = param.shape
    return (
        f"a stack of {math.prod(stack)} [{rows}, {cols}] matrices in {type(module).__name__} (fused experts, multiplied "
        "by a grouped GEMM): qtensor quantizes 2-D linear weights and [experts, out, in] stacks, so it stays in high precision"
    )


def with_expert_configs(linear, count: int, quantizers_for):
    """`linear`, a stack's configuration whose quantizers keep running state (delayed scaling), with
    one configuration per expert: the first expert's roles are the stack's; each other expert's come
    from another call of the factory (`quantizers_for()`), so each keeps its own amax histories."""
    configs = [replace(linear, name=f"{linear.name}[0]", running=LayerRunning(linear.running.amax_group))]
    for expert in range(1, count):
        configs.append(replace(linear, **quantizers_for(), name=f"{linear.name}[{expert}]", running=LayerRunning(linear.running.amax_group)))
    return replace(linear, experts=tuple(configs))


def state_prefixes(layer_prefix: str, attribute: str, linear) -> list:
    """(state_dict key prefix, configuration) of each layer whose running state a module's entry for
    `attribute` holds: the layer itself, or each expert of a stack (`expert_quantizers.<attribute>.<e>.`;
    not under `<attribute>.`, whose keys transformers converts as the stack's own when it saves)."""
    if not linear.experts:
        return [(layer_prefix, linear)]
    return [(f"expert_quantizers.{attribute}.{expert}.", config) for expert, config in enumerate(linear.experts)]
