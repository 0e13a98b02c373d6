"""A layer's weight: what a weight does on top of the data it holds.

`qtensor.quantize_` replaces each quantized layer's weight parameter with a *layer weight*: it
carries the layer's `LinearQuantizers` (`linear_quantizers`), routes F.linear and its matmul forms
to the quantized linear (routing.py), gathers low-precision bytes under FSDP2, and lists its layer's
running state among its inner tensors for torch.compile (traced_state.py). Two kinds share the base
`LayerWeight`:

- `DynamicWeight` (dynamic_weight.py, `weights="dynamic"`): high-precision values, quantized at use.
- A quantized weight (`weights="quantized"`): the format's own tensor class with this behaviour
  mixed in (`quantized_weight(tensor, linear)` makes one); `isinstance(w, MXFP8Tensor)` holds, and
  files and pickles store it as the format's class.

The tensor types below (tensor.py, formats/) know nothing of layers.
"""

from __future__ import annotations

import threading

import torch

from ..distributed import fsdp, fsdp_state
from . import traced_state, routing
from .config import LinearQuantizers
from ..core.kernels import skipped_by_compiler
from ..core.ops import byte_compatible, copy_storages
from ..core.placement import LayerPlacement
from ..core.flatten import METADATA_READS, inner_tensor, plain
from ..core.plan import TENSOR_CLASSES
from ..core.tensor import QuantizedTensor, traced_reduction

aten = torch.ops.aten


class LayerWeight:
    """What every layer weight does; mixed into a torch.Tensor subclass (see the module docstring).

    A subclass provides `linear_operand(columnwise, training)` → (the weight operand of the GEMMs,
    the amax notes its cast made, the version of the values it was cast from or None),
    `high_precision_matrix()`, `stored_transposed` and `quantized_at_use`.
    """

    linear_quantizers: LinearQuantizers
    # Traced by torch.compile: the layer state this weight was rebuilt with (traced_state.py).
    bound_state: dict | None = None
    # How this call of the layer is spread over ranks (core/placement.py); None: one process. Tensor
    # parallelism places the local shard it hands the layer for the length of one forward.
    placement: LayerPlacement | None = None
    is_layer_weight = True  # read by the tensor types (core/tensor.py), which know nothing of layers
    stored_transposed = False  # a dynamic Conv1D weight keeps [in_features, out_features]
    quantized_at_use = False  # quantized by each linear call (a dynamic weight) or already quantized

    @property
    def in_features(self) -> int:
        # [out, in], or [in, out] where stored transposed; an expert stack has the experts first.
        return self.shape[-2] if self.stored_transposed else self.shape[-1]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # The layer's linear where `func` means it, plain-tensor semantics otherwise.
        if func in METADATA_READS:
            return plain(func, args, kwargs or {})
        return routing.torch_function(func, args, kwargs or {})

    def __getattr__(self, name):
        if name.startswith("_"):  # no inner tensor is read here by such a name (core/flatten.py): torch's probes, answered at once
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        if traced_state.is_state_name(name):
            return traced_state.inner_tensor(self, name)
        return self._data_attribute(name)

    # A compiled graph's guards and wrapper read inner tensors by name at each call: not a frame to compile.
    __getattr__ = skipped_by_compiler(__getattr__)

    def _data_attribute(self, name):
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def _note_fsdp(self, mesh, module):
        """What FSDP2's hook tells the layer about how this shard is placed (`fsdp_state.FsdpLayer`)."""
        sharding = fsdp_state.layer_sharding(self.linear_quantizers.running, self, mesh, module)
        for expert in self.linear_quantizers.experts:  # an expert stack's experts reduce over the same groups
            expert.running.fsdp = sharding
        return sharding


