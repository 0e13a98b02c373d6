"""The ops of a `QuantizedStack` (quantized_stack.py), registered in `QuantizedStack._ops`: its views
(detach, the transpose a grouped GEMM reads, the views compiled code replays), one expert
(`stack[e]`), copies, `copy_`, FSDP2's pieces of whole experts; and its `state_dict` entries, one
per expert. Any other op runs on the dequantized values (`_on_values`)."""

from __future__ import annotations

import torch

from ..core import ops as core_ops
from ..core.tensor import QuantizedTensor
from .dynamic_weight import DynamicWeight
from .experts import reads_in_out
from .quantized_stack import QuantizedStack, StackExpert, _on_values, _over_stacked, _stacked, _template, map_stacked

aten = torch.ops.aten


def _alias(func, args, kwargs):
    stack = args[0]
    return QuantizedStack(stack._experts, stack.stacked, stack.linear_quantizers, shape=stack.shape, stride=stack.stride(), layout=stack.expert_layout)


def _transpose(func, args, kwargs):
    """`stack.transpose(-2, -1)`: a view with the matrices the other way round (which a grouped GEMM reads)."""
    stack, a, b = args[0], args[1] % 3, args[2] % 3
    if {a, b} != {1, 2}:
        return _on_values(func, args, kwargs)
    e, r, c = stack.shape
    s0, s1, s2 = stack.stride()
    return QuantizedStack(stack._experts, stack.stacked, stack.linear_quantizers, shape=(e, c, r), stride=(s0, s2, s1), layout=stack.expert_layout)


def _select(func, args, kwargs):
    """`stack[e]`: expert e's quantized weight (its [out, in] matrix; a stack kept [in, out] hands the
    same weight, which its module multiplies as `x @ w[e]`, routed as its linear)."""
    stack, dim, index = args[0], args[1], args[2]
    if dim % 3 != 0:
        return _on_values(func, args, kwargs)
    expert = stack.experts[index]
    if reads_in_out(stack):  # the stack read as [in, out]: its expert so too
        return StackExpert(expert)
    return expert.with_storages(expert.rowwise, expert.columnwise)  # a new tensor over its bytes (autograd makes it a view)


def _to_copy(func, args, kwargs):
    stack = args[0]
    if kwargs.get("dtype") is not None and not kwargs["dtype"].is_floating_point:
        return _on_values(func, args, kwargs)
    stacked = map_stacked(stack.stacked, lambda tensor: tensor.to(device=kwargs.get("device", tensor.device), copy=True))
    return _over_stacked(stacked, _template(stack), stack.linear_quantizers, shape=stack.shape, stride=stack.stride(), dtype=kwargs.get("dtype"))


def _clone(func, args, kwargs):
    return _to_copy(func, (args[0],), {"device": args[0].device})


def _copy(func, args, kwargs):
    """`stack.copy_(src)`: another stack's bytes where every expert's format and layout match, else
    `src`'s values (a plain tensor of the stack's shape, as a master weight or a plain checkpoint
    gives them) cast into each expert."""
    stack, src = args[0], args[1]
    if not isinstance(stack, QuantizedStack):  # a plain tensor receiving a stack's values
        return stack.copy_(src.dequantize())
    if isinstance(src, QuantizedStack):
        if src.shape != stack.shape:
            raise ValueError(f"{stack.linear_quantizers.parameter_name}: cannot copy a stack of shape {list(src.shape)} into {list(stack.shape)}.")
        for mine, theirs in zip(stack.experts, src.experts):
            mine.copy_(theirs)
        return stack
    if src.shape != stack.shape:
        raise ValueError(f"{stack.linear_quantizers.parameter_name}: cannot copy values of shape {list(src.shape)} into the stack {list(stack.shape)}.")
    stack.requantize(src)
    return stack


def _view(func, args, kwargs):
    """A view of the whole stack as it is (compiled code replays the views it hands back), or
    `view(-1)` (FSDP2 keeps its padded shard so, to compare storages: the stack stands for it); else
    refused."""
    stack, shape = args[0], list(args[1])
    if shape in ([-1], list(stack.shape)):
        return _alias(func, args, kwargs)
    return _refuse_piece(func, args, kwargs)


def _as_strided(func, args, kwargs):
    """The stack itself or its transpose, as compiled code replays a view it hands back; else refused."""
    stack, size, stride = args[0], list(args[1]), list(args[2])
    (e, r, c), (s0, s1, s2) = stack.shape, stack.stride()
    if (size, stride) == ([e, r, c], [s0, s1, s2]):
        return _alias(func, args, kwargs)
    if (size, stride) == ([e, c, r], [s0, s2, s1]):
        return _transpose(func, (stack, 1, 2), {})
    return _refuse_piece(func, args, kwargs)


