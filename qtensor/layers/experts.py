"""Expert stacks: a mixture of experts' fused 3-D weights, quantized as E separate matrices.

A stack is one parameter `[experts, out_features, in_features]` (`gate_up_proj`, `down_proj`), or
`[experts, in_features, out_features]` where its module multiplies it as stored (a module with
`is_transposed = True`, as gpt-oss's experts). `quantize_` makes it a dynamic weight over the whole
stack carrying one `LinearQuantizers`; every use of it multiplies one expert's matrix at a time, cast
on its own (its own per-tensor scale, its own row-wise, block or MX scales), by the layer's
quantized linear (linear.py). The three ways a model multiplies a stack all come here:

- `F.linear(x, w[e])` (or `x @ w[e]` for a stack kept `[in, out]`): `w[e]` is a 2-D dynamic weight
  of the stack (dynamic_weight.py), and F.linear is that expert's quantized linear.
- `torch.bmm` over `w[expert_ids]` (gathered experts, one per row): the gather is not made;
  `GatheredExperts` remembers the stack and the ids, and the bmm runs each expert's quantized linear
  over its rows (in the order they come) and puts the rows back.
- `F.grouped_mm` / `torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)` over rows sorted by
  expert: each group `x[ends[e - 1]:ends[e]]` through expert e's quantized linear. An empty group
  multiplies nothing; rows past the last end come out zero (grouped_mm leaves them unwritten).

Each group's input (and gradient) is cast as one tensor: a per-tensor scale covers the group's rows,
blocks along the rows (the columnwise copies wgrad reads) run over the group's rows in their order.
"""

from __future__ import annotations

import torch

from .config import carries_quantizers
from .linear import quantized_linear