# ---- quantized weights: a format's tensor class with the layer weight's behaviour -------------------
class QuantizedWeight(LayerWeight):
    """Mixed into a format's QuantizedTensor class by `quantized_weight_class`."""

    _ops: dict = {}
    # FSDP2 gathered this weight from a dynamic weight's shard: that shard's cast (shared by aliases).
    gathered_cast: "GatheredCast | None" = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # The layer's linear where `func` means it; otherwise what the format's tensor does.
        if func in METADATA_READS:
            return plain(func, args, kwargs or {})
        result = routing.route(func, args, kwargs or {})
        if result is not NotImplemented:
            return result
        return QuantizedTensor.__dict__["__torch_function__"].__func__(cls, func, types, args, kwargs)

    def _data_attribute(self, name):
        return inner_tensor(self, name)

    def linear_operand(self, *, columnwise: bool, training: bool):
        if columnwise and not self.has_columnwise and not self.rebuilds_columnwise():
            raise ValueError(
                f"The quantized weight of {self.linear_quantizers.name or 'this layer'} holds no columnwise copy, "
                f"which dgrad needs, and its format ({self.rowwise.format_name}) cannot rebuild it from the rowwise "
                "one (its blocks run along one direction). Keep both copies (update_usage(columnwise=True) "
                "cannot rebuild it either: quantize the weight again, as qtensor.quantize_ does)."
            )
        # A weight FSDP2 gathered from a dynamic weight's shard carries the notes of that shard's cast.
        cast = self.gathered_cast
        gathered = cast.directions if cast is not None else None
        if gathered is not None and "rowwise" not in gathered and not torch.compiler.is_compiling():
            raise RuntimeError(
                f"{self.linear_quantizers.name or 'A quantized layer'}: its forward runs inside the backward (activation "
                f"checkpointing recomputes it), where FSDP2's re-gather brought only the weight's {' and '.join(gathered)} "
                "copy, which the backward's GEMMs read, not the forward's rowwise one. Shard the checkpointed blocks with "
                "reshard_after_forward=False, or use a recipe whose backward reads the forward's copy (Float8 per-tensor "
                "scaling, or backward_override)."
            )
        return (self, cast.notes, cast.version) if cast is not None else (self, [], None)

    def rebuilds_columnwise(self) -> bool:
        """Whether the rowwise copy re-lays out as the columnwise one (asked once per weight): a
        weight that keeps only the forward's copy then gives dgrad's at each backward."""
        if "_rebuilds" not in self.__dict__:
            self._rebuilds = self.rowwise is not None and self.quantizer.rebuild_direction(self.rowwise, "columnwise") is not None
        return self._rebuilds

    def high_precision_matrix(self) -> torch.Tensor:
        return self.dequantize()

    def with_storages(self, rowwise, columnwise, shape=None, dtype=None, requires_grad=False):
        result = super().with_storages(rowwise, columnwise, shape=shape, dtype=dtype, requires_grad=requires_grad)
        result.linear_quantizers = self.linear_quantizers
        if self.gathered_cast is not None:  # aliases (FSDP2's parameter over the gathered tensor) share it
            result.gathered_cast = self.gathered_cast
        return result

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight = args[0] if args and isinstance(args[0], QuantizedWeight) else None
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except ValueError as error:
            if weight is None or str(error).startswith(weight.linear_quantizers.parameter_name):
                raise
            raise ValueError(f"{weight.linear_quantizers.parameter_name}: {error}") from None

    # torch.compile: the layer's running state travels among the inner tensors (traced_state.py), and
    # so do the amaxes of a gathered weight's cast (`cast__0`, ...), which its compiled step records.
    def _flatten(self, shared):
        names, context = super()._flatten(shared)
        storage = self.rowwise if self.rowwise is not None else self.columnwise
        first = getattr(storage, storage._first_buffer)  # one inner tensor (is it real, and where)
        cast = self.gathered_cast
        notes = cast.notes if cast is not None else []
        paths = tuple(_quantizer_path(self.linear_quantizers, quantizer) for quantizer, _ in notes)
        names = names + [f"cast__{i}" for i in range(len(notes))] + traced_state.inner_names(self, first)
        return names, (*context, self.linear_quantizers, paths)

    def _flatten_held(self):
        linear = self.linear_quantizers
        if self.gathered_cast is not None or (linear is not None and linear.records_amaxes):
            return None  # the cast's notes and the layer's running state change from call to call
        return (self.quantizer, linear)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, context, outer_size, outer_stride):
        *data_context, linear, paths = context
        buffers = {name: t for name, t in inner_tensors.items() if not traced_state.is_state_name(name) and not name.startswith("cast__")}
        result = QuantizedTensor.__tensor_unflatten__(buffers, tuple(data_context), outer_size, outer_stride)
        result.linear_quantizers = linear
        if paths:  # traced: the compiled step records the cast's amaxes (version None: every step)
            result.gathered_cast = GatheredCast()
            result.gathered_cast.notes = [(_quantizer_at(linear, path), inner_tensors[f"cast__{i}"]) for i, path in enumerate(paths)]
        traced_state.bind(result, inner_tensors)
        return result

    def __getattr__(self, name):
        # One frame the compiler skips (not LayerWeight's, which would be a second): compiled code's
        # guards and wrapper read the inner tensors that are not properties (flatten.py) through here.
        if name.startswith("_"):  # no inner tensor is read here by such a name (core/flatten.py): torch's probes, answered at once
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        if name.startswith("cast__") and self.gathered_cast is not None:
            return self.gathered_cast.notes[int(name.removeprefix("cast__"))][1]
        if traced_state.is_state_name(name):
            return traced_state.inner_tensor(self, name)
        return self._data_attribute(name)

    __getattr__ = skipped_by_compiler(__getattr__)

    def __reduce_ex__(self, protocol):
        if self.__dict__.get("_is_param"):
            data = self.data_class(self.shape, self.dtype, self.rowwise, self.columnwise, self.quantizer)
            reduction = _rebuild_quantized_weight, (data, self.requires_grad, self.linear_quantizers)
            return traced_reduction(self, reduction) if self._traced() else reduction
        return super().__reduce_ex__(protocol)

    # ---- FSDP2: gather the direction each GEMM reads, as low-precision bytes (fsdp.py) ------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        sharding = self._note_fsdp(mesh, module)
        fsdp.agree_on_scales(self, sharding.shard_groups)
        linear = self.linear_quantizers
        needed = fsdp.directions_held(fsdp.directions_needed(linear, fsdp_state.regathers_before_backward(sharding)), self)
        inputs, plan = fsdp.pre_all_gather(self, mesh, outer_size, needed, linear.parameter_name)
        return inputs, (plan, outer_size, self)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        plan, outer_size, local = metadata
        result = fsdp.post_all_gather(local, all_gather_outputs, plan, outer_size, param_dtype, out=out)
        note_gathered(out if out is not None else result[0], plan)
        return result


