"""QuantizedTensor: the torch.Tensor wrapper over one or two direction storages.

A quantized tensor is data: storages, dispatch, flattening and serialisation. What a layer's weight
does (routing F.linear, FSDP2 hooks, running state) is added above it, in weight.py.

Dispatch (docs/design.md, Dispatch): every class has an op table filled by `@Cls.implements(...)`. An op found
in the table (searched along the class's MRO) runs its handler; any other op sees the dequantized
value and returns plain tensors, and an op that writes into a quantized tensor requantizes the
result into it.

The buffer contract (storage.py) gives every tensor one flat dict of named buffers plus metadata
(`to_buffers` / `from_buffers`); pickling and checkpoints are built on it, and `__tensor_flatten__`
names the same buffers (read from the storages' plans, plan.py, as compiled code asks at each call).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import json
import math
import os
import threading

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .kernels import is_fake, skipped_by_compiler
from .numerics import FP8_DTYPES
from .flatten import METADATA_READS, cached_flatten, inner_names, inner_tensor, plain
from .plan import TENSOR_CLASSES, TensorPlan
from .quantizer import DTYPES_BY_NAME, Quantizer, quantizer_from_dict
from .storage import DIRECTIONS, Storage


_NO_SINGLE_STORAGE = (
    "{cls} keeps its values in several low-precision buffers (data, scales) and has no single "
    "storage or data pointer, so safetensors.torch and Hugging Face save_pretrained cannot write it. "
    "Save it with qtensor.save_model(model, path), or qtensor.save_file(tensors, path) for a dict of "
    "tensors; q.dequantize() gives a plain tensor."
)


class QuantizedTensor(torch.Tensor):
    """Base of Float8Tensor, MXFP8Tensor, NVFP4Tensor, IdentityTensor and HybridQuantizedTensor.

    `shape` and `dtype` are the logical (high-precision) ones; the data lives in `rowwise` and
    `columnwise`, each a `Storage` over the 2-D view `[prod(shape[:-1]), shape[-1]]` or None.
    """

    _ops: dict = {}
    # The class whose name files and pickles carry: the format's tensor class itself; a class that
    # adds behaviour to a format's tensor (a layer's weight) names the format's class here.
    data_class: type
    # True for a tensor handed out as a load target (a module's state_dict entry): an in-place
    # loader fills every row of it from one checkpoint, so a byte copy into a row slice of it takes
    # the source's tensor-wide scale (ops.py, copy_). Kept by the tensors derived from it.
    fills_from_checkpoint: bool = False
    rowwise: Storage | None
    columnwise: Storage | None
    quantizer: Quantizer

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._ops = {}
        if "data_class" in cls.__dict__:  # behaviour over a format's class: stored as that class
            return
        cls.data_class = cls
        if cls.__module__.startswith("qtensor."):  # files name only qtensor's own classes
            TENSOR_CLASSES[cls.__name__] = cls

    @staticmethod
    def __new__(cls, shape, dtype, rowwise, columnwise, quantizer, requires_grad=False):
        present = rowwise if rowwise is not None else columnwise
        if present is None:
            raise ValueError(f"{cls.__name__} needs at least one of rowwise and columnwise storage.")
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=present.device, requires_grad=requires_grad
        )
        self.rowwise = rowwise
        self.columnwise = columnwise
        self.quantizer = quantizer
        return self

    def __init__(self, *args, **kwargs):
        pass

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in METADATA_READS:
            return plain(func, args, kwargs)
        if func is torch.Tensor.__setitem__ and isinstance(args[0], QuantizedTensor):
            return args[0].assign(args[1], args[2])
        if func is torch.Tensor.storage:
            # safetensors (and with it save_pretrained) asks for this after untyped_storage() of a
            # wrapper failed; torch itself no longer does. Say what to use instead.
            raise TypeError(_NO_SINGLE_STORAGE.format(cls=type(args[0]).__name__))
        if len(types) > 1 and any(getattr(t, "is_layer_weight", False) and not issubclass(cls, t) and not issubclass(t, cls) for t in types):
            # A quantized layer's weight decides (F.linear of a quantized input runs the layer's
            # linear, which multiplies the input as it arrived): torch asks the weight's type next.
            return NotImplemented
        return plain(func, args, kwargs)

    def assign(self, index, value) -> None:
        """`self[index] = value`: dequantize, assign, requantize the whole tensor in place (an index
        can select values that share blocks with the rest, so only a whole requantization is exact)."""
        values = self.dequantize()
        values[index] = value.dequantize() if isinstance(value, QuantizedTensor) else value
        self.copy_(values)

    # ---- public API ---------------------------------------------------------------------------
    @property
    def has_rowwise(self) -> bool:
        return self.rowwise is not None

    @property
    def has_columnwise(self) -> bool:
        return self.columnwise is not None

    def storage_for(self, direction: str | None = None) -> Storage:
        """The storage of `direction` (None: rowwise when present, else columnwise)."""
        if direction is None:
            return self.rowwise if self.rowwise is not None else self.columnwise
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be 'rowwise', 'columnwise' or None, got {direction!r}.")
        storage = getattr(self, direction)
        if storage is None:
            raise ValueError(
                f"This {type(self).__name__} holds no {direction} data. Quantize with "
                f"{direction}=True, or call update_usage({direction}=True) where the format can rebuild it."
            )
        return storage

    def dequantize(self, dtype: torch.dtype | None = None, direction: str | None = None) -> torch.Tensor:
        """The values in the original domain and shape, as a plain tensor of `dtype` (default: self.dtype)."""
        return self.storage_for(direction).dequantize_as(dtype or self.dtype).reshape(self.shape)

    def storage_nbytes(self) -> int:
        """Bytes held by all buffers of both directions (a buffer shared by both counted once)."""
        buffers = self.buffer_dict(quantizer_state=False)
        return sum(buffer.numel() * buffer.element_size() for buffer in buffers.values())

    def update_usage(self, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """Drop a direction (False) or rebuild a missing one (True) where the format can."""
        wanted = {"rowwise": rowwise, "columnwise": columnwise}
        new = {"rowwise": self.rowwise, "columnwise": self.columnwise}
        for direction, want in wanted.items():
            if want is False:
                new[direction] = None
            elif want and new[direction] is None:
                new[direction] = self._rebuild_direction(direction)
        if new["rowwise"] is None and new["columnwise"] is None:
            raise ValueError("update_usage would drop both directions; a quantized tensor keeps at least one.")
        self.rowwise, self.columnwise = new["rowwise"], new["columnwise"]

    def _rebuild_direction(self, direction: str) -> Storage:
        source = self.columnwise if direction == "rowwise" else self.rowwise
        rebuilt = self.quantizer.rebuild_direction(source, direction)
        if rebuilt is None:
            raise ValueError(
                f"{type(self).__name__} cannot rebuild its {direction} copy from the {source.direction} one "
                f"({source.format_name} blocks run along one direction). Quantize the high-precision "
                f"tensor again with {direction}=True."
            )
        return rebuilt

    def with_storages(self, rowwise, columnwise, shape=None, dtype=None, requires_grad=False):
        """A new tensor of this class and quantizer over the given storages (a subclass that adds
        behaviour carries its own attributes over)."""
        result = type(self)(
            self.shape if shape is None else shape,
            self.dtype if dtype is None else dtype,
            rowwise,
            columnwise,
            self.quantizer,
            requires_grad=requires_grad,
        )
        if self.fills_from_checkpoint:
            result.fills_from_checkpoint = True
        return result

    def map_storages(self, fn, **kwargs) -> "QuantizedTensor":
        """Apply `fn` to each storage, keeping a storage shared by both directions shared."""
        rowwise = fn(self.rowwise) if self.rowwise is not None else None
        if self.columnwise is None:
            columnwise = None
        elif self.columnwise is self.rowwise:
            columnwise = rowwise
        else:
            columnwise = fn(self.columnwise)
        return self.with_storages(rowwise, columnwise, **kwargs)

    def map_buffers(self, fn, **kwargs) -> "QuantizedTensor":
        """Apply `fn` once to every buffer (a tensor-wide buffer both directions share stays shared)."""
        done: dict[int, torch.Tensor] = {}

        def once(buffer):
            if id(buffer) not in done:
                done[id(buffer)] = fn(buffer)
            return done[id(buffer)]

        return self.map_storages(lambda storage: storage.map_buffers(once), **kwargs)

    def __repr__(self) -> str:
        directions = ", ".join(
            f"{d}={getattr(self, d).format_name if getattr(self, d) is not None else None}" for d in DIRECTIONS
        )
        return (
            f"{type(self).__name__}(shape={list(self.shape)}, dtype={self.dtype}, device={self.device}, "
            f"{directions}, quantizer={self.quantizer!r})"
        )

    # ---- the buffer contract: one flat dict of named buffers plus JSON metadata ------------------
    def shared_buffer_names(self) -> tuple[str, ...]:
        """Tensor-wide buffers that both directions hold as one tensor (Float8's `scale_inv`,
        NVFP4's `global_amax` without the Hadamard transform)."""
        rowwise, columnwise = self.rowwise, self.columnwise
        if rowwise is None or columnwise is None or rowwise is columnwise or type(rowwise) is not type(columnwise):
            return ()
        return tuple(
            spec.name
            for spec in rowwise.buffer_specs()
            if spec.tensor_wide and getattr(rowwise, spec.name) is getattr(columnwise, spec.name)
        )

    def to_buffers(self, *, quantizer_state: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
        """Every buffer once (`buffer_dict`), and the JSON-able metadata that rebuilds this tensor
        (`from_buffers`)."""
        return self.buffer_dict(quantizer_state=quantizer_state), TensorPlan.of(self).metadata(self.quantizer)

    def buffer_dict(self, *, quantizer_state: bool = True) -> dict[str, torch.Tensor]:
        """Every buffer once, by name: `<direction>.<name>`; a tensor-wide buffer both directions
        share is named `<name>` alone; the quantizer's running state (delayed scaling) is
        `quantizer.<name>`."""
        shared = self.shared_buffer_names()
        buffers = {}
        for direction in DIRECTIONS:
            storage = getattr(self, direction)
            if storage is None or (direction == "columnwise" and storage is self.rowwise):
                continue
            for name, buffer in storage.buffers.items():
                buffers[name if name in shared else f"{direction}.{name}"] = buffer
        if quantizer_state:
            buffers.update({f"quantizer.{name}": b for name, b in self.quantizer.state_buffers().items()})
        return buffers

    @staticmethod
    def from_buffers(
        buffers: dict[str, torch.Tensor], metadata: dict, *, quantizer: Quantizer | None = None, where: str = ""
    ) -> "QuantizedTensor":
        """Inverse of `to_buffers`, checked as `check_buffers` says. A `quantizer` given is used as
        is; otherwise a new one is built from the metadata with the saved running state."""
        plan, built = QuantizedTensor.check_buffers(buffers, metadata, quantizer=quantizer, where=where)
        if quantizer is None:
            state = {name.removeprefix("quantizer."): b for name, b in buffers.items() if name.startswith("quantizer.")}
            built.load_state_buffers(state, f"{where}quantizer.")
        return plan.assemble({name: b for name, b in buffers.items() if not name.startswith("quantizer.")}, built, from_file=True)

    @staticmethod
    def check_buffers(buffers: dict[str, torch.Tensor], metadata: dict, *, quantizer: Quantizer | None = None, where: str = ""):
        """ValueError naming `where` and the key unless `buffers` and `metadata` describe a valid
        tensor: the metadata well formed, naming only qtensor's own classes, and every buffer's
        name, dtype and shape what the formats' declared layouts say (meta tensors suffice: no data
        is read). Returns the plan and the quantizer (a new one built from the metadata, unless given)."""
        plan = TensorPlan.parse(metadata, where)
        state = {name.removeprefix("quantizer."): b for name, b in buffers.items() if name.startswith("quantizer.")}
        if quantizer is None:
            quantizer = quantizer_from_dict(metadata["quantizer"], f"{where}quantizer")
            quantizer.check_state_buffers(state, f"{where}quantizer.")
        elif state:
            raise ValueError(f"{where}: running state {sorted(state)} given with a quantizer; pass one or the other.")
        plan.check(quantizer, {name: b for name, b in buffers.items() if not name.startswith("quantizer.")}, where)
        return plan, quantizer

    # torch's traceable-subclass protocol (torch.compile, and nn.Module._apply, which then swaps the
    # parameter instead of assigning .data). The context compares by value and holds no shape (it
    # comes back as outer_size), no tensors and no per-step state, so compiled code can guard on it.
    # Compiled code asks at every call, for each quantized input: the answer is kept (flatten.py).
    def __tensor_flatten__(self):
        return cached_flatten(self, self._flatten, self._flatten_held())

    def _flatten(self, shared: tuple[str, ...]):
        return inner_names(self, shared), (TensorPlan.key_of(self, shared), self.quantizer)

    def _flatten_held(self) -> tuple | None:
        """The objects `_flatten`'s context carries besides the storages' plans (None: compute it each time)."""
        return (self.quantizer,)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, context, outer_size, outer_stride):
        key, quantizer = context[:2]
        buffers = {name.replace("__", "."): t for name, t in inner_tensors.items()}
        return TensorPlan.from_key(key, outer_size).assemble(buffers, quantizer)

    def __getattr__(self, name):
        # An inner tensor not yet a property of the class (flatten.py). Not compiled as a frame of
        # its own (skipped below, without a wrapper's cost): compiled code's guards and wrapper call it.
        if name.startswith("_"):  # no inner tensor is read here by such a name (flatten.py): torch's probes, answered at once
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return inner_tensor(self, name)

    __getattr__ = skipped_by_compiler(__getattr__, recursive=False)

    def __reduce_ex__(self, protocol):
        return traced_reduction(self, self._reduction()) if self._traced() else self._reduction()

    def _traced(self) -> bool:
        """Whether this is a fake tensor of torch.compile's tracing (its buffers are fake)."""
        return is_fake(next(iter(self.buffer_dict(quantizer_state=False).values())))

    def _reduction(self):
        if self.__dict__.get("_is_param"):
            # A parameter of a pickled module: keep it a parameter.
            return _rebuild_parameter, (self.detach(), self.requires_grad)
        buffers, metadata = self.to_buffers()
        # Only this tensor's own bytes (a split piece views its parent's), and FP8 buffers as their
        # bytes: plain pickle cannot carry float8 dtypes; the rebuild views them back.
        payload = {name: own_bytes(buffer) for name, buffer in buffers.items()}
        fp8 = {name: str(b.dtype).removeprefix("torch.") for name, b in payload.items() if b.dtype in FP8_DTYPES}
        payload = {name: b.view(torch.uint8) if name in fp8 else b for name, b in payload.items()}
        return _rebuild_quantized_tensor, (json.dumps(metadata), payload, fp8)

    # ---- FSDP2 ----------------------------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        # A layer's quantized weight gathers its low-precision bytes (weight.py); a quantized tensor
        # that is no layer's weight has no GEMM to say which direction to gather.
        raise ValueError(
            f"FSDP2 cannot shard this {type(self).__name__} parameter: it is not the weight of a layer "
            "qtensor.quantize_ set up, so nothing says which direction its GEMMs read. Quantize the model "
            "with qtensor.quantize_(model, recipe, weights='quantized') instead of assigning quantized tensors."
        )

    # ---- dispatch -----------------------------------------------------------------------------
    @classmethod
    def implements(cls, *funcs):
        """Decorator: register `handler(func, args, kwargs)` for the given aten ops on this class."""

        def register(handler):
            for func in funcs:
                cls._ops[func] = handler
            return handler

        return register

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for klass in cls.__mro__:
            handler = klass.__dict__.get("_ops", {}).get(func)
            if handler is not None:
                return handler(func, args, kwargs)
        return dequantized_fallback(func, args, kwargs)


def own_bytes(buffer: torch.Tensor) -> torch.Tensor:
    """`buffer` itself when it is contiguous and alone in its storage, else a compact copy."""
    if buffer.is_contiguous() and buffer.untyped_storage().nbytes() == buffer.numel() * buffer.element_size():
        return buffer
    return buffer.contiguous().clone()


def _rebuild_quantized_tensor(metadata_json: str, buffers: dict, fp8_dtypes: dict) -> QuantizedTensor:
    buffers = {name: b.view(DTYPES_BY_NAME[fp8_dtypes[name]]) if name in fp8_dtypes else b for name, b in buffers.items()}
    return QuantizedTensor.from_buffers(buffers, json.loads(metadata_json))


def traced_reduction(tensor: torch.Tensor, reduction: tuple) -> tuple:
    """A traced (fake) tensor of qtensor's, as torch.compile's caches pickle a graph's inputs to key
    its compiled code: `reduction` (its ordinary pickle) with its class and the names and metadata
    of the inner tensors `__tensor_flatten__` gives. Those are the compiled code's inputs, and what
    a layer weight adds to its buffers (its running state, a gathered cast's amaxes) is not in its
    ordinary pickle: without them two weights whose inner tensors differ would share a key, and one
    would be given code compiled for the other's inputs."""
    names, _ = tensor.__tensor_flatten__()
    return _traced_only, (type(tensor).__qualname__, tuple(names), tuple(getattr(tensor, n) for n in names), reduction)


def _traced_only(*_):
    raise RuntimeError("A traced (fake) qtensor tensor was pickled for a compile cache's key; it cannot be unpickled.")


def _rebuild_parameter(tensor: torch.Tensor, requires_grad: bool) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor, requires_grad=requires_grad)


