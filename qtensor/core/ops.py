"""Format-independent dispatch ops, registered once on QuantizedTensor (docs/design.md, Dispatch).

These are the ops FSDP2 and nn.Module send to parameters. Each works on storages, so every format
(and a hybrid of any two) gets them for free. A shape an op cannot keep quantized (a view that
changes the last dimension, a split along another dimension) takes the dequantized fallback.
"""

import torch
from torch._prims_common import infer_size
from torch.utils._pytree import tree_map_only

from . import numerics
from .quantizer import INPUT_DTYPES, fold_to_2d
from .storage import DIRECTIONS
from .tensor import QuantizedTensor, dequantized_fallback, rows_per_index

aten = torch.ops.aten
implements = QuantizedTensor.implements


def bind(func, args, kwargs) -> dict:
    """The op's arguments by schema name, defaults filled in."""
    bound = {}
    for position, argument in enumerate(func._schema.arguments):
        if position < len(args) and not argument.kwarg_only:
            bound[argument.name] = args[position]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


@implements(aten.detach.default, aten.alias.default)
def _alias(func, args, kwargs):
    self = args[0]
    return self.with_storages(self.rowwise, self.columnwise)


@implements(aten.clone.default)
def _clone(func, args, kwargs):
    return args[0].map_buffers(torch.clone)


@implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    self = args[0]
    dtype = kwargs.get("dtype") or self.dtype
    if not dtype.is_floating_point:
        return dequantized_fallback(func, args, kwargs)
    device = kwargs.get("device") or self.device
    non_blocking = kwargs.get("non_blocking", False)

    def move(buffer):
        moved = buffer.to(device, non_blocking=non_blocking, copy=True)
        return moved.pin_memory() if kwargs.get("pin_memory") else moved

    return self.map_buffers(move, dtype=dtype)


@implements(aten.view.default, aten._unsafe_view.default)
def _view(func, args, kwargs):
    self, size = args[0], args[1]
    shape = torch.Size(infer_size(size, self.numel())) if self.numel() else torch.Size(size)
    keeps_rows = len(shape) >= 1 and shape[-1] == self.shape[-1] and shape.numel() == self.numel()
    if not keeps_rows or (self.shape[-1] == 0 and shape[:-1].numel() != self.shape[:-1].numel()):
        if shape.numel() != self.numel():
            return dequantized_fallback(func, args, kwargs)  # torch's own error
        return DequantizedView(self, shape)
    return self.with_storages(self.rowwise, self.columnwise, shape=shape)


class DequantizedView(torch.Tensor):
    """`q.view(shape)` with another last dimension (FSDP2 keeps `param.view(-1)`): the dequantized
    values in that shape, computed whenever it is used and never stored, so a flat view costs no
    memory. Every op sees those values and returns plain tensors; a write into it does not reach `q`."""

    @staticmethod
    def __new__(cls, source: QuantizedTensor, shape: torch.Size):
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=source.dtype, device=source.device)
        self.source = source
        return self

    def __init__(self, *args, **kwargs):
        pass

    def values(self) -> torch.Tensor:
        return self.source.dequantize().reshape(self.shape)

    def __repr__(self, *, tensor_contents=None):
        return f"DequantizedView({self.values()!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        plain_args, plain_kwargs = tree_map_only(DequantizedView, DequantizedView.values, (args, kwargs or {}))
        return func(*plain_args, **plain_kwargs)