def _quantizer_path(linear: LinearQuantizers, quantizer) -> str:
    """Where a weight cast's quantizer sits in the layer: its weight quantizer, or a hybrid's child."""
    if quantizer is linear.weight:
        return ""
    return next(direction for direction in ("rowwise", "columnwise") if linear.weight.quantizer_for(direction) is quantizer)


def _quantizer_at(linear: LinearQuantizers, path: str):
    return linear.weight if not path else linear.weight.quantizer_for(path)


def note_gathered(target, plan) -> None:
    """Record on the gathered weight (shared by its aliases) which directions this gather brought."""
    target = getattr(target, "_local_tensor", target)  # a DTensor over tensor parallelism
    if target.gathered_cast is None:
        target.gathered_cast = GatheredCast()
    target.gathered_cast.directions = plan.directions + plan.rebuilt


class GatheredCast:
    """What FSDP2's last gather of a weight brought: the directions (either weight mode), and for a
    dynamic weight's shard the amax notes of its cast and the version of the values it was cast
    from. One object shared by the gathered tensor and its aliases, updated in place by each gather."""

    __slots__ = ("notes", "version", "directions")

    def __init__(self):
        self.notes, self.version = [], None
        # The directions the last gather brought (sent or rebuilt); None: not gathered by FSDP2.
        self.directions = None


def _copy_into_weight(func, args, kwargs):
    """`weight.copy_(traced)`: how a compiled step writes back a weight it was given — its layer's
    updated running state, and its bytes where the step wrote them (traced_state.py)."""
    target, source = args[0], args[1]
    if isinstance(source, QuantizedTensor) and traced_state.has_bound_state(source) and byte_compatible(target, source):
        traced_state.copy_state(target, source)
        copy_storages(target, source, unless=traced_state.same_values)
        return target
    return QuantizedTensor._ops[aten.copy_.default](func, args, kwargs)


QuantizedWeight._ops[aten.copy_.default] = _copy_into_weight

# A cache: one layer-weight class per format, made under a lock (two classes for one format would
# make two weights of that format compare as different types).
_WEIGHT_CLASSES: dict[type, type] = {}
_WEIGHT_CLASSES_LOCK = threading.Lock()


def quantized_weight_class(tensor_class: type) -> type:
    """The layer-weight class of a format's tensor class (made once per format)."""
    data_class = tensor_class.data_class
    with _WEIGHT_CLASSES_LOCK:
        if data_class not in _WEIGHT_CLASSES:
            cls = type(f"{data_class.__name__}Weight", (QuantizedWeight, data_class), {"data_class": data_class, "__module__": __name__})
            _WEIGHT_CLASSES[data_class] = cls
        return _WEIGHT_CLASSES[data_class]


def __getattr__(name: str) -> type:
    """`<Format>TensorWeight` (`MXFP8TensorWeight`): the layer-weight class of that format, made on
    first use, so that pickle finds a generated class by the name it stores."""
    data_class = TENSOR_CLASSES.get(name.removesuffix("Weight")) if name.endswith("Weight") else None
    if data_class is not None:
        return quantized_weight_class(data_class)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def quantized_weight(tensor: QuantizedTensor, linear: LinearQuantizers) -> QuantizedTensor:
    """`tensor`'s data as the quantized weight of the layer `linear` describes."""
    cls = quantized_weight_class(type(tensor))
    weight = cls(tensor.shape, tensor.dtype, tensor.rowwise, tensor.columnwise, tensor.quantizer, requires_grad=tensor.requires_grad)
    weight.linear_quantizers = linear
    return weight


def _rebuild_quantized_weight(data: QuantizedTensor, requires_grad: bool, linear: LinearQuantizers) -> torch.nn.Parameter:
    return torch.nn.Parameter(quantized_weight(data, linear), requires_grad=requires_grad)
