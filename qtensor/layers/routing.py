"""Which calls mean "this layer's linear": F.linear, and the matmul / addmm forms of it, on a layer weight.

Every layer weight's `__torch_function__` (weight.py) comes here: `x @ weight.t()` and
`torch.addmm(bias, x, weight.t())` (a transposed weight remembers its layer), a Hugging Face
Conv1D's `torch.addmm(bias, x, weight)`, and nn.MultiheadAttention's projections (attention.py) run
the quantized linear; anything else runs with plain-tensor semantics.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect

import torch
import torch.nn.functional as F

from . import experts
from .attention import multi_head_attention
from ..core.flatten import plain
from ..core.kernels import is_fake
from .config import carries_quantizers
from .linear import quantized_linear

# A switch per thread and task: False inside `high_precision()`.
_quantizing: contextvars.ContextVar = contextvars.ContextVar("qtensor_quantizing", default=True)


@contextlib.contextmanager
def high_precision():
    """Inside, every quantized layer runs in high precision: its linear multiplies the weight's
    high-precision values (a dynamic weight's own; a quantized weight's dequantized ones) and the
    plain input, and gradients flow to the parameters as for a stock layer. Nothing is quantized and
    no delayed-scaling history changes. For evaluating or debugging without `dequantize_`. Under
    torch.compile the switch is read when a graph is traced."""
    token = _quantizing.set(False)
    try:
        yield
    finally:
        _quantizing.reset(token)


@torch._dynamo.assume_constant_result
def _quantizing_now() -> bool:
    """The switch; under torch.compile read once, when the graph is traced (Dynamo cannot trace a
    ContextVar, and a graph break here would split every block at each of its linears)."""
    return _quantizing.get()


_TRANSPOSES = {torch.Tensor.t, torch.t, torch.Tensor.T.__get__, torch.Tensor.mT.__get__, torch.Tensor.transpose, torch.transpose}
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}
_ADDMMS = {torch.addmm, torch.Tensor.addmm}
_GROUPED_MMS = tuple(f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f is not None)
_BMMS = {torch.bmm, torch.Tensor.bmm}
_EXPERTS_CALLS = frozenset({*_GROUPED_MMS, *_BMMS, torch.Tensor.__getitem__})


def _swaps_the_two_dims(args) -> bool:
    """t()/T/mT always do; transpose(a, b) only when a and b name different dims."""
    if len(args) < 3:
        return True
    return args[1] % 2 != args[2] % 2


def _linear_args(args, kwargs):
    names = ("input", "weight", "bias")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound["input"], bound["weight"], bound.get("bias")


def _multiplies_as_stored(weight) -> bool:
    """A Conv1D's weight: its module computes `x @ weight`, meaning the layer's linear."""
    return carries_quantizers(weight) and weight.linear_quantizers.transposed


def intercept(func, args, kwargs):
    """Route the calls that mean "this layer's linear" to `quantized_linear`; NotImplemented otherwise."""
    if func in _EXPERTS_CALLS or _is_grouped_mm_op(func):  # a grouped or batched GEMM over an expert stack (experts.py)
        result = _experts_call(func, args, kwargs)
        if result is not NotImplemented:
            return result
    if func is F.linear:
        x, weight, bias = _linear_args(args, kwargs)
        if carries_quantizers(weight):
            return quantized_linear(x, weight, bias)
    elif func in _TRANSPOSES:
        weight = args[0]
        if carries_quantizers(weight) and not _multiplies_as_stored(weight) and weight.dim() == 2 and _swaps_the_two_dims(args):
            with torch._C.DisableTorchFunctionSubclass():
                values = func(*args, **kwargs)
            return TransposedWeight.of(values, weight)
    elif func in _MATMULS:
        if len(args) == 2 and not kwargs:
            if isinstance(args[1], TransposedWeight):
                return quantized_linear(args[0], args[1].weight)
            if _multiplies_as_stored(args[1]):
                return quantized_linear(args[0], args[1])
    elif func is F.multi_head_attention_forward:
        return multi_head_attention(args, kwargs)
    elif func in _ADDMMS:
        bias, x, weight = args[:3]
        plain_scaling = len(args) == 3 and kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1
        if plain_scaling and bias.dim() == 1:
            if isinstance(weight, TransposedWeight):
                return quantized_linear(x, weight.weight, bias)
            if _multiplies_as_stored(weight):  # Conv1D.forward: torch.addmm(bias, x, weight)
                return quantized_linear(x, weight, bias)
    return NotImplemented


def torch_function(func, args, kwargs):
    """The __torch_function__ of a layer weight: the layer's quantized linear where `func` means it,
    otherwise `func` with plain-tensor semantics."""
    result = route(func, args, kwargs)
    return plain(func, args, kwargs) if result is NotImplemented else result


def route(func, args, kwargs):
    """The layer's quantized linear (or the gradient through it) where `func` means it; NotImplemented otherwise."""
    if not _quantizing_now():
        return NotImplemented
    if func is torch.autograd.grad:
        return _grad_through_edges(args, kwargs)
    return intercept(func, args, kwargs)


_GRAD_SIGNATURE = inspect.signature(torch.autograd.grad)