# ---- FSDP2's pieces: whole experts along dim 0 -----------------------------------------------------
def _experts(stack: QuantizedStack, start: int, end: int) -> QuantizedStack:
    """Experts start..end of the stack as it is kept: views of their bytes."""
    _no_expert_configs(stack)
    stacked = map_stacked(stack.stacked, lambda tensor: tensor[start:end])
    experts = stack._experts[start:end] if stack._experts is not None else None
    return QuantizedStack(experts, stacked, stack.linear_quantizers, shape=(end - start, *stack.shape[1:]), stride=stack.stride(), layout=stack.expert_layout)


def _no_expert_configs(stack: QuantizedStack) -> None:
    if stack.linear_quantizers.experts:
        raise NotImplementedError(
            f"{stack.linear_quantizers.parameter_name}: FSDP2 of a stack held quantized whose experts keep running state "
            "(delayed scaling) is not built; quantize the model with weights='dynamic', whose stacks shard with it."
        )


def _split(func, args, kwargs):
    """`split` / `split_with_sizes` along the experts (FSDP2's chunks)."""
    stack, sizes, dim = args[0], args[1], (args[2] if len(args) > 2 else kwargs.get("dim", 0))
    if dim % 3 != 0 or not stack.shape[0]:
        return _refuse_piece(func, args, kwargs)
    count = stack.shape[0]
    sizes = [sizes] * -(-count // sizes) if isinstance(sizes, int) else list(sizes)
    pieces, start = [], 0
    for size in sizes:
        end = min(start + size, count)
        pieces.append(_experts(stack, start, end))
        start = end
    return pieces


def _slice(func, args, kwargs):
    """`stack[a:b]`, `narrow(0, a, n)`: a stack of those experts."""
    stack, dim = args[0], (args[1] if len(args) > 1 else 0)
    start, end, step = (list(args[2:5]) + [None] * 3)[:3]
    start, end, _ = slice(start, end).indices(stack.shape[0])
    step = 1 if step is None else step
    if dim % 3 != 0 or step != 1:
        return _refuse_piece(func, args, kwargs)
    return _experts(stack, start, max(start, end))  # no expert: FSDP2's shard of a rank that gets none


def _new_zeros(func, args, kwargs):
    """A stack of `size[0]` experts of zero codes (FSDP2's padded shard, which the local experts' bytes fill)."""
    stack, size = args[0], list(args[1])
    _no_expert_configs(stack)
    if size[1:] != list(stack.shape[1:]):
        return _refuse_piece(func, args, kwargs)
    stacked = map_stacked(stack.stacked, lambda tensor: tensor.new_zeros((size[0], *tensor.shape[1:])))
    return _over_stacked(stacked, _template(stack), stack.linear_quantizers, shape=size)


def _new_empty(func, args, kwargs):
    """The piece FSDP2 makes for a rank that gets no expert (more ranks than experts, `new_empty(0)`):
    a stack of none, whose gather input is all padding."""
    size = list(args[1])
    if func is aten.new_empty.default and (size == [0] or size == [0, *args[0].shape[1:]]):
        return _experts(args[0], 0, 0)
    return _refuse_piece(func, args, kwargs)


def _refuse_piece(func, args, kwargs):
    """A piece of the stack other than whole experts (a slice of each matrix, a reshaping view):
    refused, since its dequantized values would go on as a high-precision weight."""
    raise NotImplementedError(
        f"{args[0].linear_quantizers.parameter_name}: {func} of an expert stack held quantized is not built: its pieces "
        "would be high-precision values. A stack held quantized splits into whole experts (stack[a:b], FSDP2's shards); "
        "tensor parallelism shards a stack held dynamic: quantize the model with weights='dynamic'."
    )


QuantizedStack._views = frozenset({aten.detach.default, aten.alias.default, aten.transpose.int, aten.view.default, aten._unsafe_view.default, aten.as_strided.default})
QuantizedStack._ops = {
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.transpose.int: _transpose,
    aten.select.int: _select,
    aten._to_copy.default: _to_copy,
    aten.clone.default: _clone,
    aten.copy_.default: _copy,
    aten.view.default: _view,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.slice.Tensor: _slice,
    aten.new_zeros.default: _new_zeros,
    aten.as_strided.default: _as_strided,
    aten._unsafe_view.default: _view,
    **dict.fromkeys(
        (aten.new_empty.default, aten.new_empty_strided.default, aten.empty_like.default),
        _new_empty,
    ),
}


def state_entry(value: torch.Tensor) -> torch.Tensor:
    """A layer weight's `state_dict` entry: a dynamic weight's values as a plain tensor (sharded: a
    DTensor of plain shards), so that safetensors, save_pretrained and torch.distributed.checkpoint
    see an ordinary tensor; a quantized weight or stack as it is, a stack sharded by FSDP2 gathered
    whole (a collective: every rank builds the state_dict), each then expanded into its experts'
    entries."""
    if isinstance(value, DynamicWeight):
        return value.plain()
    local = getattr(value, "_local_tensor", None)
    if isinstance(local, DynamicWeight):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local.plain(), value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride())
    if isinstance(local, QuantizedStack):  # sharded by experts (FSDP2): the whole stack, gathered as its bytes
        return _gathered(value)
    return value


