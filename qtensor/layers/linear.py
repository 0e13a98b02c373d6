"""The quantized linear layer: y = x · Wᵀ + b as an autograd Function over fprop, dgrad and wgrad
(docs/design.md, The three GEMMs).

`quantized_linear(x, weight, bias)` is what F.linear means for a layer weight (weight.py; routing.py
sends F.linear, matmul and addmm here). The weight is a layer weight: it carries the layer's
`LinearQuantizers` and hands the GEMMs its operand (`weight.linear_operand`).

How the call's tensors are spread over ranks is asked of one seam (core/placement.py): the weight's
`LayerPlacement` (tensor parallelism gives it one for each forward) and, for a tensor that arrived
quantized (a quantized all-gather before or after the layer), that tensor's `Placement`. Nothing
here names a parallel mode.

Every tensor is quantized once per step with the usages its backward needs; only what the backward
needs is saved, as plain buffers. Delayed-scaling casts note their amaxes (running_state.py): a
training forward's notes are written by its backward, with the gradient's; an evaluation forward's
are dropped.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import gemm
from . import traced_state
from ..core import running_state
from ..core.kernels import is_fake
from .config import LinearQuantizers
from ..core.placement import LOCAL, LayerPlacement, Placement, placement_of
from ..core.quantizer import INPUT_DTYPES, Quantizer, autocast_dtype, fold_to_2d
from ..core.storage import _buffer_names
from ..core.tensor import QuantizedTensor


def _quantize(quantizer: Quantizer | None, tensor: torch.Tensor, *, rowwise: bool, columnwise: bool) -> torch.Tensor:
    if quantizer is None:
        return tensor
    return quantizer.quantize(tensor, rowwise=rowwise, columnwise=columnwise)


@dataclass(frozen=True)
class InputCast:
    """One cast of a layer's input: a weak reference to the input, the input's version when cast,
    the quantizer, and the quantized input."""

    source: weakref.ref
    version: int
    quantizer: Quantizer
    quantized: QuantizedTensor

    def serves(self, x: torch.Tensor, quantizer: Quantizer, columnwise: bool) -> bool:
        """Whether this cast is the cast `quantizer` would make of `x` now, in the directions asked."""
        return (
            self.source() is x and self.version == x._version and (self.quantized.has_columnwise or not columnwise)
            and self.quantizer == quantizer
        )


class InputCastSlot:
    """The most recent input cast of this thread (and task), or None. Layers that read one activation
    (q, k and v projections; an MLP's gate and up) cast it once. The backward, which autograd may run
    on another thread, empties the forward's slot through the reference its context keeps."""

    __slots__ = ("last",)

    def __init__(self):
        self.last: InputCast | None = None


_last_input_cast: contextvars.ContextVar = contextvars.ContextVar("qtensor_last_input_cast")


def _input_cast_slot() -> InputCastSlot:
    slot = _last_input_cast.get(None)
    if slot is None:
        slot = InputCastSlot()
        _last_input_cast.set(slot)
    return slot


def _input_operand(quantizer: Quantizer | None, x: torch.Tensor, x2d: torch.Tensor, *, columnwise: bool) -> torch.Tensor:
    """The input for this layer's GEMMs: `x2d` quantized, or the cast the previous layer made of the
    same unchanged `x` with an equal quantizer that casts reproducibly (no state, no random draws)."""
    if quantizer is None:
        return x2d
    if torch.compiler.is_compiling():  # the compiled graph shares the casts itself (common subexpressions)
        return quantizer.quantize(x2d, rowwise=True, columnwise=columnwise)
    shareable = quantizer.casts_reproducibly() and not (is_fake(x) or x.is_inference())
    slot = _input_cast_slot()
    if shareable and slot.last is not None and slot.last.serves(x, quantizer, columnwise):
        return slot.last.quantized
    quantized = quantizer.quantize(x2d, rowwise=True, columnwise=columnwise)
    slot.last = InputCast(weakref.ref(x), x._version, quantizer, quantized) if shareable else None
    return quantized


def _output_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return autocast_dtype(x) or torch.promote_types(x.dtype, weight.dtype)


class SavedOperand(NamedTuple):
    """How to rebuild, from its saved buffers, the data of a quantized operand holding the one
    direction the backward reads: the format's tensor class (the layer weight's behaviour is not
    saved), that direction, its buffers' names, and the storage's class and fields."""

    cls: type
    direction: str
    names: tuple[str, ...]
    storage_class: type
    storage_fields: dict
    shape: torch.Size
    dtype: torch.dtype
    quantizer: Quantizer | None
    # The placement that makes the saved storage whole when the backward reads it (a gathered
    # activation's columnwise copy is saved as this rank's rows); None: it is whole.
    restore: Placement | None = None


def _pack_saved(tensor: torch.Tensor | None, direction: str | None = None):
    """(the plain tensors to save for backward, a SavedOperand or None): a quantized operand is saved
    as the buffers of its `direction`'s storage, so every saved-tensor hook (save_on_cpu, pinned or
    not, activation checkpointing, offloading hooks) moves and measures plain bytes, and never turns
    the quantized copy into a high-precision one (a plain pinned buffer copied from it would
    dequantize it). No wrapper is made or flattened here."""
    if direction is None or not isinstance(tensor, QuantizedTensor):
        return [tensor], None
    if getattr(tensor, direction) is not None:
        storage, restore = tensor.storage_for(direction), None
    else:  # a tensor that arrived without it: its placement says what stands for it
        storage, restore = placement_of(tensor).saved(tensor, direction)
    tensors, (storage_class, fields, names) = saved_storage(storage)
    return tensors, SavedOperand(tensor.data_class, direction, names, storage_class, fields, tensor.shape, tensor.dtype, tensor.quantizer, restore)


def saved_storage(storage):
    """(a storage's buffers as plain tensors to save for a backward, (its class, its fields, the
    buffers' names): what `restored_storage` makes it again from)."""
    options = storage.options
    names = _buffer_names(type(storage), storage.direction, tuple(options.values()))
    # `.data`: the buffers' own version counters stay out of autograd's check, as they were when the
    # wrapper was saved (FSDP2 gathers a weight into the same buffers again before the backward).
    tensors = [getattr(storage, name).data for name in names]
    fields = dict(direction=storage.direction, rows=storage.rows, cols=storage.cols, row_slice=storage.row_slice, **options)
    return tensors, (type(storage), fields, names)


def restored_storage(tensors, recipe):
    """The storage `saved_storage` saved, over its saved tensors."""
    storage_class, fields, names = recipe
    return storage_class(**fields, **dict(zip(names, tensors)))


def _unpack_saved(tensors, saved: SavedOperand | None) -> torch.Tensor | None:
    if saved is None:
        return tensors[0]
    storage = restored_storage(tensors, (saved.storage_class, saved.storage_fields, saved.names))
    if saved.restore is not None:
        storage = saved.restore.restored(storage)
    rowwise, columnwise = (storage, None) if saved.direction == "rowwise" else (None, storage)
    return saved.cls(saved.shape, saved.dtype, rowwise, columnwise, saved.quantizer)


class QuantizedLinearFunction(torch.autograd.Function):
    """y = x · Wᵀ + b with each GEMM on the operands the layer's quantizers chose."""

    @staticmethod
    def forward(ctx, x, weight, bias, linear: LinearQuantizers, needs_grad: tuple, state: dict | None, placement: LayerPlacement | None):
        input_needs_grad, weight_needs_grad = needs_grad
        placement = placement or LOCAL
        override = linear.backward_override
        quantized_backward = override is None
        training = input_needs_grad or weight_needs_grad
        # forward runs without autograd recording: no detach needed (and none allowed on inference tensors).
        x2d = fold_to_2d(x)
        with running_state.noting() if linear.records_amaxes else contextlib.nullcontext([]) as notes:
            if isinstance(x, QuantizedTensor):  # arrived quantized (a quantized all-gather before this layer)
                directions = ("rowwise", "columnwise") if weight_needs_grad and quantized_backward else ("rowwise",)
                x_q = placement_of(x).arrived(linear.input, x, linear, "input", directions=directions)
            else:
                with placement.input.casting():
                    x_q = _input_operand(linear.input, x, x2d, columnwise=weight_needs_grad and quantized_backward)
        with placement.weight.casting():
            w_q, weight_notes, version = weight.linear_operand(columnwise=input_needs_grad and quantized_backward, training=training)
        # A weight's amax is recorded once per version of its values, by the first training step
        # that uses them (an evaluation forward's cast, reused by FSDP2, records nothing itself).
        running = linear.running
        if training and weight_notes and (version is None or version != running.recorded_weight):
            notes.extend(weight_notes)
            running.recorded_weight = version

        y = gemm.fprop(x_q, w_q, bias, _output_dtype(x, weight), fast_accumulation=linear.fprop_fast_accumulation)
        # Not a view of y (torch._unsafe_view, as torch's own linear): FSDP2 warns about modules returning views.
        out = torch.ops.aten._unsafe_view(y, (*x.shape[:-1], y.shape[-1]))

        if override is None:
            saved_x, saved_w = (x_q, "columnwise"), (w_q, "columnwise")
        elif override == "dequantized":
            saved_x, saved_w = (x_q, "rowwise"), (w_q, "rowwise")
        else:  # high_precision: the original operands (a quantized parameter has no other)
            saved_x, saved_w = (x2d, None), (weight.high_precision_matrix() if input_needs_grad else None, None)
        x_tensors, x_rebuild = _pack_saved(*saved_x) if weight_needs_grad else ([None], None)
        w_tensors, w_rebuild = _pack_saved(*saved_w) if input_needs_grad else ([None], None)
        ctx.save_for_backward(*x_tensors, *w_tensors)
        ctx.rebuild = (x_rebuild, w_rebuild)
        ctx.linear, ctx.placement, ctx.needs_grad = linear, placement, needs_grad
        # An evaluation or inference forward has no backward: its notes are dropped here.
        ctx.state, ctx.amax_notes = state, (notes if training else [])
        ctx.input_cast_slot = None if torch.compiler.is_compiling() else _input_cast_slot()
        ctx.grads = GradientLayout(x.shape, x.dtype, weight.dtype, weight.stored_transposed, bias.dtype if bias is not None else None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.input_cast_slot is not None:
            ctx.input_cast_slot.last = None  # the forward is over: the last input cast is freed
        saved = ctx.saved_tensors
        x_rebuild, w_rebuild = ctx.rebuild
        split = len(saved) - len(w_rebuild.names if w_rebuild else [None])
        saved_x, saved_w = _unpack_saved(saved[:split], x_rebuild), _unpack_saved(saved[split:], w_rebuild)
        input_needs_grad, weight_needs_grad = ctx.needs_grad
        linear, grads = ctx.linear, ctx.grads
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_weight = grad_bias = None

        if linear.backward_override == "dequantized":
            # The exact fp32 values the forward GEMM multiplied, not a rounding of them to x's dtype.
            saved_x, saved_w = (
                t.dequantize(torch.float32, "rowwise") if isinstance(t, QuantizedTensor) else t for t in (saved_x, saved_w)
            )
        grad_q = grad_2d
        with linear.using_state(ctx.state) if ctx.state else contextlib.nullcontext():
            with running_state.noting() if linear.records_amaxes else contextlib.nullcontext([]) as notes:
                if isinstance(grad_2d, QuantizedTensor):  # arrived quantized (a quantized all-gather after this layer)
                    directions = tuple(d for d, needed in (("rowwise", input_needs_grad), ("columnwise", weight_needs_grad)) if needed)
                    grad_q = placement_of(grad_2d).arrived(linear.grad_output, grad_2d, linear, "grad_output", directions=directions)
                elif linear.backward_override is None and (input_needs_grad or weight_needs_grad):
                    # Quantized once, with both usages the two backward GEMMs need.
                    with ctx.placement.grad_output.casting():
                        grad_q = _quantize(linear.grad_output, grad_2d, rowwise=input_needs_grad, columnwise=weight_needs_grad)
            # The step's amaxes, the forward's and the gradient's, reduced over the data-parallel group.
            running_state.write(ctx.amax_notes + notes, linear.running.group())

        fast = linear.backward_fast_accumulation
        if input_needs_grad:
            grad_x = gemm.dgrad(grad_q, saved_w, grads.x_dtype, fast_accumulation=fast).reshape(grads.x_shape)
        if weight_needs_grad:
            grad_weight = gemm.wgrad(grad_q, saved_x, grads.weight_dtype, fast_accumulation=fast)
            if grads.weight_transposed:  # the parameter keeps Conv1D's [in, out] layout
                grad_weight = grad_weight.t()
        if ctx.needs_input_grad[2]:
            grad_bias = grad_2d.float().sum(0).to(grads.bias_dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None


class GradientLayout(NamedTuple):
    """The shapes and dtypes the backward gives its gradients: the input's, the weight's (kept as
    Conv1D's [in, out] where `weight_transposed`) and the bias's (None: no bias)."""

    x_shape: torch.Size
    x_dtype: torch.dtype
    weight_dtype: torch.dtype
    weight_transposed: bool
    bias_dtype: torch.dtype | None


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with the quantizers the layer weight `weight` carries, over the local operands its
    placement (`weight.placement`, core/placement.py) gives: one process's layer where it has none."""
    placement = weight.placement
    # Subclass __torch_function__ off from here: the weight's shape, dtype and requires_grad are read
    # as a plain tensor's, without a trip through routing for each.
    with torch._C.DisableTorchFunctionSubclass():
        if placement is None:
            return _local_linear(x, weight, bias, None)
        x_local, bias_local = placement.local_operands(x, bias)
        y = _local_linear(x_local, weight, bias_local, placement)
        return placement.output(y, x_local, weight, bias)


def _local_linear(x, weight, bias, placement: LayerPlacement | None):
    """The quantized linear of plain (local) tensors, placed `placement` (None: one process)."""
    linear = weight.linear_quantizers
    name = linear.name or "a quantized linear layer"
    if x.dim() == 0 or x.shape[-1] != weight.in_features:
        raise ValueError(
            f"{name}: input of shape {list(x.shape)} does not match weight {list(weight.shape)}; "
            f"the input's last dimension must be {weight.in_features}."
        )
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name}: input is {x.dtype}; quantized layers take float32, bfloat16 or float16 inputs.")
    if not x.is_meta and not torch.is_autocast_enabled(x.device.type):
        # As nn.Linear: outside autocast, input, weight and bias share one dtype (a meta tensor,
        # shapes only, has no autocast to ask).
        mismatched = [(what, t.dtype) for what, t in (("weight", weight), ("bias", bias)) if t is not None and t.dtype != x.dtype]
        if mismatched:
            found = ", ".join(f"the {what} {dtype}" for what, dtype in mismatched)
            raise RuntimeError(
                f"{name}: the input is {x.dtype} but {found}; as nn.Linear, a quantized layer takes one dtype "
                f"outside autocast (expected m1 and m2 to have the same dtype). Convert the input "
                f"(x.to({weight.dtype})) or the model, or run under torch.autocast."
            )
    if weight.numel() == 0:
        # Nothing to multiply (nn.Linear(0, n) or (n, 0)): the stock result, the bias alone or an
        # empty output; nothing is cast, and the weight, having no elements, gets no gradient.
        return torch.nn.functional.linear(x, x.new_zeros(weight.shape), bias)
    grad_enabled = torch.is_grad_enabled()
    # Traced by torch.compile, the casts use the copies of the layer state the weight carries (traced_state.py).
    state = traced_state.traced_state_of(weight)
    needs = (grad_enabled and x.requires_grad, grad_enabled and weight.requires_grad)
    if not state:
        return QuantizedLinearFunction.apply(x, weight, bias, linear, needs, state, placement)
    with linear.using_state(state):
        return QuantizedLinearFunction.apply(x, weight, bias, linear, needs, state, placement)
