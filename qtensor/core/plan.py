"""The plan of a quantized tensor: what it is without its buffers (class, logical shape and dtype,
what each direction holds, which tensor-wide buffers they share), its JSON form for files and
pickles, and the checks that let only valid buffers and qtensor's own classes back in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from .quantizer import DTYPES_BY_NAME, Quantizer, decode_value, encode_value, quantizer_to_dict
from .storage import DIRECTIONS, STORAGE_CLASSES, Storage, _buffer_names

# Each format's QuantizedTensor class by name (tensor.py registers them): files name only these.
TENSOR_CLASSES: dict[str, type] = {}

LOGICAL_DTYPES = {name: DTYPES_BY_NAME[name] for name in ("float32", "bfloat16", "float16")} | {"float64": torch.float64}


@dataclass(frozen=True)
class StoragePlan:
    """What one direction's storage is, without its buffers or size."""

    cls: type
    direction: str
    options: tuple  # ((name, value), ...)
    row_slice: bool = False

    @cached_property  # read at each call of a compiled graph (flatten.py)
    def buffer_names(self) -> tuple[str, ...]:
        """The storage's buffers' names, in layout order (they do not depend on its size)."""
        return _buffer_names(self.cls, self.direction, tuple(value for _, value in self.options))

    def build(self, buffers: dict[str, torch.Tensor], prefix: str, shared: tuple, rows: int, cols: int) -> Storage:
        names = [spec.name for spec in self.cls.layout(self.direction, rows, cols, **dict(self.options))]
        fields = {name: buffers[name if name in shared else prefix + name] for name in names}
        return self.cls(direction=self.direction, rows=rows, cols=cols, row_slice=self.row_slice, **dict(self.options), **fields)


def storage_plan(storage: Storage | None) -> StoragePlan | None:
    """The storage's plan, made once per storage: its class, direction, options and row_slice are
    fixed when it is made."""
    if storage is None:
        return None
    plan = storage.__dict__.get("_plan")
    if plan is None:
        plan = StoragePlan(type(storage), storage.direction, tuple(storage.options.items()), storage.row_slice)
        storage.__dict__["_plan"] = plan
    return plan


