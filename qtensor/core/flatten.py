"""A quantized tensor's inner tensors, as torch's traceable-subclass protocol names them.

torch.compile reads a quantized input through `__tensor_flatten__` (the names of its inner tensors
and a context that compares by value) and then each inner tensor by name, at every call of a
compiled graph: once in the graph's guards and again in its wrapper, which passes the inner tensors
to the graph. For a held weight that is a few times per weight per step, so both are kept cheap:

- an inner tensor is a property of the tensor's class (`rowwise__data` reads `rowwise.data`), added
  when a tensor of that class first names it. It reads the storage at each access, so it cannot go
  stale; a name read before that goes through the class's `__getattr__`, with the same result.
- the flatten answer is kept on the tensor (`FlattenCache`) and given again while the storages,
  the shared tensor-wide buffers and the objects the context carries are the same ones; anything
  else (a storage replaced, a buffer that stopped being shared, another quantizer) computes it again.
- no inner tensor is read through `__getattr__` by a name that begins with "_" (the storages'
  buffers, `state__`, `cast__`; a dynamic weight's `_data` is an attribute of its own), so the
  classes' `__getattr__` refuse such a name at once: torch.compile's guards probe every quantized
  input with `hasattr` for five of them (`_dynamo_dynamic_indices`, ...) at each call.
- size(), stride() and the other metadata reads of `METADATA_READS`, which compiled code's wrapper
  makes for each quantized input at every call, skip the classes' routing in `__torch_function__`.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from .plan import storage_plan
from .storage import DIRECTIONS


# Metadata reads that qtensor answers as torch does (the wrapper subclass's own sizes, strides, dtype
# and device): the quantized tensors' and layer weights' `__torch_function__` run them at once, on
# plain-tensor semantics (`plain`).
_BASE = torch._C.TensorBase
METADATA_READS = frozenset(
    [_BASE.size, _BASE.stride, _BASE.dim, _BASE.numel, _BASE.is_contiguous]
    + [getattr(_BASE, name).__get__ for name in ("shape", "dtype", "device", "requires_grad", "ndim", "layout", "is_cuda")]
)


def plain(func, args, kwargs):
    """`func` on plain-tensor semantics (no subclass's __torch_function__ runs again)."""
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def inner_names(tensor, shared: tuple[str, ...]) -> list[str]:
    """`tensor.buffer_dict()`'s names as its inner tensors' (`.` as `__`), read from the storages'
    plans, not from the buffers. `shared`: `tensor.shared_buffer_names()`."""
    names = []
    for direction in DIRECTIONS:
        storage = getattr(tensor, direction)
        if storage is None or (direction == "columnwise" and storage is tensor.rowwise):
            continue
        for name in storage_plan(storage).buffer_names:
            if name not in shared:
                names.append(f"{direction}__{name}")
            elif name not in names:  # a tensor-wide buffer both directions share: named once
                names.append(name)
    return names


def _where(name: str) -> tuple[str, str]:
    """(direction, buffer) of an inner tensor's name; a shared tensor-wide buffer is the rowwise one."""
    direction, separator, field = name.partition("__")
    return (direction, field) if separator else ("rowwise", name)


def _read(tensor, direction: str, field: str, name: str) -> torch.Tensor:
    storage = tensor.__dict__.get(direction) if direction in DIRECTIONS else None
    if storage is not None and field in storage_plan(storage).buffer_names:
        return getattr(storage, field)
    raise AttributeError(f"{type(tensor).__name__} has no attribute {name!r}")


def inner_tensor(tensor, name: str) -> torch.Tensor:
    """The inner tensor `__tensor_flatten__` names: "rowwise__data" is `tensor.rowwise.data`, a
    shared tensor-wide "scale_inv" is `tensor.rowwise.scale_inv`."""
    return _read(tensor, *_where(name), name)


def _add_properties(cls: type, names: list[str]) -> None:
    """Each name as a property of `cls` that reads the inner tensor (where `cls` has no such attribute)."""
    for name in names:
        direction, field = _where(name)
        if direction in DIRECTIONS and not hasattr(cls, name):
            setattr(cls, name, property(lambda tensor, d=direction, f=field, n=name: _read(tensor, d, f, n)))


class FlattenCache:
    """A tensor's last flatten answer and what it was made from: its class, its storages (weak
    references: a replaced storage is not kept alive), the shared buffers' names and the objects the
    context carries (held, and compared by identity)."""

    __slots__ = ("cls", "rowwise", "columnwise", "shared", "held", "answer")

    def __init__(self, tensor, shared: tuple, held: tuple, answer: tuple):
        self.cls, self.shared, self.held, self.answer = type(tensor), shared, held, answer
        self.rowwise, self.columnwise = _ref(tensor.rowwise), _ref(tensor.columnwise)

    def answers(self, tensor, shared: tuple, held: tuple) -> bool:
        return (
            _same(self.rowwise, tensor.rowwise)
            and _same(self.columnwise, tensor.columnwise)
            and type(tensor) is self.cls
            and shared == self.shared
            and len(held) == len(self.held)
            and all(a is b for a, b in zip(held, self.held))
        )

    # Not copied with the tensor's __dict__ (deepcopy, pickle): a copy has storages of its own.
    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return type(None), ()


def _ref(storage):
    return weakref.ref(storage) if storage is not None else None


def _same(ref, storage) -> bool:
    """Whether `ref` (`_ref` of a storage then) refers to `storage` now; a storage since freed does not."""
    return ref is None if storage is None else ref is not None and ref() is storage


def cached_flatten(tensor, compute: Callable[[tuple], tuple], held: tuple | None) -> tuple:
    """`tensor.__tensor_flatten__()`: `compute(shared)`, or the tensor's last answer where it still
    holds (`FlattenCache`). `held`: the objects the context carries besides the storages' plans;
    None where the answer may change with no storage or object changed (it is computed each time)."""
    shared = tensor.shared_buffer_names()
    cache = tensor.__dict__.get("_flattened")
    if held is not None and cache is not None and cache.answers(tensor, shared, held):
        return cache.answer
    answer = compute(shared)
    if held is not None:
        tensor.__dict__["_flattened"] = FlattenCache(tensor, shared, held, answer)
        _add_properties(type(tensor), answer[0])
    return answer