def _grad_through_edges(args, kwargs):
    """torch.autograd.grad(outputs, inputs=[..., weight]): hand the weights over as gradient edges.

    Running grad from here with torch functions disabled would let activation recomputation inside
    the backward reach plain F.linear instead of the quantized one; with edges, grad sees no
    subclass and runs as usual."""
    bound = _GRAD_SIGNATURE.bind(*args, **kwargs)
    inputs = bound.arguments["inputs"]
    if isinstance(inputs, dict):
        return NotImplemented

    def edge(tensor):
        routed = isinstance(tensor, torch.Tensor) and torch.overrides.has_torch_function((tensor,))
        return torch.autograd.graph.get_gradient_edge(tensor) if routed else tensor

    bound.arguments["inputs"] = edge(inputs) if isinstance(inputs, torch.Tensor) else [edge(t) for t in inputs]
    outputs = bound.arguments["outputs"]
    if torch.overrides.has_torch_function((outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)):
        return NotImplemented
    return torch.autograd.grad(*bound.args, **bound.kwargs)



class TransposedWeight(torch.Tensor):
    """`weight.t()` of a quantized layer: the plain (dequantized) values, attached to autograd as
    usual, that remember their weight so `x @ weight.t()` and `torch.addmm(b, x, weight.t())` run
    the layer's quantized linear. Any other op sees the plain values and returns plain tensors."""

    weight: torch.Tensor

    @staticmethod
    def of(values: torch.Tensor, weight: torch.Tensor) -> "TransposedWeight":
        transposed = values.as_subclass(TransposedWeight)
        transposed.weight = weight
        return transposed

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return torch_function(func, args, kwargs or {})


# ---- expert stacks (experts.py): the calls that multiply one, and what stands for a view of one ----
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
        return plain(torch.Tensor.__getitem__, (self.stack, self.expert_ids), {})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
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


def _refuse_traced(stack) -> None:
    if torch.compiler.is_compiling() or is_fake(stack):
        raise NotImplementedError(
            f"{stack.linear_quantizers.name or 'An expert stack'}: torch.compile traced a batched GEMM over gathered "
            "experts of a quantized stack, which qtensor does not trace yet. Run the experts module eagerly inside the "
            "compiled model (experts.forward = torch.compiler.disable(experts.forward)), or use transformers' "
            "'eager' or 'grouped_mm' experts implementation."
        )


# transformers' own grouped GEMM, which its grouped_mm experts call where torch's is not taken (under
# torch.compile with float32 operands, for one): a custom op, the same call as torch._grouped_mm.
_GROUPED_MM_OPS = ("transformers::grouped_mm_fallback",)


def _is_grouped_mm_op(func) -> bool:
    name = getattr(func, "_qualified_op_name", None)  # an OpOverloadPacket
    if name is None and isinstance(func, torch._ops.OpOverload):
        name = func._schema.name
    return name in _GROUPED_MM_OPS


@torch.compiler.disable  # under torch.compile the experts run eagerly (a graph break each)
def _experts_call(func, args, kwargs):
    """The experts' quantized linears where `func` multiplies an expert stack (layers/experts.py);
    NotImplemented otherwise."""
    if func in _GROUPED_MMS or _is_grouped_mm_op(func):
        return _grouped(args, kwargs)
    if func in _BMMS and len(args) == 2 and not kwargs:
        return _batched(*args)
    if func is torch.Tensor.__getitem__ and experts.is_stack(args[0]):
        index = args[1]
        if isinstance(index, torch.Tensor) and index.dim() == 1 and not index.dtype.is_floating_point and index.dtype != torch.bool:
            _refuse_traced(args[0])
            return GatheredExperts(args[0], index)
        return plain(func, args, kwargs)  # w[e]: one expert's weight (dynamic_weight.py), made here, eagerly
    return NotImplemented


def _grouped(args, kwargs):
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    bound = dict(zip(names, args))
    bound.update({{"input": "mat_a", "weight": "mat_b"}.get(name, name): value for name, value in kwargs.items()})
    x, weight, offs = bound.get("mat_a"), bound.get("mat_b"), bound.get("offs")
    # An [experts, in, out] stack: one kept so, or `stack.transpose(-2, -1)` of an [experts, out, in] one.
    if not experts.is_stack(weight):
        return NotImplemented
    stack = weight
    if not experts.reads_in_out(stack):
        raise NotImplementedError(
            f"{stack.linear_quantizers.name or 'An expert stack'}: a grouped GEMM reads a stack as [experts, in, out]; "
            f"this one is [experts, out, in] ({list(stack.shape)}), which is not its layer's linear. Pass "
            "stack.transpose(-2, -1), or keep the stack in high precision (quantize_(..., exclude=[...]))."
        )
    if offs is None or x is None or x.dim() != 2 or bound.get("bias") is not None or bound.get("out_dtype") is not None:
        raise NotImplementedError(
            f"{stack.linear_quantizers.name or 'An expert stack'}: qtensor runs a grouped GEMM of a 2-D input over an "
            "expert stack with group ends (offs) and no bias or out_dtype; this call has input "
            f"{None if x is None else list(x.shape)}, offs {'given' if offs is not None else 'missing'}. Add the bias after "
            "the call, or keep the stack in high precision (quantize_(..., exclude=[...]))."
        )
    return experts.grouped_linear(x, stack, offs)


def _batched(a, b):
    """torch.bmm(stack[ids], x[..., None]) (an `[experts, out, in]` stack) or
    torch.bmm(x[:, None], stack[ids]) (an `[experts, in, out]` one): each row through its expert."""
    if isinstance(a, GatheredExperts) and not a.stack.linear_quantizers.transposed and b.dim() == 3 and b.shape[-1] == 1:
        gathered, x = a, b.squeeze(-1)
        return experts.rows_through_experts(x, gathered.stack, gathered.expert_ids).unsqueeze(-1)
    if isinstance(b, GatheredExperts) and b.stack.linear_quantizers.transposed and a.dim() == 3 and a.shape[1] == 1:
        gathered, x = b, a.squeeze(1)
        return experts.rows_through_experts(x, gathered.stack, gathered.expert_ids).unsqueeze(1)
    return NotImplemented