def _sharding(value) -> tuple:
    """(process group, this rank's first expert) of a DTensor over a shard of whole experts."""
    from torch.distributed.tensor import Shard

    local = value._local_tensor
    if tuple(value.placements) != (Shard(0),):
        raise NotImplementedError(
            f"{local.linear_quantizers.parameter_name}: a stack held quantized saves and loads sharded by FSDP2 along its "
            f"experts over one mesh dimension (Shard(0)); this one is placed {tuple(value.placements)}."
        )
    group = value.device_mesh.get_group()
    padded = -(-value.shape[0] // torch.distributed.get_world_size(group))  # FSDP2's chunks: the last ones may hold fewer
    return group, torch.distributed.get_rank(group) * padded


def _gathered(value) -> QuantizedStack:
    """The whole stack behind a DTensor over a shard of whole experts, on every rank: every buffer's
    experts all-gathered as they are (codes and scales), as a gather for the forward sends them."""
    local = value._local_tensor
    group, _ = _sharding(value)
    world, experts = torch.distributed.get_world_size(group), value.shape[0]
    padded = -(-experts // world)

    def gathered(piece):  # as bytes (gloo takes no FP8 dtype), each rank's experts padded to FSDP2's chunk
        flat = piece.new_zeros((padded, *piece.shape[1:]))
        flat[: piece.shape[0]].copy_(piece)
        flat = flat.reshape(-1).view(torch.uint8)
        out = flat.new_empty(flat.numel() * world)
        torch.distributed.all_gather_into_tensor(out, flat, group=group)
        return out.view(piece.dtype).reshape(-1, *piece.shape[1:])[:experts]

    stacked = map_stacked(local.stacked, gathered)
    return _over_stacked(stacked, _template(local), local.linear_quantizers, shape=value.shape, stride=value.stride())


def is_stack(value) -> bool:
    """A stack held quantized, or a DTensor over a shard of one."""
    return isinstance(getattr(value, "_local_tensor", value), QuantizedStack)


# ---- state_dict: one entry per expert ------------------------------------------------------------
def expert_keys(prefix: str, attribute: str, count: int) -> list[str]:
    """The state_dict keys of a stack's experts: `expert_weights.<attribute>.<e>` in its module (not
    under `<attribute>.`, whose keys transformers converts as the stack's own when it saves)."""
    return [f"{prefix}expert_weights.{attribute}.{expert}" for expert in range(count)]


def expanded_entries(state_dict: dict, prefix: str, attribute: str) -> None:
    """Replace a stack's entry by its experts' quantized weights (`expert_keys`), in place and in order."""
    key = prefix + attribute
    stack = state_dict[key]
    items = list(state_dict.items())
    state_dict.clear()
    for name, value in items:
        if name != key:
            state_dict[name] = value
            continue
        state_dict.update(zip(expert_keys(prefix, attribute, len(stack.experts)), stack.experts))


def assembled_entry(state_dict: dict, prefix: str, attribute: str, stack) -> None:
    """Before a load: the experts' entries of a stack (as `expanded_entries` wrote them) taken out and
    put back as one entry for the stack (a DTensor over this rank's experts where FSDP2 shards it),
    which its `copy_` restores byte for byte. A plain entry for the stack (a dynamic model's, a plain
    checkpoint's) stays: `copy_` casts it."""
    sharded, stack = stack, getattr(stack, "_local_tensor", stack)  # FSDP2's DTensor over a shard of experts, or the stack
    names = expert_keys(prefix, attribute, sharded.shape[0])
    if prefix + attribute in state_dict or not all(name in state_dict for name in names):
        return
    experts = [state_dict.pop(name) for name in names]
    mine_all = stack.experts if sharded is stack else [stack.first_expert()] * len(experts)  # a shard's experts share one layout
    for name, mine, theirs in zip(names, mine_all, experts):
        if not isinstance(theirs, QuantizedTensor) or not core_ops.byte_compatible(mine, theirs):
            got = f"{type(theirs).__name__} {list(theirs.shape)}" + (f" from {theirs.quantizer!r}" if isinstance(theirs, QuantizedTensor) else "")
            raise ValueError(
                f"{name}: the model's expert holds {type(mine).data_class.__name__} {list(mine.shape)} from "
                f"{mine.quantizer!r}, the entry {got}. Quantize the model with the recipe it was saved with."
            )
        # An expert's saved quantizer state (delayed scaling's history) travels inside its entry.
        mine.quantizer.load_state_buffers(theirs.quantizer.state_buffers(), f"{name}.quantizer.")
    whole = _over_stacked(_stacked(experts), experts[0], stack.linear_quantizers, shape=sharded.shape, stride=sharded.stride())
    if sharded is not stack:  # this rank's experts, placed as the parameter is
        from torch.distributed.tensor import DTensor

        _, first = _sharding(sharded)
        local = _experts(whole, first, first + stack.shape[0]).to(stack.device)
        whole = DTensor.from_local(local, sharded.device_mesh, sharded.placements, run_check=False, shape=sharded.shape, stride=sharded.stride())
    state_dict[prefix + attribute] = whole
