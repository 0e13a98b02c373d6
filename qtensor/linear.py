"""F.linear through quantized weights: the autograd Function (fprop, dgrad, wgrad) and the
torch-function entry points that route a stock nn.Linear to it (DESIGN.md §1).

A layer's quantizers travel on its weight: a `QuantizedTensor` parameter (`weights="quantized"`) or a
`DynamicWeight` (`weights="dynamic"`: high-precision values, quantized at use) carries a
`LinearQuantizers` in its `linear_quantizers` attribute. `F.linear(x, weight, bias)` on such a
weight, and `x @ weight.t()` / `torch.addmm(bias, x, weight.t())`, run `QuantizedLinearFunction`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_flatten, tree_map_only

from . import gemm, layer_state
from .formats.float8 import deferring_amax_records, replaying_delayed_scales, write_amax_records
from .numerics import ceil_div
from .quantizer import INPUT_DTYPES, Quantizer, fold_to_2d
from .tensor import QuantizedTensor

BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


@dataclass(frozen=True)
class LinearQuantizers:
    """The quantizers of one linear layer, by tensor role; None keeps that tensor in high precision.
    Compares and hashes by value (torch.compile guards on the one a weight carries)."""

    input: Quantizer | None
    weight: Quantizer | None
    grad_output: Quantizer | None
    backward_override: str | None = None
    name: str = ""
    # The parameter's qualified name where it is not `<name>.weight` (nn.MultiheadAttention's
    # `<name>.in_proj_weight`), for messages.
    parameter: str = ""
    # A Hugging Face Conv1D: its module computes `torch.addmm(bias, x, weight)` with the weight kept
    # as [in_features, out_features]. A dynamic weight keeps that layout; a quantized one is held
    # as [out_features, in_features], the layout every GEMM of the layer reads.
    transposed: bool = False

    @property
    def parameter_name(self) -> str:
        return self.parameter or (f"{self.name}.weight" if self.name else "weight")

    def describe(self) -> str:
        parts = [f"{role}={q.describe() if q is not None else 'high precision'}" for role, q in self.roles().items()]
        if self.backward_override:
            parts.append(f"backward={self.backward_override}")
        return ", ".join(parts)

    def roles(self) -> dict[str, Quantizer | None]:
        return {"input": self.input, "weight": self.weight, "grad_output": self.grad_output}

    def state_buffers(self) -> dict[str, torch.Tensor]:
        """The quantizers' running state by `<role>.<name>` (delayed scaling's amax histories): the
        live tensors. The weight lists them among its inner tensors (layer_state.py)."""
        return {
            f"{role}.{name}": buffer
            for role, quantizer in self.roles().items()
            if quantizer is not None
            for name, buffer in quantizer.state_buffers().items()
        }

    def move_state(self, device: torch.device) -> None:
        for quantizer in self.roles().values():
            if quantizer is not None:
                quantizer.move_state(device)

    @contextlib.contextmanager
    def using_state(self, buffers: dict[str, torch.Tensor]):
        """Inside, the quantizers run on `buffers` (named as `state_buffers()`) as their state."""
        with contextlib.ExitStack() as stack:
            for role, quantizer in self.roles().items():
                if quantizer is not None:
                    mine = {name.partition(".")[2]: b for name, b in buffers.items() if name.partition(".")[0] == role}
                    stack.enter_context(quantizer.using_state(mine))
            yield


def carries_quantizers(tensor) -> bool:
    return getattr(tensor, "linear_quantizers", None) is not None


# ---- the autograd Function ---------------------------------------------------------------------
def _only(tensor: torch.Tensor, direction: str | None) -> torch.Tensor:
    """An alias of a quantized operand that keeps just `direction`, what the backward reads."""
    if direction is None or not isinstance(tensor, QuantizedTensor):
        return tensor
    # The same storages without the other direction's (what `detach()` then `update_usage` give,
    # without a trip through __torch_dispatch__).
    storage = tensor.storage_for(direction)
    return tensor.with_storages(storage if direction == "rowwise" else None, storage if direction == "columnwise" else None)


def _quantize(quantizer: Quantizer | None, tensor: torch.Tensor, *, rowwise: bool, columnwise: bool) -> torch.Tensor:
    if quantizer is None:
        return tensor
    return quantizer.quantize(tensor, rowwise=rowwise, columnwise=columnwise)


# The most recent input cast: (weak reference to the input, its version, quantizer, quantized).
# Layers that read one activation (q, k and v projections; an MLP's gate and up) cast it once.
_last_input_cast: list = [None]


def _input_operand(quantizer: Quantizer | None, x: torch.Tensor, x2d: torch.Tensor, *, columnwise: bool) -> torch.Tensor:
    """The input for this layer's GEMMs: `x2d` quantized, or the cast the previous layer made of the
    same unchanged `x` with an equal quantizer that casts reproducibly (no state, no random draws)."""
    if quantizer is None:
        return x2d
    shareable = quantizer.casts_reproducibly() and not (
        torch.compiler.is_compiling() or is_fake(x) or x.is_inference()
    )
    if shareable:
        last = _last_input_cast[0]
        if (
            last is not None
            and last[0]() is x
            and last[1] == x._version
            and (last[3].has_columnwise or not columnwise)
            and last[2] == quantizer
        ):
            return last[3]
    quantized = quantizer.quantize(x2d, rowwise=True, columnwise=columnwise)
    _last_input_cast[0] = (weakref.ref(x), x._version, quantizer, quantized) if shareable else None
    return quantized


def _weight_operand(weight, linear: LinearQuantizers, *, columnwise: bool, training: bool) -> torch.Tensor:
    """The weight for this step: the quantized parameter itself, or the dynamic weight quantized
    now (a training forward reuses the cast of this optimizer step's first micro-batch)."""
    if isinstance(weight, QuantizedTensor):
        if columnwise and not weight.has_columnwise:
            raise ValueError(
                f"The quantized weight of {linear.name or 'this layer'} holds no columnwise copy, which "
                "dgrad needs. Quantize the weight with columnwise=True (qtensor.quantize_ does)."
            )
        return weight
    if isinstance(weight, DynamicWeight) and linear.weight is not None:
        return weight.quantized(columnwise=columnwise, cached=training)
    return _quantize(linear.weight, _plain(weight), rowwise=True, columnwise=columnwise)


def _plain(weight: torch.Tensor) -> torch.Tensor:
    """A high-precision weight as the [out_features, in_features] matrix the GEMMs read."""
    if not isinstance(weight, DynamicWeight):
        return weight
    return weight.plain().t() if weight.linear_quantizers.transposed else weight.plain()


def _in_features(weight: torch.Tensor) -> int:
    return weight.shape[0] if isinstance(weight, DynamicWeight) and weight.linear_quantizers.transposed else weight.shape[-1]


def _output_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    if not x.is_meta and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return torch.promote_types(x.dtype, weight.dtype)


def _pack_saved(tensor: torch.Tensor | None):
    """(the plain tensors to save for backward, how to rebuild `tensor` from them): a quantized tensor
    is saved as its buffers, so every saved-tensor hook (save_on_cpu, pinned or not, activation
    checkpointing, offloading hooks) moves and measures plain bytes, and never turns the quantized
    copy into a high-precision one (a plain pinned buffer copied from it would dequantize it)."""
    if not isinstance(tensor, QuantizedTensor):
        return [tensor], None
    names, context = tensor.__tensor_flatten__()
    names = [name for name in names if not layer_state.is_state_name(name)]  # the layer's state is not saved
    # `.data`: the buffers' own version counters stay out of autograd's check, as they were when the
    # wrapper was saved (FSDP2 gathers a weight into the same buffers again before the backward).
    return [getattr(tensor, name).data for name in names], (type(tensor), names, context, tensor.shape, tensor.stride())


def _unpack_saved(tensors, rebuild) -> torch.Tensor | None:
    if rebuild is None:
        return tensors[0]
    cls, names, context, shape, stride = rebuild
    return cls.__tensor_unflatten__(dict(zip(names, tensors)), context, shape, stride)


class QuantizedLinearFunction(torch.autograd.Function):
    """y = x · Wᵀ + b with each GEMM on the operands the layer's quantizers chose.

    Every tensor is quantized once per step with the usages its backward needs; only what the
    backward needs is saved.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, linear: LinearQuantizers, input_needs_grad: bool, weight_needs_grad: bool, state: dict | None):
        override = linear.backward_override
        quantized_backward = override is None
        training = input_needs_grad or weight_needs_grad
        # forward runs without autograd recording: no detach needed (and none allowed on inference tensors).
        x2d = fold_to_2d(x)
        # A compiled training step writes its layer state in the backward only: the compiler keeps
        # the weight's state one input, which it can update in the forward or in the backward of a
        # step, not in both. The forward's casts note their amaxes; the backward records them.
        deferring = training and bool(state) and (torch.compiler.is_compiling() or is_fake(x))
        with deferring_amax_records() if deferring else contextlib.nullcontext([]) as amax_records:
            x_q = _input_operand(linear.input, x, x2d, columnwise=weight_needs_grad and quantized_backward)
            w_q = _weight_operand(weight, linear, columnwise=input_needs_grad and quantized_backward, training=training)

        y = gemm.fprop(x_q, w_q, bias, _output_dtype(x, weight))
        # Not a view of y (torch._unsafe_view, as torch's own linear): FSDP2 warns about modules returning views.
        out = torch.ops.aten._unsafe_view(y, (*x.shape[:-1], y.shape[-1]))

        if override is None:
            saved_x, saved_w = (x_q, "columnwise"), (w_q, "columnwise")
        elif override == "dequantized":
            saved_x, saved_w = (x_q, "rowwise"), (w_q, "rowwise")
        else:  # high_precision: the original operands (a quantized parameter has no other)
            original_w = weight.dequantize() if isinstance(weight, QuantizedTensor) and input_needs_grad else _plain(weight)
            saved_x, saved_w = (x2d, None), (original_w, None)
        x_tensors, ctx.x_rebuild = _pack_saved(_only(*saved_x) if weight_needs_grad else None)
        w_tensors, ctx.w_rebuild = _pack_saved(_only(*saved_w) if input_needs_grad else None)
        ctx.save_for_backward(*x_tensors, *w_tensors)
        ctx.linear = linear
        ctx.state, ctx.amax_records = state, amax_records
        ctx.needs_grad = (input_needs_grad, weight_needs_grad)
        ctx.x_meta = (x.shape, x.dtype)
        ctx.weight_dtype = weight.dtype
        ctx.grad_weight_transposed = isinstance(weight, DynamicWeight) and linear.transposed
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from .optim import hand_over_at_end_of_backward

        hand_over_at_end_of_backward()
        _last_input_cast[0] = None  # the forward is over: the last input cast is freed
        saved = ctx.saved_tensors
        split = len(saved) - len(ctx.w_rebuild[1] if ctx.w_rebuild else [None])
        saved_x, saved_w = _unpack_saved(saved[:split], ctx.x_rebuild), _unpack_saved(saved[split:], ctx.w_rebuild)
        input_needs_grad, weight_needs_grad = ctx.needs_grad
        linear = ctx.linear
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_weight = grad_bias = None

        if linear.backward_override == "dequantized":
            # The exact fp32 values the forward GEMM multiplied, not a rounding of them to x's dtype.
            saved_x, saved_w = (
                t.dequantize(torch.float32, "rowwise") if isinstance(t, QuantizedTensor) else t for t in (saved_x, saved_w)
            )
        grad_q = grad_2d
        with linear.using_state(ctx.state) if ctx.state else contextlib.nullcontext():
            write_amax_records(ctx.amax_records)
            if linear.backward_override is None and (input_needs_grad or weight_needs_grad):
                # Quantized once, with both usages the two backward GEMMs need.
                grad_q = _quantize(linear.grad_output, grad_2d, rowwise=input_needs_grad, columnwise=weight_needs_grad)

        if input_needs_grad:
            x_shape, x_dtype = ctx.x_meta
            grad_x = gemm.dgrad(grad_q, saved_w, x_dtype).reshape(x_shape)
        if weight_needs_grad:
            grad_weight = gemm.wgrad(grad_q, saved_x, ctx.weight_dtype)
            if ctx.grad_weight_transposed:  # the parameter keeps Conv1D's [in, out] layout
                grad_weight = grad_weight.t()
        if ctx.needs_input_grad[2]:
            grad_bias = grad_2d.float().sum(0).to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with the quantizers `weight` carries."""
    name = weight.linear_quantizers.name or "a quantized linear layer"
    in_features = _in_features(weight)
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(
            f"{name}: input of shape {list(x.shape)} does not match weight {list(weight.shape)}; "
            f"the input's last dimension must be {in_features}."
        )
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name}: input is {x.dtype}; quantized layers take float32, bfloat16 or float16 inputs.")
    grad_enabled = torch.is_grad_enabled()
    # A forward that runs while a backward pass executes is activation recomputation.
    recomputing = torch._C._current_graph_task_id() != -1
    # Traced by torch.compile, the casts use the copies of the layer state the weight carries (layer_state.py).
    state = layer_state.traced_state_of(weight)
    linear = weight.linear_quantizers
    with torch._C.DisableTorchFunctionSubclass(), replaying_delayed_scales() if recomputing else contextlib.nullcontext():
        with linear.using_state(state) if state else contextlib.nullcontext():
            return QuantizedLinearFunction.apply(
                x, weight, bias, linear, grad_enabled and x.requires_grad, grad_enabled and weight.requires_grad, state
            )