_GROUPED_MMS = tuple(f for f in (getattr(torch.nn.functional, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f is not None)
_BMMS = {torch.bmm, torch.Tensor.bmm}
# What `intercept` may take: the routing asks it about these only.
FUNCTIONS = frozenset({*_GROUPED_MMS, *_BMMS, torch.Tensor.__getitem__})


def is_stack(tensor) -> bool:
    """A quantized layer's weight that is a stack of expert matrices."""
    return carries_quantizers(tensor) and tensor.dim() == 3


def stack_orientation(module) -> bool:
    """Whether `module` multiplies its stacks as stored (`[experts, in, out]`): transformers marks
    such experts modules `is_transposed`."""
    return bool(getattr(module, "is_transposed", False))


class StackTranspose(torch.Tensor):
    """`stack.transpose(-2, -1)` of an `[experts, out, in]` stack: the plain values (a view, attached
    to autograd as usual) that remember their stack, so that a grouped GEMM over them runs each
    expert's quantized linear. Any other op sees the plain values."""

    stack: torch.Tensor

    @staticmethod
    def of(values: torch.Tensor, stack: torch.Tensor) -> "StackTranspose":
        transposed = values.as_subclass(StackTranspose)
        transposed.stack = stack
        return transposed

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from .routing import torch_function

        return torch_function(func, args, kwargs or {})


class GatheredExperts(torch.Tensor):
    """`stack[expert_ids]`: the experts of each row, not gathered. A bmm with a row of inputs runs each
    expert's quantized linear; any other op gets the gathered plain values, made then."""

    stack: torch.Tensor
    expert_ids: torch.Tensor

    @staticmethod
    def __new__(cls, stack: torch.Tensor, expert_ids: torch.Tensor):
        shape = (expert_ids.shape[0], *stack.shape[1:])
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=stack.dtype, device=stack.device)
        self.stack, self.expert_ids = stack, expert_ids
        return self

    def gathered(self) -> torch.Tensor:
        """The plain gathered values, attached to autograd through the stack."""
        from .routing import plain

        return plain(torch.Tensor.__getitem__, (self.stack, self.expert_ids), {})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from .routing import route

        kwargs = kwargs or {}
        result = route(func, args, kwargs)
        if result is not NotImplemented:
            return result
        args, kwargs = torch.utils._pytree.tree_map_only(GatheredExperts, lambda g: g.gathered(), (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = torch.utils._pytree.tree_map_only(GatheredExperts, lambda g: g.gathered(), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self, *, tensor_contents=None):
        return f"GatheredExperts(experts {self.expert_ids.tolist()} of a stack {list(self.stack.shape)})"


def intercept(func, args, kwargs):
    """The experts' quantized linears where `func` multiplies a stack; NotImplemented otherwise."""
    if func in _GROUPED_MMS:
        return _grouped(args, kwargs)
    if func in _BMMS and len(args) == 2 and not kwargs:
        return _batched(*args)
    if func is torch.Tensor.__getitem__ and is_stack(args[0]):
        index = args[1]
        if isinstance(index, torch.Tensor) and index.dim() == 1 and not index.dtype.is_floating_point and index.dtype != torch.bool:
            return GatheredExperts(args[0], index)
    return NotImplemented


def transposed_stack(func, args, kwargs):
    """`stack.transpose(-2, -1)` (or `.mT`) of an `[experts, out, in]` stack, as a `StackTranspose`."""
    from .routing import plain

    return StackTranspose.of(plain(func, args, kwargs), args[0])


def _grouped(args, kwargs):
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    x, weight, offs = bound.get("mat_a"), bound.get("mat_b"), bound.get("offs")
    if isinstance(weight, StackTranspose):
        stack = weight.stack
    elif is_stack(weight) and weight.linear_quantizers.transposed:  # an [experts, in, out] stack, as stored
        stack = weight
    else:
        return NotImplemented
    if offs is None or x is None or x.dim() != 2 or bound.get("bias") is not None or bound.get("out_dtype") is not None:
        raise NotImplementedError(
            f"{stack.linear_quantizers.name or 'An expert stack'}: qtensor runs a grouped GEMM of a 2-D input over an "
            "expert stack with group ends (offs) and no bias or out_dtype; this call has input "
            f"{None if x is None else list(x.shape)}, offs {'given' if offs is not None else 'missing'}. Add the bias after "
            "the call, or keep the stack in high precision (quantize_(..., exclude=[...]))."
        )
    return grouped_linear(x, stack, offs)


def grouped_linear(x: torch.Tensor, stack: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`grouped_mm(x, stack as [experts, in, out], offs=offs)`: rows `offs[e - 1]:offs[e]` through
    expert e's quantized linear; rows past `offs[-1]` zero."""
    ends = [int(end) for end in offs.tolist()]
    if len(ends) != stack.shape[0] or any(b < a for a, b in zip([0, *ends], ends)) or (ends and ends[-1] > x.shape[0]):
        raise ValueError(
            f"{stack.linear_quantizers.name or 'An expert stack'}: grouped GEMM offsets {ends} must be {stack.shape[0]} "
            f"non-decreasing group ends within the input's {x.shape[0]} rows."
        )
    pieces, start = [], 0
    for expert, end in enumerate(ends):
        if end > start:
            pieces.append(_expert_linear(x[start:end], stack, expert))
        start = end
    return _joined(pieces, x, stack, x.shape[0] - start)


def _batched(a, b):
    """torch.bmm(stack[ids], x[..., None]) (an `[experts, out, in]` stack) or
    torch.bmm(x[:, None], stack[ids]) (an `[experts, in, out]` one): each row through its expert."""
    if isinstance(a, GatheredExperts) and not a.stack.linear_quantizers.transposed and b.dim() == 3 and b.shape[-1] == 1:
        gathered, x = a, b.squeeze(-1)
        return _rows_through_experts(x, gathered).unsqueeze(-1)
    if isinstance(b, GatheredExperts) and b.stack.linear_quantizers.transposed and a.dim() == 3 and a.shape[1] == 1:
        gathered, x = b, a.squeeze(1)
        return _rows_through_experts(x, gathered).unsqueeze(1)
    return NotImplemented


def _rows_through_experts(x: torch.Tensor, gathered: GatheredExperts) -> torch.Tensor:
    ids, stack = gathered.expert_ids, gathered.stack
    if ids.shape[0] != x.shape[0]:
        raise ValueError(f"torch.bmm over gathered experts: {ids.shape[0]} experts for {x.shape[0]} rows.")
    order = torch.sort(ids, stable=True).indices  # each expert's rows in the order they come
    counts = torch.bincount(ids, minlength=stack.shape[0])
    grouped = grouped_linear(x[order], stack, counts.cumsum(0))
    return grouped[torch.argsort(order)]


def _expert_linear(x: torch.Tensor, stack: torch.Tensor, expert: int) -> torch.Tensor:
    return quantized_linear(x, stack[expert])  # stack[expert]: that expert's 2-D dynamic weight


def _joined(pieces, x, stack, missing_rows: int) -> torch.Tensor:
    if missing_rows or not pieces:
        out_features = stack.shape[-1] if stack.linear_quantizers.transposed else stack.shape[-2]
        dtype = pieces[0].dtype if pieces else x.dtype
        pieces.append(x.new_zeros((missing_rows, out_features), dtype=dtype))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def stacks_of(module) -> list[tuple[str, int, int, int, bool]]:
    """The expert stacks `module` itself holds: (attribute, experts, in_features, out_features,
    stored [in, out]) of every 3-D floating-point parameter."""
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


def unsupported_stack_reason(quantizers: dict, weights: str) -> str | None:
    """Why a stack cannot be quantized with these quantizers in this weight mode yet, or None."""
    if weights == "quantized":
        return "weights='quantized' does not take expert stacks yet: quantize_(..., weights='dynamic') quantizes them"
    stateful = [role for role, q in quantizers.items() if q is not None and q.state_buffers()]
    if stateful:
        return (
            f"delayed scaling ({', '.join(stateful)}) does not take expert stacks yet (one amax history per expert is "
            "not built): use current scaling for the experts (a factory may choose by role.module_type == 'experts')"
        )
    return None
