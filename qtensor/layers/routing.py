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


def _swaps_the_two_dims(args) -> bool:
    """t()/T/mT always do; transpose(a, b) only when a and b name different dims."""
    if len(args) < 3:
        return True
    return args[1] % 2 != args[2] % 2


def _swaps_the_last_two_of_three(func, args) -> bool:
    """`.mT`, or transpose(a, b) with a and b the last two dims of a 3-D tensor."""
    if func is torch.Tensor.mT.__get__:
        return True
    return func in (torch.Tensor.transpose, torch.transpose) and len(args) >= 3 and {args[1] % 3, args[2] % 3} == {1, 2}


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
    if func in experts.FUNCTIONS:  # a grouped or batched GEMM over an expert stack (experts.py)
        result = experts.intercept(func, args, kwargs)
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
        if experts.is_stack(weight) and not _multiplies_as_stored(weight) and _swaps_the_last_two_of_three(func, args):
            return experts.transposed_stack(func, args, kwargs)
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


def plain(func, args, kwargs):
    """`func` on plain-tensor semantics (no subclass's __torch_function__ runs again)."""
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


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