@implements(aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def _reshaping_view(func, args, kwargs):
    self = args[0]
    shape = func(torch.empty(self.shape, device="meta"), *args[1:], **kwargs).shape
    if len(shape) == 0 or shape[-1] != self.shape[-1]:
        return dequantized_fallback(func, args, kwargs)
    return self.with_storages(self.rowwise, self.columnwise, shape=shape)


@implements(aten.as_strided.default)
def _as_strided(func, args, kwargs):
    a = bind(func, args, kwargs)
    self = a["self"]
    identity = (
        list(a["size"]) == list(self.shape) and list(a["stride"]) == list(self.stride()) and not a["storage_offset"]
    )
    if not identity:
        return dequantized_fallback(func, args, kwargs)
    return self.with_storages(self.rowwise, self.columnwise)


def slice_dim0(self: QuantizedTensor, start: int, stop: int) -> QuantizedTensor:
    """Indices `[start, stop)` along dim 0, keeping block boundaries (raises ValueError otherwise)."""
    per_index = rows_per_index(self.shape)
    row_start, row_stop = start * per_index, stop * per_index
    shape = torch.Size([stop - start, *self.shape[1:]])
    return self.map_storages(lambda storage: storage.slice_rows(row_start, row_stop), shape=shape)


def slice_last_dim(self: QuantizedTensor, start: int, stop: int) -> QuantizedTensor:
    """Indices `[start, stop)` along the last dimension (the columns of the 2-D view), keeping block
    boundaries (raises ValueError otherwise): a row-parallel weight's shard."""
    shape = torch.Size([*self.shape[:-1], stop - start])
    return self.map_storages(lambda storage: storage.slice_cols(start, stop), shape=shape)


def _piece_of(self, dim):
    """How a split along `dim` cuts the tensor: slice_dim0, slice_last_dim, or None (values)."""
    if self.dim() < 2:
        return None
    dim %= self.dim()
    return slice_dim0 if dim == 0 else slice_last_dim if dim == self.dim() - 1 else None


@implements(aten.split.Tensor, aten.split_with_sizes.default)
def _split(func, args, kwargs):
    a = bind(func, args, kwargs)
    self, sizes = a["self"], a.get("split_size", a.get("split_sizes"))
    piece = _piece_of(self, a["dim"])
    if piece is None:
        return dequantized_fallback(func, args, kwargs)
    length = self.shape[a["dim"]]
    if isinstance(sizes, int):
        sizes = [min(sizes, length - start) for start in range(0, length, sizes)] or [0]
    pieces, start = [], 0
    for size in sizes:
        pieces.append(piece(self, start, start + size))
        start += size
    return pieces


@implements(aten.slice.Tensor)
def _slice(func, args, kwargs):
    a = bind(func, args, kwargs)
    self = a["self"]
    piece = _piece_of(self, a["dim"])
    if piece is None or a["step"] != 1:
        return dequantized_fallback(func, args, kwargs)
    start, end, _ = slice(a["start"], a["end"]).indices(self.shape[a["dim"]])
    return piece(self, start, max(start, end))


@implements(aten.copy_.default)
def _copy(func, args, kwargs):
    self, src = args[0], args[1]
    if not isinstance(self, QuantizedTensor):  # a plain tensor receiving a quantized one
        return self.copy_(src.dequantize(), non_blocking=kwargs.get("non_blocking", False))
    if isinstance(src, QuantizedTensor) and byte_compatible(self, src):
        _check_tensor_wide_buffers_match(self, src)
        copy_storages(self, src)
        # The bytes carry their scale's standing with them (FSDP2 re-pads a shard by copying it).
        mark_scales(self, scales_agreed(src))
        return self
    _check_not_a_slice_of_tensor_wide_scale(self)
    plain = src.dequantize() if isinstance(src, QuantizedTensor) else src
    plain = plain.to(device=self.device, dtype=self.dtype).expand(self.shape)
    fresh = self.quantizer.quantize(plain, rowwise=self.has_rowwise, columnwise=self.has_columnwise)
    copy_storages(self, fresh)
    # A shard written outside sharded_cast has a scale of its own rows: fsdp.py checks, at its
    # next all-gather, that every rank's scale agrees.
    mark_scales(self, numerics.sharded_quantization())
    return self


def _tensor_wide_buffers(tensor: QuantizedTensor) -> list[torch.Tensor]:
    return [getattr(storage, name) for _, storage in _storages(tensor) for name in _tensor_wide(storage)]


def mark_scales(tensor: QuantizedTensor, agreed: bool) -> None:
    """Record on the tensor-wide buffers (the objects every slice of the tensor shares) whether
    they are known to be the whole sharded tensor's (docs/design.md, FSDP2)."""
    for buffer in _tensor_wide_buffers(tensor):
        buffer._qtensor_scale_agreed = agreed


def scales_agreed(tensor: QuantizedTensor) -> bool:
    return all(getattr(buffer, "_qtensor_scale_agreed", True) for buffer in _tensor_wide_buffers(tensor))


def _storages(tensor: QuantizedTensor):
    return [(d, getattr(tensor, d)) for d in DIRECTIONS if getattr(tensor, d) is not None]


def _tensor_wide(storage) -> list[str]:
    return [spec.name for spec in storage.buffer_specs() if spec.tensor_wide]


def _check_not_a_slice_of_tensor_wide_scale(self: QuantizedTensor) -> None:
    """Requantizing a row slice must not change rows outside it: refused when a scale it holds
    also covers those rows (a tensor-wide scale, or the block its last rows share)."""
    if numerics.sharded_quantization():
        # An FSDP2 shard (a row slice of its zero-padded shard): the amax is reduced over the mesh, so
        # the new scale is the whole tensor's, and the padding rows are zero codes under any scale.
        return
    for direction, storage in _storages(self):
        if storage.row_slice and (_tensor_wide(storage) or storage.ends_mid_block()) and storage.rest_is_zero():
            continue  # the rows sharing its scales are zeros (FSDP2's zero-padded uneven shard)
        if storage.row_slice and _tensor_wide(storage):
            raise ValueError(
                f"Cannot quantize into a row slice of a {type(self).__name__}: its "
                f"{'/'.join(_tensor_wide(storage))} covers the whole tensor, and a new one for these "
                "rows would change the rest. Copy into the whole tensor, or into a clone() of the slice."
            )
        if storage.ends_mid_block():
            raise ValueError(
                f"Cannot quantize into this row slice of a {type(self).__name__}: its last "
                f"{storage.rows % storage.row_block()} rows share a {storage.row_block()}-row "
                f"{storage.format_name} {direction} block with rows after it, which a new scale would "
                "change. Copy into the whole tensor, or into a clone() of the slice."
            )


def _check_tensor_wide_buffers_match(self: QuantizedTensor, src: QuantizedTensor) -> None:
    """Bytes copied into a row slice must keep the scale the rest of the tensor shares. A load
    target (`fills_from_checkpoint`: a module's state_dict entry, which torch.distributed.checkpoint
    fills row range by row range from one checkpoint whose shards share one scale) adopts the
    source's scale instead (docs/checkpoints.md)."""
    if self.is_meta:  # no values to compare (a model built on the meta device)
        return
    for direction, mine in _storages(self):
        theirs = getattr(src, direction)
        differing = [  # the source may lie elsewhere (DCP reads chunks to the CPU)
            n for n in _tensor_wide(mine) if not torch.equal(getattr(mine, n), getattr(theirs, n).to(getattr(mine, n).device))
        ]
        if not (mine.row_slice and differing):
            continue
        if self.fills_from_checkpoint:
            for name in differing:
                getattr(mine, name).copy_(getattr(theirs, name))
            continue
        _check_not_a_slice_of_tensor_wide_scale(self)


def byte_compatible(self: QuantizedTensor, src: QuantizedTensor) -> bool:
    if type(self).data_class is not type(src).data_class or self.shape != src.shape or self.quantizer != src.quantizer:
        return False
    return all(getattr(src, d) is not None and mine.same_layout(getattr(src, d)) for d, mine in _storages(self))


def copy_storages(self: QuantizedTensor, source: QuantizedTensor, unless=None) -> None:
    """Copy `source`'s bytes into every buffer of `self`'s directions, each buffer once (and not
    where `unless(theirs, mine)` holds)."""
    done = set()
    for direction, mine in _storages(self):
        theirs = getattr(source, direction).buffers
        for name, target in mine.buffers.items():
            if id(target) not in done and not (unless is not None and unless(theirs[name], target)):
                done.add(id(target))
                target.copy_(theirs[name])


def quantized_zeros(self: QuantizedTensor, shape, dtype=None, device=None) -> QuantizedTensor:
    """Zeros of `shape` in self's format and usages; the quantizer's running state is untouched."""
    dtype = dtype or self.dtype
    zeros = torch.zeros(shape, dtype=dtype if dtype in INPUT_DTYPES else torch.float32, device=device or self.device)
    rowwise, columnwise = self.quantizer._quantize_2d(
        fold_to_2d(zeros), self.has_rowwise, self.has_columnwise, update_state=False
    )
    if self.rowwise is not None and self.rowwise is self.columnwise:
        columnwise = rowwise
    # Zero codes are zero under any scale: keep self's tensor-wide buffers (its scale), so that
    # self's bytes can be copied into rows of the result (FSDP2: new_zeros, then narrow().copy_()).
    for fresh, mine in ((rowwise, self.rowwise), (columnwise, self.columnwise)):
        if fresh is None or mine is None or self.is_meta or fresh.device.type == "meta":
            continue
        for spec in fresh.buffer_specs():
            if spec.tensor_wide:
                getattr(fresh, spec.name).copy_(getattr(mine, spec.name))
    return self.with_storages(rowwise, columnwise, shape=torch.Size(shape), dtype=dtype)


@implements(aten.new_zeros.default, aten.new_empty.default)
def _new_zeros(func, args, kwargs):
    self, size = args[0], args[1]
    if len(size) == 0 or not _keeps_float(kwargs):
        return dequantized_fallback(func, args, kwargs)
    return quantized_zeros(self, size, kwargs.get("dtype"), kwargs.get("device"))


@implements(aten.empty_like.default, aten.zeros_like.default)
def _empty_like(func, args, kwargs):
    self = args[0]
    if not _keeps_float(kwargs):
        return dequantized_fallback(func, args, kwargs)
    return quantized_zeros(self, self.shape, kwargs.get("dtype"), kwargs.get("device"))


def _keeps_float(kwargs) -> bool:
    """A new tensor asked for in a non-float dtype is a plain tensor, not a quantized one."""
    return kwargs.get("dtype") is None or kwargs["dtype"].is_floating_point


@implements(aten.zero_.default)
def _zero(func, args, kwargs):
    self = args[0]
    copy_storages(self, quantized_zeros(self, self.shape))
    return self


@implements(aten.is_pinned.default)
def _is_pinned(func, args, kwargs):
    buffers = args[0].buffer_dict(quantizer_state=False)
    return all(buffer.is_pinned() for buffer in buffers.values())


@implements(aten._pin_memory.default)
def _pin_memory(func, args, kwargs):
    return args[0].map_buffers(torch.Tensor.pin_memory)


# ---- collectives that move a quantized tensor whole (DTensor's distribute_tensor from one rank) ------
def _wire(buffer: torch.Tensor) -> torch.Tensor:
    """A buffer as a collective carries it: contiguous, one-byte dtypes as uint8 (gloo has no float8)."""
    buffer = buffer.contiguous()
    return buffer.view(torch.uint8) if buffer.element_size() == 1 and buffer.dtype != torch.uint8 else buffer


def _buffer_lists(tensors) -> list[list[torch.Tensor]]:
    """Each tensor's buffers, direction by direction in layout order (the same order on every rank)."""
    return [[getattr(s, spec.name) for _, s in _storages(t) for spec in s.buffer_specs()] for t in tensors]


def _buffer_by_buffer(func, outputs, inputs, run) -> tuple:
    """A collective over quantized `outputs` (and `inputs`, lists of them) run once per buffer:
    `run(output buffers, input buffers)` on the wire forms, waited on, each output buffer then
    holding what arrived. Returns what the op returns: the outputs and the last Work."""
    for tensor in [*outputs, *(t for group in inputs for t in group)]:
        if not isinstance(tensor, QuantizedTensor) or not byte_compatible(outputs[0], tensor):
            raise ValueError(f"{func}: every tensor must be a quantized tensor of one layout; got {type(tensor).__name__}.")
    outs, ins = _buffer_lists(outputs), [_buffer_lists(group) for group in inputs]
    work = None
    for index in range(len(outs[0])):
        wired = [_wire(buffers[index]) for buffers in outs]
        # Blocking (async_op=False): the collective has completed on the current stream when it returns.
        _, work = run(wired, [[_wire(buffers[index]) for buffers in group] for group in ins])
        for buffers, received in zip(outs, wired):
            if buffers[index].data_ptr() != received.data_ptr():
                buffers[index].copy_(received.view(buffers[index].dtype))
    for tensor in outputs:
        mark_scales(tensor, True)  # every rank now holds the source rank's bytes and scales
    return list(outputs), work


@implements(torch.ops.c10d.scatter_.default)
def _scatter(func, args, kwargs):
    """dist.scatter of quantized tensors: each buffer's bytes scattered from the source rank."""
    a = bind(func, args, kwargs)
    rest = (a["process_group"], a["root_rank"], False, a["timeout"])
    return _buffer_by_buffer(func, a["output_tensors"], a["input_tensors"], lambda outs, ins: func(outs, ins, *rest))


@implements(torch.ops.c10d.broadcast_.default)
def _broadcast(func, args, kwargs):
    """dist.broadcast of quantized tensors: each buffer's bytes from the source rank."""
    a = bind(func, args, kwargs)
    rest = (a["process_group"], a["root_rank"], a["root_tensor"], False, a["timeout"])
    return _buffer_by_buffer(func, a["tensors"], [], lambda outs, ins: func(outs, *rest))
