"""QuantizedTensor: the torch.Tensor wrapper over one or two direction storages.

Dispatch (DESIGN.md §3): every class has an op table filled by `@Cls.implements(...)`. An op found
in the table (searched along the class's MRO) runs its handler; any other op sees the dequantized
value and returns plain tensors, and an op that writes into a quantized tensor requantizes the
result into it.
"""

from __future__ import annotations

import json
import math

import torch
from torch.utils._pytree import tree_map

from .numerics import cast_saturating
from .quantizer import Quantizer, quantizer_from_dict, quantizer_to_dict
from .storage import DIRECTIONS, STORAGE_CLASSES, Storage

TENSOR_CLASSES: dict[str, type["QuantizedTensor"]] = {}

_DTYPES_BY_NAME = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


class QuantizedTensor(torch.Tensor):
    """Base of Float8Tensor, MXFP8Tensor, NVFP4Tensor, IdentityTensor and HybridQuantizedTensor.

    `shape` and `dtype` are the logical (high-precision) ones; the data lives in `rowwise` and
    `columnwise`, each a `Storage` over the 2-D view `[prod(shape[:-1]), shape[-1]]` or None.
    """

    _ops: dict = {}
    # Set on a layer's weight by qtensor.quantize_ (a linear.LinearQuantizers); kept by derived tensors.
    linear_quantizers = None
    rowwise: Storage | None
    columnwise: Storage | None
    quantizer: Quantizer

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._ops = {}
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
        # A weight that carries its layer's quantizers routes F.linear & co. to the quantized linear.
        from .linear import torch_function

        if func is torch.Tensor.__setitem__ and isinstance(args[0], QuantizedTensor):
            return args[0].assign(args[1], args[2])
        return torch_function(func, args, kwargs)

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
        values = self.storage_for(direction).dequantize()
        return cast_saturating(values.reshape(self.shape), dtype or self.dtype)

    def storage_nbytes(self) -> int:
        """Bytes held by all buffers of both directions (a buffer shared by both counted once)."""
        unique = {}
        for storage in (self.rowwise, self.columnwise):
            if storage is not None:
                for buffer in storage.buffers.values():
                    unique[id(buffer)] = buffer.numel() * buffer.element_size()
        return sum(unique.values())

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
        rebuilt = source.to_direction(direction)
        if rebuilt is None:
            raise ValueError(
                f"{type(self).__name__} cannot rebuild its {direction} copy from the {source.direction} one "
                f"({source.format_name} blocks run along one direction). Quantize the high-precision "
                f"tensor again with {direction}=True."
            )
        return rebuilt

    def with_storages(self, rowwise, columnwise, shape=None, dtype=None, requires_grad=False):
        """A new tensor of this class, quantizer and layer quantizers over the given storages."""
        result = type(self)(
            self.shape if shape is None else shape,
            self.dtype if dtype is None else dtype,
            rowwise,
            columnwise,
            self.quantizer,
            requires_grad=requires_grad,
        )
        result.linear_quantizers = self.linear_quantizers
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

    def __repr__(self) -> str:
        directions = ", ".join(
            f"{d}={getattr(self, d).format_name if getattr(self, d) is not None else None}" for d in DIRECTIONS
        )
        return (
            f"{type(self).__name__}(shape={list(self.shape)}, dtype={self.dtype}, device={self.device}, "
            f"{directions}, quantizer={self.quantizer!r})"
        )

    # ---- serialization: one flat dict of buffers + JSON metadata ------------------------------
    def flatten(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Buffers named `<direction>.<field>` and JSON-able metadata that rebuild this tensor."""
        metadata = {
            "tensor_class": type(self).__name__,
            "shape": list(self.shape),
            "dtype": str(self.dtype),
            "quantizer": quantizer_to_dict(self.quantizer),
        }
        buffers = {}
        for direction in DIRECTIONS:
            storage = getattr(self, direction)
            if storage is None:
                metadata[direction] = None
            elif direction == "columnwise" and storage is self.rowwise:
                metadata[direction] = "rowwise"
            else:
                metadata[direction] = {"format": storage.format_name, **storage.attributes}
                buffers.update({f"{direction}.{name}": b for name, b in storage.buffers.items()})
        return buffers, metadata

    @staticmethod
    def unflatten(buffers: dict[str, torch.Tensor], metadata: dict, quantizer: Quantizer | None = None) -> "QuantizedTensor":
        """Inverse of `flatten`; builds only classes registered by qtensor itself. `quantizer`, when
        given, is used as is instead of rebuilding one from the metadata."""
        cls = _lookup(TENSOR_CLASSES, metadata["tensor_class"], "tensor class")
        storages = {}
        for direction in DIRECTIONS:
            entry = metadata[direction]
            if entry is None or entry == "rowwise":
                storages[direction] = storages.get(entry)
                continue
            storage_cls = _lookup(STORAGE_CLASSES, entry["format"], "storage format")
            fields = {k: v for k, v in entry.items() if k != "format"}
            fields.update({name: buffers[f"{direction}.{name}"] for name in storage_cls.tensor_data_names})
            storages[direction] = storage_cls(**fields)
        dtype = _lookup(_DTYPES_BY_NAME, metadata["dtype"], "dtype")
        quantizer = quantizer or quantizer_from_dict(metadata["quantizer"])
        return cls(torch.Size(metadata["shape"]), dtype, storages["rowwise"], storages["columnwise"], quantizer)

    # torch's traceable-subclass protocol: nn.Module._apply (module.to/cuda/half) then swaps the
    # parameter with the converted tensor instead of assigning .data, which would keep stale storages.
    def __tensor_flatten__(self):
        buffers, metadata = self.flatten()
        return [name.replace(".", "__") for name in buffers], (metadata, self.quantizer, self.linear_quantizers)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, context, outer_size, outer_stride):
        metadata, quantizer, linear_quantizers = context
        buffers = {name.replace("__", "."): tensor for name, tensor in inner_tensors.items()}
        result = QuantizedTensor.unflatten(buffers, metadata, quantizer)
        result.linear_quantizers = linear_quantizers
        return result

    def __getattr__(self, name):
        # The inner tensors __tensor_flatten__ names: "rowwise__data" is self.rowwise.data.
        direction, separator, field = name.partition("__")
        storage = self.__dict__.get(direction) if separator and direction in DIRECTIONS else None
        if storage is not None and field in storage.tensor_data_names:
            return getattr(storage, field)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __reduce_ex__(self, protocol):
        if self.__dict__.get("_is_param"):
            # A parameter of a pickled module: keep it a parameter with its layer's quantizers.
            return _rebuild_parameter, (self.detach(), self.requires_grad, self.linear_quantizers)
        buffers, metadata = self.flatten()
        # A split piece views its parent's buffers; save only its own bytes.
        buffers = {name: b.clone() if b.untyped_storage().nbytes() > b.nbytes else b for name, b in buffers.items()}
        return _rebuild_quantized_tensor, (json.dumps(metadata), buffers)

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


def _lookup(table: dict, name: str, what: str):
    if name not in table:
        raise ValueError(f"Unknown qtensor {what} {name!r}; the file was written by another version or is corrupt.")
    return table[name]


def _rebuild_quantized_tensor(metadata_json: str, buffers: dict) -> QuantizedTensor:
    return QuantizedTensor.unflatten(buffers, json.loads(metadata_json))


def _rebuild_parameter(tensor: torch.Tensor, requires_grad: bool, linear_quantizers) -> torch.nn.Parameter:
    parameter = torch.nn.Parameter(tensor, requires_grad=requires_grad)
    parameter.linear_quantizers = linear_quantizers
    return parameter


torch.serialization.add_safe_globals([_rebuild_quantized_tensor])


def dequantized_fallback(func, args, kwargs):
    """Run `func` on dequantized values; requantize into any quantized tensor the op writes to."""

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
    return out


def rows_per_index(shape: torch.Size) -> int:
    """How many rows of the 2-D view one index along dim 0 covers."""
    return math.prod(shape[1:-1]) if len(shape) > 1 else 0