@dataclass(frozen=True)
class TensorPlan:
    """A quantized tensor without its buffers: class, logical shape and dtype, what each direction
    holds and which tensor-wide buffers they share. `key()` (no shape) is the flatten context."""

    cls: type
    shape: tuple
    dtype: torch.dtype
    rowwise: StoragePlan | None
    columnwise: StoragePlan | str | None  # "rowwise": the same storage serves both directions
    shared: tuple[str, ...]

    @staticmethod
    def of(tensor) -> "TensorPlan":
        return TensorPlan.from_key(TensorPlan.key_of(tensor), tensor.shape)

    @staticmethod
    def key_of(tensor, shared: tuple[str, ...] | None = None) -> tuple:
        """`TensorPlan.of(tensor).key()`, made without the shape: torch.compile asks for it (the
        flatten context) at every call of a compiled graph, for each quantized input. `shared`:
        `tensor.shared_buffer_names()`, where the caller has it."""
        rowwise, columnwise = tensor.rowwise, tensor.columnwise
        same = columnwise is not None and columnwise is rowwise
        with torch._C.DisableTorchFunctionSubclass():  # the dtype, not a call routed through the layers
            dtype = tensor.dtype
        shared = tensor.shared_buffer_names() if shared is None else shared
        return (type(tensor), dtype, storage_plan(rowwise), "rowwise" if same else storage_plan(columnwise), shared)

    def key(self) -> tuple:
        return (self.cls, self.dtype, self.rowwise, self.columnwise, self.shared)

    def data_key(self) -> tuple:
        """`key()` with the format's class: what a file of this tensor holds."""
        return (self.cls.data_class, *self.key()[1:])

    @staticmethod
    def from_key(key: tuple, outer_size) -> "TensorPlan":
        cls, dtype, rowwise, columnwise, shared = key
        return TensorPlan(cls, tuple(outer_size), dtype, rowwise, columnwise, shared)

    def assemble(self, buffers: dict[str, torch.Tensor], quantizer: Quantizer, *, from_file: bool = False) -> "QuantizedTensor":
        """The tensor over `buffers`; `from_file`: each storage in the layout `quantizer` makes today
        (`Quantizer.current_layout`)."""
        rows, cols = math.prod(self.shape[:-1]), self.shape[-1]
        current = lambda direction, storage: quantizer.quantizer_for(direction).current_layout(storage) if from_file else storage
        rowwise = current("rowwise", self.rowwise.build(buffers, "rowwise.", self.shared, rows, cols)) if self.rowwise else None
        if self.columnwise == "rowwise":
            columnwise = rowwise
        elif self.columnwise is not None:
            # A shared tensor-wide buffer is looked up by its bare name: both get the one tensor.
            columnwise = current("columnwise", self.columnwise.build(buffers, "columnwise.", self.shared, rows, cols))
        else:
            columnwise = None
        return self.cls(torch.Size(self.shape), self.dtype, rowwise, columnwise, quantizer)

    # ---- JSON form, and its validation ---------------------------------------------------------
    def metadata(self, quantizer: Quantizer) -> dict:
        def describe(plan):
            if plan is None or isinstance(plan, str):
                return plan
            options = {name: encode_value(value) for name, value in plan.options}
            return {"format": plan.cls.format_name, "direction": plan.direction, **options}

        return {
            "tensor": self.cls.data_class.__name__,
            "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
            "quantizer": quantizer_to_dict(quantizer),
            "rowwise": describe(self.rowwise),
            "columnwise": describe(self.columnwise),
            "shared": list(self.shared),
        }

    @staticmethod
    def parse(metadata, where: str) -> "TensorPlan":
        """The plan a tensor's JSON metadata describes; ValueError for anything malformed."""
        keys = {"tensor", "shape", "dtype", "quantizer", "rowwise", "columnwise", "shared"}
        if not isinstance(metadata, dict) or set(metadata) != keys:
            found = sorted(metadata) if isinstance(metadata, dict) else type(metadata).__name__
            raise ValueError(f"{where}metadata: expected the keys {sorted(keys)}, got {found}.")
        cls = lookup(TENSOR_CLASSES, metadata["tensor"], f"{where}tensor", "tensor class")
        shape = metadata["shape"]
        if not isinstance(shape, list) or not shape or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"{where}shape: expected a list of one or more sizes >= 0, got {shape!r}.")
        dtype = lookup(LOGICAL_DTYPES, metadata["dtype"], f"{where}dtype", "logical dtype")

        def storage_plan(direction):
            entry = metadata[direction]
            if entry is None or (direction == "columnwise" and entry == "rowwise"):
                return entry
            if not isinstance(entry, dict) or not isinstance(entry.get("format"), str):
                raise ValueError(f"{where}{direction}: expected null, a storage description or (columnwise) \"rowwise\", got {entry!r}.")
            storage_cls = lookup(STORAGE_CLASSES, entry["format"], f"{where}{direction}.format", "storage format")
            options = {k: decode_value(v, f"{where}{direction}.{k}") for k, v in entry.items() if k not in ("format", "direction")}
            options = {**storage_cls.options_added, **options}  # a file written before an option existed
            storage_cls.check_options(entry.get("direction"), options, f"{where}{direction}")
            return StoragePlan(storage_cls, entry["direction"], tuple((n, options[n]) for n in storage_cls.option_names()))

        rowwise, columnwise = storage_plan("rowwise"), storage_plan("columnwise")
        if rowwise is None and columnwise is None:
            raise ValueError(f"{where.rstrip('. ') or 'tensor'}: a quantized tensor holds at least one direction; both are null.")
        if columnwise == "rowwise" and (rowwise is None or rowwise.direction != "both"):
            raise ValueError(f'{where}columnwise: "rowwise" (one storage for both) needs a rowwise storage of direction "both".')
        for direction, plan in (("rowwise", rowwise), ("columnwise", columnwise)):
            if isinstance(plan, StoragePlan) and plan.direction not in (direction, "both"):
                raise ValueError(f"{where}{direction}.direction: {plan.direction!r} is not {direction!r}.")
        shared = metadata["shared"]
        if not isinstance(shared, list) or not all(isinstance(n, str) for n in shared):
            raise ValueError(f"{where}shared: expected a list of buffer names, got {shared!r}.")
        if shared:
            if not (isinstance(rowwise, StoragePlan) and isinstance(columnwise, StoragePlan) and rowwise.cls is columnwise.cls):
                raise ValueError(f"{where}shared: only two storages of one format can share buffers, got {shared!r}.")
            rows, cols = math.prod(shape[:-1]), shape[-1]
            tensor_wide = {s.name for s in rowwise.cls.layout("rowwise", rows, cols, **dict(rowwise.options)) if s.tensor_wide}
            if not set(shared) <= tensor_wide:
                raise ValueError(f"{where}shared: {sorted(set(shared) - tensor_wide)} are not tensor-wide buffers of {rowwise.cls.format_name}.")
        return TensorPlan(cls, tuple(shape), dtype, rowwise, columnwise, tuple(shared))

    def check(self, quantizer: Quantizer, buffers: dict[str, torch.Tensor], where: str) -> None:
        """The storages must be what `quantizer` makes and the buffers exactly what their layouts declare."""
        if quantizer.tensor_class is not self.cls.data_class:
            raise ValueError(f"{where}tensor: a {self.cls.__name__} cannot come from {quantizer!r}.")
        for direction in DIRECTIONS:
            plan = getattr(self, direction)
            if isinstance(plan, StoragePlan):
                maker = quantizer.quantizer_for(direction)
                if plan.cls.format_name != maker.format_name:
                    raise ValueError(f"{where}{direction}.format: {plan.cls.format_name!r} storage, but {maker!r} makes {maker.format_name!r}.")
        rows, cols = math.prod(self.shape[:-1]), self.shape[-1]
        expected = {}
        for direction in DIRECTIONS:
            plan = getattr(self, direction)
            if isinstance(plan, StoragePlan):
                for spec in plan.cls.layout(plan.direction, rows, cols, **dict(plan.options)):
                    expected[spec.name if spec.name in self.shared else f"{direction}.{spec.name}"] = (spec, plan)
        if set(buffers) != set(expected):
            missing, extra = sorted(set(expected) - set(buffers)), sorted(set(buffers) - set(expected))
            raise ValueError(f"{where.rstrip('. ') or 'tensor'}: buffers {sorted(expected)} expected; missing {missing}, unexpected {extra}.")
        devices = {buffer.device for buffer in buffers.values()}
        if len(devices) > 1:
            raise ValueError(f"{where.rstrip('. ') or 'tensor'}: buffers lie on several devices {sorted(map(str, devices))}; move them to one.")
        for name, (spec, plan) in expected.items():
            buffer = buffers[name]
            if buffer.dtype != spec.dtype or tuple(buffer.shape) != spec.shape:
                raise ValueError(
                    f"{where}{name}: expected {str(spec.dtype).removeprefix('torch.')} of shape "
                    f"{list(spec.shape)} (a {plan.cls.format_name} {plan.direction} storage of a "
                    f"[{rows}, {cols}] view), got {str(buffer.dtype).removeprefix('torch.')} of shape {list(buffer.shape)}."
                )



def lookup(table: dict, name, where: str, what: str):
    if not isinstance(name, str) or name not in table:
        raise ValueError(f"{where}: unknown qtensor {what} {name!r}; expected one of {sorted(table)}.")
    return table[name]