torch.serialization.add_safe_globals([_rebuild_quantized_tensor])


# What happens when an op has no quantized implementation (docs/design.md, Dispatch): "allow" runs
# it on the dequantized values, "count" does too and counts it, "raise" refuses. A switch per thread
# and task (a context variable); QTENSOR_FALLBACKS sets its default for the process.
_FALLBACK_MODES = ("allow", "count", "raise")
_fallback_mode = contextvars.ContextVar("qtensor_fallbacks", default=os.environ.get("QTENSOR_FALLBACKS", "allow"))
if _fallback_mode.get() not in _FALLBACK_MODES:
    raise ValueError(f"QTENSOR_FALLBACKS must be one of {_FALLBACK_MODES}, got {_fallback_mode.get()!r}.")
# A diagnostic counter for the whole process, written under a lock.
_fallback_counts: collections.Counter = collections.Counter()
_fallback_counts_lock = threading.Lock()


@contextlib.contextmanager
def fallbacks(mode: str = "raise"):
    """Inside, an op on a quantized tensor that has no quantized implementation, and so would run on
    its dequantized values, raises (`"raise"`) or is counted (`"count"`, see `fallback_report`)."""
    if mode not in _FALLBACK_MODES:
        raise ValueError(f"qtensor.fallbacks: mode must be one of {_FALLBACK_MODES}, got {mode!r}.")
    token = _fallback_mode.set(mode)
    try:
        yield
    finally:
        _fallback_mode.reset(token)