# ---- torch-function entry points ---------------------------------------------------------------
_TRANSPOSES = {torch.Tensor.t, torch.t, torch.Tensor.T.__get__, torch.Tensor.mT.__get__, torch.Tensor.transpose, torch.transpose}
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}
_ADDMMS = {torch.addmm, torch.Tensor.addmm}


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
        return _attention(args, kwargs)
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
    """The __torch_function__ of every weight type: the layer's quantized linear where `func` means
    it, otherwise `func` itself on plain-tensor semantics."""
    kwargs = kwargs or {}
    if func is torch.autograd.grad:
        result = _grad_through_edges(args, kwargs)
    else:
        result = intercept(func, args, kwargs)
    if result is not NotImplemented:
        return result
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


_ATTENTION_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
_PROJECTION_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj_weight")


def _attention(args, kwargs):
    """nn.MultiheadAttention hands its projection weights to F.multi_head_attention_forward, whose
    body calls F.linear out of reach of this subclass. Here the in-projections run first (quantized
    where their weights carry quantizers), the body runs on the projected q, k, v with identity
    projections that cost nothing, and the out-projection runs on its result."""
    bound = _ATTENTION_SIGNATURE.bind(*args, **kwargs)
    arguments = bound.arguments
    if not any(carries_quantizers(arguments.get(name)) for name in _PROJECTION_WEIGHTS):
        return NotImplemented
    q, k, v = _in_projections(arguments)
    identity = IdentityProjection(q.shape[-1], q.dtype, q.device)
    out_weight, out_bias = arguments["out_proj_weight"], arguments.get("out_proj_bias")
    quantized_out = carries_quantizers(out_weight)
    arguments.update(
        query=q,
        key=k,
        value=v,
        in_proj_weight=None,
        in_proj_bias=None,
        use_separate_proj_weight=True,
        q_proj_weight=identity,
        k_proj_weight=identity,
        v_proj_weight=identity,
    )
    if quantized_out:
        arguments.update(out_proj_weight=identity, out_proj_bias=None)
    with torch._C.DisableTorchFunctionSubclass():
        attention, attention_weights = F.multi_head_attention_forward(*bound.args, **bound.kwargs)
    if quantized_out:
        attention = quantized_linear(attention, out_weight, out_bias)
    return attention, attention_weights