def fallback_report(reset: bool = False) -> dict[tuple[str, str], int]:
    """{(op, tensor classes): count} of the fallbacks counted under `fallbacks("count")`, in this process."""
    with _fallback_counts_lock:
        report = dict(_fallback_counts)
        if reset:
            _fallback_counts.clear()
    return report


def note_fallback(func, classes: str) -> None:
    """An op about to run on the dequantized values of tensors of `classes`: raised or counted as
    `fallbacks` says."""
    mode = _fallback_mode.get()
    if mode == "raise":
        raise RuntimeError(
            f"{func} has no quantized implementation for {classes}: it would run on the dequantized "
            "values (qtensor.fallbacks('raise') is on). If that is what you want, run it outside the "
            "context, or on q.dequantize() explicitly."
        )
    if mode == "count":
        with _fallback_counts_lock:
            _fallback_counts[(str(func), classes)] += 1


def dequantized_fallback(func, args, kwargs):
    """Run `func` on dequantized values; requantize into any quantized tensor the op writes to."""
    if _fallback_mode.get() != "allow":
        note_fallback(func, "/".join(sorted({type(a).__name__ for a in tree_flatten((args, kwargs))[0] if isinstance(a, QuantizedTensor)})))

    def unwrap(value):
        return value.dequantize() if isinstance(value, QuantizedTensor) else value

    plain_args = tree_map(unwrap, args)
    plain_kwargs = tree_map(unwrap, kwargs)
    out = func(*plain_args, **plain_kwargs)
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if position < len(args) and not argument.kwarg_only:
            original, written = args[position], plain_args[position]
        elif argument.name in kwargs:
            original, written = kwargs[argument.name], plain_kwargs[argument.name]
        else:
            continue
        if isinstance(original, QuantizedTensor):
            original.copy_(written)
            if out is written:
                out = original
        elif isinstance(original, (list, tuple)):  # a Tensor[] the op writes into (a collective's outputs)
            for target, values in zip(original, written):
                if isinstance(target, QuantizedTensor):
                    target.copy_(values)
    return out


def rows_per_index(shape: torch.Size) -> int:
    """How many rows of the 2-D view one index along dim 0 covers."""
    return math.prod(shape[1:-1]) if len(shape) > 1 else 0


def split_rebuilt(tensor: QuantizedTensor, directions) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(directions rebuilt locally after an all-gather, directions whose bytes are sent): a
    columnwise copy the format rebuilds from the rowwise one (Float8's transpose) is never sent."""
    rebuilt = ("columnwise",) if "columnwise" in directions and _rebuilds_columnwise(tensor) else ()
    sent = tuple(dict.fromkeys((("rowwise",) if rebuilt else ()) + tuple(d for d in directions if d not in rebuilt)))
    return rebuilt, sent


def _rebuilds_columnwise(tensor: QuantizedTensor) -> bool:
    """Whether the columnwise copy is made from the rowwise one after a gather instead of sent."""
    if tensor.columnwise is not None and tensor.columnwise is tensor.rowwise:
        return True  # one storage serves both (Identity)
    rowwise, columnwise = tensor.rowwise, tensor.columnwise
    return (
        rowwise is not None and rowwise.rebuilds_other_direction and (columnwise is None or type(columnwise) is type(rowwise))
        and tensor.quantizer.quantizer_for("columnwise") is tensor.quantizer
    )