def _in_projections(arguments) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v as F.multi_head_attention_forward's body would compute them, each projection
    through `_project`. Self-attention projects once with the whole packed weight, as nn.Linear would."""
    query, key, value = arguments["query"], arguments["key"], arguments["value"]
    biases = arguments.get("in_proj_bias")
    biases = (None, None, None) if biases is None else biases.chunk(3)
    if arguments.get("use_separate_proj_weight", False):
        weights = [arguments[f"{name}_proj_weight"] for name in "qkv"]
        return tuple(_project(x, w, b) for x, w, b in zip((query, key, value), weights, biases))
    weight, bias = arguments["in_proj_weight"], arguments.get("in_proj_bias")
    if query is key and key is value:
        return tuple(part.contiguous() for part in _project(query, weight, bias).chunk(3, dim=-1))
    _check_pieces_allowed(weight)
    embed = query.shape[-1]
    if key is value:
        w_q, w_kv = weight.split([embed, 2 * embed])
        b_q, b_kv = (None, None) if bias is None else bias.split([embed, 2 * embed])
        k, v = (part.contiguous() for part in _project(key, w_kv, b_kv).chunk(2, dim=-1))
        return _project(query, w_q, b_q), k, v
    return tuple(_project(x, w, b) for x, w, b in zip((query, key, value), weight.chunk(3), biases))


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if carries_quantizers(weight):
        return quantized_linear(x, weight, bias)
    with torch._C.DisableTorchFunctionSubclass():
        return F.linear(x, weight, bias)


def _check_pieces_allowed(weight) -> None:
    """Cross-attention projects pieces of the packed weight, each quantized on its own; a delayed
    scaling history would mix their amaxes."""
    from .formats.float8 import Float8Quantizer
    from .formats.hybrid import HybridQuantizer

    quantizer = weight.linear_quantizers.weight if carries_quantizers(weight) else None
    children = [quantizer.rowwise, quantizer.columnwise] if isinstance(quantizer, HybridQuantizer) else [quantizer]
    if isinstance(weight, DynamicWeight) and any(isinstance(q, Float8Quantizer) and q.scaling == "delayed" for q in children):
        raise ValueError(
            f"{weight.linear_quantizers.parameter_name}: cross-attention (query is not key) projects the q, k "
            "and v pieces of the packed in_proj_weight separately, and one delayed-scaling history would mix "
            "their amaxes. Use current scaling (qtensor.recipes.float8_current()) for this layer, or keep it "
            "out of quantize_ with filter_fn."
        )


class IdentityProjection(torch.Tensor):
    """The [n, n] identity as a projection weight, never materialized: F.linear(x, I) is x.

    F.linear decomposes into t, mm / addmm (and dtype casts under autocast); each returns at once
    here. Any other op sees a real identity matrix."""

    @staticmethod
    def __new__(cls, n: int, dtype: torch.dtype, device: torch.device):
        return torch.Tensor._make_wrapper_subclass(cls, (n, n), dtype=dtype, device=device)

    def __init__(self, *args, **kwargs):
        pass

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None):
        return f"IdentityProjection({self.shape[0]}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func in (aten.t.default, aten.detach.default, aten.alias.default, aten.conj.default) or (
            func is aten.transpose.int and isinstance(first, IdentityProjection)
        ):
            return IdentityProjection(first.shape[0], first.dtype, first.device)
        if func is aten._to_copy.default and set(kwargs) <= {"dtype", "device"}:
            return IdentityProjection(first.shape[0], kwargs.get("dtype", first.dtype), kwargs.get("device", first.device))
        if func is aten.mm.default and isinstance(args[1], IdentityProjection) and not isinstance(first, IdentityProjection):
            return first.clone()
        if func is aten.addmm.default and isinstance(args[2], IdentityProjection) and len(args) == 3 and not kwargs:
            return args[1] + args[0]
        real = tree_map_only(
            IdentityProjection, lambda i: torch.eye(i.shape[0], dtype=i.dtype, device=i.device), (args, kwargs)
        )
        return func(*real[0], **real[1])


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
        return torch_function(func, args, kwargs)


class DynamicWeight(torch.Tensor):
    """A high-precision weight that quantizes itself with its layer's weight quantizer each time
    F.linear uses it, so new values are always picked up; any optimizer trains it.

    A `__torch_dispatch__` wrapper over the plain tensor `_data`: every op computes on `_data`, and
    the ops that make a new piece of the same weight (FSDP2's chunk / new_zeros / narrow / view,
    nn.Module's to / empty_like, detach, clone, ...) give back a DynamicWeight with the same
    quantizers, so a shard never silently loses them. In-place ops (optimizer steps, copy_, init)
    write into `_data`. Everything else returns plain tensors.

    The quantized copy is cached (`quantized()`): gradient accumulation over several micro-batches
    quantizes the weight once per optimizer step, and any write into the values (through this
    tensor, an alias of it, or its inner tensor) invalidates the copy before it could be read.
    """

    linear_quantizers: LinearQuantizers
    _data: torch.Tensor
    _writes: "_WriteLog"

    @staticmethod
    def __new__(
        cls, data: torch.Tensor, linear_quantizers: LinearQuantizers, requires_grad: bool | None = None, *, writes=None
    ):
        requires_grad = data.requires_grad if requires_grad is None else requires_grad
        data = data.detach()
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            layout=data.layout,
            requires_grad=requires_grad,
        )
        self._data = data
        self.linear_quantizers = linear_quantizers
        self._writes = writes if writes is not None else _WriteLog()
        return self

    def __init__(self, *args, **kwargs):
        pass

    def plain(self) -> torch.Tensor:
        """The high-precision values as a plain tensor (an alias)."""
        return self._data

    def values_version(self) -> tuple:
        """Changes whenever the values may have changed: writes through this tensor or its aliases
        (counted in __torch_dispatch__, where torch's version counters do not move), writes into
        the inner tensor from outside (its version counter), and writes into plain views of this
        tensor such as `w.detach()[5]` (autograd makes them share this tensor's version counter)."""
        return self._writes.count, self._data._version, self._version

    def quantized(self, *, columnwise: bool, cached: bool = True) -> QuantizedTensor:
        """The values quantized with the layer's weight quantizer (rowwise, plus columnwise when
        asked), from the cache while the values and the quantizer's running state are unchanged:
        the micro-batches of one optimizer step share the cast of the second (the first cast is
        not kept, so a step without gradient accumulation holds no weight cast past its backward;
        delayed scaling records two amaxes per step).
        `cached=False` casts afresh and leaves the cache alone (the linear passes it for inference
        forwards, which cast as a model restored from a checkpoint would)."""
        linear = self.linear_quantizers
        quantizer = linear.weight
        values = self._data.t() if linear.transposed else self._data
        uncached = not cached or torch.compiler.is_compiling() or is_fake(self._data)
        if uncached or self._data.is_meta or self._data.is_inference():
            return quantizer.quantize(values, rowwise=True, columnwise=columnwise)
        # Aliases share one log: pieces of one weight (cross-attention's q, k, v rows of a packed
        # in_proj_weight) are told apart by where their values lie.
        piece = (self._data.data_ptr(), tuple(self._data.shape), self._data.stride(), linear.transposed)
        seen = self._writes.quantized.get(piece)
        same_values = seen is not None and seen[0] == (self.values_version(), quantizer.state_version()) and seen[1] is quantizer
        if same_values and seen[2] is not None and (seen[2].has_columnwise or not columnwise):
            return seen[2]
        quantized = quantizer.quantize(values, rowwise=True, columnwise=columnwise)
        if torch._C._current_graph_task_id() != -1:
            return quantized  # activation recomputation repeats a forward: it is not another micro-batch
        # The first cast of these values is only noted: kept, it would stay allocated through the
        # backward and the optimizer step, where a step without gradient accumulation never reads
        # it again. A second forward over the same values shows micro-batches: that cast is kept.
        # Keyed on the quantizer's state after this cast: a delayed-scaling history written since
        # (a load) makes the next use cast again.
        self._writes.quantized[piece] = ((self.values_version(), quantizer.state_version()), quantizer, quantized if same_values else None)
        return quantized

    # torch's traceable-subclass protocol (DTensor, torch.compile, nn.Module._apply's swap), with the
    # layer's running state among the inner tensors (layer_state.py).
    def __tensor_flatten__(self):
        return ["_data", *layer_state.inner_names(self, self._data)], self.linear_quantizers

    @staticmethod
    def __tensor_unflatten__(inner_tensors, linear_quantizers, outer_size, outer_stride):
        weight = DynamicWeight(inner_tensors["_data"], linear_quantizers)
        layer_state.bind(weight, inner_tensors)
        return weight

    def __getattr__(self, name):
        if layer_state.is_state_name(name):
            return layer_state.inner_tensor(self, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __reduce_ex__(self, protocol):
        if self.__dict__.get("_is_param"):
            # A parameter of a pickled module: keep it a DynamicWeight parameter.
            return _rebuild_dynamic_parameter, (self._data, self.requires_grad, self.linear_quantizers)
        # state_dict entries pickle as plain tensors: loadable with weights_only=True, and
        # load_state_dict copies them into the weight.
        return self._data.__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        duplicate = DynamicWeight(copy.deepcopy(self._data, memo), self.linear_quantizers, self.requires_grad)
        # The copy starts with its own write log and no cached quantized copies.
        state = {k: v for k, v in self.__dict__.items() if k not in ("_data", "_writes", "_shard_cache")}
        duplicate.__dict__.update(copy.deepcopy(state, memo))
        return duplicate

    def __repr__(self, *, tensor_contents=None):
        return f"DynamicWeight({self._data!r}, linear_quantizers={self.linear_quantizers.describe()})"

    # ---- FSDP2: quantize the local shard, gather its low-precision bytes (fsdp.py) -------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        from . import fsdp

        caller = fsdp.calling_fsdp_param()
        values = self._data if mp_policy.param_dtype is None else self._data.to(mp_policy.param_dtype)
        # The weight role in high precision, or a Conv1D's [in, out] weight: FSDP2 shards it along
        # in_features, across the rows of what the GEMM reads, so it gathers its high-precision
        # values and is quantized at use, as on one process.
        if self.linear_quantizers.weight is None or self.linear_quantizers.transposed:
            padded = values.new_zeros((ceil_div(outer_size[0], mesh.size()), *outer_size[1:]))
            padded[: values.shape[0]].copy_(values)
            fsdp.count_gather((padded,), mesh, outer_size)
            return (padded,), (None, outer_size, None)
        quantized = self._quantized_shard(values, mesh)
        needed = fsdp.directions_needed(self.linear_quantizers, caller)
        inputs, plan = fsdp.pre_all_gather(quantized, mesh, outer_size, needed, caller.name)
        return inputs, (plan, outer_size, quantized)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        from . import fsdp

        plan, outer_size, quantized = metadata
        if plan is None:
            (gathered,) = all_gather_outputs
            values = gathered[: outer_size[0]].reshape(outer_size).to(param_dtype)
            if out is not None:
                with torch.autograd._unsafe_preserve_version_counter(out._data):  # as fsdp._write_into
                    out._data.copy_(values)
                return None
            unsharded = DynamicWeight(values.clone(), self.linear_quantizers)
            return unsharded, (unsharded._data,)
        return fsdp.post_all_gather(quantized, all_gather_outputs, plan, outer_size, param_dtype, out=out)

    def _quantized_shard(self, values: torch.Tensor, mesh) -> QuantizedTensor:
        """The local shard quantized in both directions, once per version of the weight (the
        pre-backward re-gather reuses the forward's cast, as a single process quantizes once), with
        tensor-wide amaxes reduced over the mesh so that every shard shares one scale."""
        key = (self.values_version(), values.dtype)
        cached = self.__dict__.get("_shard_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        from .numerics import reduce_amax_over

        with reduce_amax_over(mesh.get_group()), torch.autocast(values.device.type, enabled=False):
            quantized = self.linear_quantizers.weight.quantize(values, rowwise=True, columnwise=True)
        quantized.linear_quantizers = self.linear_quantizers
        self._shard_cache = (key, quantized)
        return quantized

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return torch_function(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.copy_.default and isinstance(args[1], DynamicWeight) and layer_state.has_bound_state(args[1]):
            return _write_back(*args[:2])
        weights = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, DynamicWeight)]
        plain_args, plain_kwargs = tree_map_only(DynamicWeight, lambda t: t._data, (args, kwargs))
        out = func(*plain_args, **plain_kwargs)
        _count_writes(func, args, kwargs)
        if func in _DYNAMIC_WEIGHT_PIECES and _keeps_float(func, out):
            source = weights[0]
            # An alias shares the write log (a write through it changes the source's values).
            writes = source._writes if func in _ALIASES else None
            return tree_map_only(torch.Tensor, lambda t: DynamicWeight(t, source.linear_quantizers, writes=writes), out)
        # An in-place op hands back the tensor it wrote into: the wrapper, not its inner tensor.
        if args and isinstance(args[0], DynamicWeight) and out is plain_args[0]:
            return args[0]
        return out


def _write_back(target: DynamicWeight, source: DynamicWeight) -> DynamicWeight:
    """`target.copy_(source)` from a traced weight: how the compiled step writes the layer state it
    updated back into the weight it was given, with the values where they are another tensor."""
    layer_state.copy_state(target, source)
    if not layer_state.same_values(source._data, target._data):
        target._data.copy_(source._data)
        target._writes.record_write()
    return target


class _WriteLog:
    """Shared by a DynamicWeight and its aliases: how many in-place writes went through any of them,
    and the last cast of the values with the quantized copy kept from the second cast on (dropped at
    the first write, so it never outlives them)."""

    __slots__ = ("count", "quantized")

    def __init__(self):
        self.count = 0
        self.quantized: dict[tuple, tuple] = {}  # piece → (values version, quantizer, quantized tensor or None)

    def record_write(self) -> None:
        self.count += 1
        self.quantized = {}


def _count_writes(func, args, kwargs) -> None:
    """Count in-place writes into each DynamicWeight (optimizer steps, copy_, init): its cached
    quantized copies are stale once it changes. The inner tensor's own version counter does not
    move for writes made from inside __torch_dispatch__, so the wrapper keeps its own count."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
        for tensor in tree_flatten(value)[0]:
            if isinstance(tensor, DynamicWeight):
                tensor._writes.record_write()


def _keeps_float(func, out) -> bool:
    """A piece in a non-float dtype (`.to(torch.int8)`) is a plain tensor, not a weight."""
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return all(t.dtype.is_floating_point for t in leaves)


aten = torch.ops.aten
# Ops whose result aliases (a piece of) the same weight's values: FSDP2 sends chunk/split,
# slice/narrow, view and as_strided; nn.Module sends detach.
_ALIASES = {
    aten.detach.default,
    aten.alias.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.as_strided.default,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
}
# Ops whose result is (a piece of) the same weight: the aliases, and new tensors of it (FSDP2's
# new_zeros, nn.Module's _to_copy, empty_like (to_empty) and clone).
_DYNAMIC_WEIGHT_PIECES = _ALIASES | {
    aten.clone.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.empty_like.default,
    aten._to_copy.default,
    aten._pin_memory.default,
}


def _rebuild_dynamic_parameter(data: torch.Tensor, requires_grad: bool, linear_quantizers: LinearQuantizers):
    return torch.nn.Parameter(DynamicWeight(data, linear_quantizers), requires_grad=requires_grad)
