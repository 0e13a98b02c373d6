"""Storage: the buffers of one direction of a quantized tensor, and the contract that describes them.

A storage is a plain object, not a tensor. It holds the 2-D `[rows, cols]` view of the tensor it
belongs to (leading dimensions folded into rows) and its format's options. Each storage class
declares its buffers once, in `layout()`: for every buffer its name, dtype, shape, and the axis
along which it follows the tensor's rows (or that it is tensor-wide: one value for all rows).
Slicing rows, concatenating row pieces back, validating incoming buffers, pickling, safetensors and
`__tensor_flatten__` all derive from that one declaration; a format writes only its numerics
(`dequantize`, and `to_direction` where it can rebuild the other direction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .numerics import cast_saturating, ceil_div, exact_quotient, scale_from_amax

DIRECTIONS = ("rowwise", "columnwise")

STORAGE_CLASSES: dict[str, type["Storage"]] = {}


def holds_storages(tensor) -> bool:
    """True for a quantized tensor: one whose values live in direction storages."""
    return isinstance(getattr(tensor, "rowwise", None), Storage) or isinstance(getattr(tensor, "columnwise", None), Storage)


UNDECLARED = "undeclared"  # a Buffer's col_axis no layout gave


@dataclass(frozen=True)
class Buffer:
    """One buffer of a storage as its layout declares it.

    `row_axis` is the axis along which the buffer follows the rows of the tensor's 2-D view, and
    `rows_per_entry` how many of those rows one index along it covers (32 for MXFP8 columnwise
    scales, 2 for NVFP4 columnwise bytes). `rows_padded_to` > 1 means the buffer covers the rows
    zero-padded to that multiple (NVFP4 columnwise with the Hadamard transform). `row_axis=None`
    marks a tensor-wide buffer: one value for all rows (Float8's `scale_inv`, NVFP4's `global_amax`),
    shared by every row slice.

    `col_axis` and `cols_per_entry` say the same of the columns (32 for MXFP8 rowwise scales, 2 for
    NVFP4 rowwise bytes); `col_axis=None` marks a buffer every column slice shares (a tensor-wide
    one, or one scale per row for all of its columns). A layout that leaves it `UNDECLARED` cannot
    be split along its columns (tensor parallelism's row-parallel weights are).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    row_axis: int | None = 0
    rows_per_entry: int = 1
    rows_padded_to: int = 1
    col_axis: int | None | str = "undeclared"
    cols_per_entry: int = 1

    @property
    def tensor_wide(self) -> bool:
        return self.row_axis is None

    @property
    def follows_columns(self) -> bool:
        return self.col_axis is not None and self.col_axis != UNDECLARED

    def entries(self, rows: int) -> int:
        """How many indices along the row axis `rows` rows occupy."""
        padded = ceil_div(rows, self.rows_padded_to) * self.rows_padded_to
        return ceil_div(padded, self.rows_per_entry)


def _cached(cache: dict, key: tuple, compute: Callable):
    """`compute()`, kept in `cache` under `key` (a layout depends on its arguments alone). Not kept
    where the key cannot be hashed: an unhashable option value (the checks that follow refuse it), a
    symbolic size under torch.compile. The cache is emptied when it grows past _CACHE_ENTRIES."""
    try:
        return cache[key]
    except KeyError:
        pass
    except TypeError:
        return compute()
    if len(cache) >= _CACHE_ENTRIES:
        cache.clear()
    value = cache[key] = compute()
    return value


_CACHE_ENTRIES = 4096
# Caches of layouts (buffers by name), by (class, direction, rows, cols, options); of buffer names and of the keyword
# fields a storage takes, by (class, direction, options in option_names() order). A race between
# threads computes one entry twice, equally.
_LAYOUTS: dict[tuple, tuple] = {}
_BUFFER_NAMES: dict[tuple, tuple[str, ...]] = {}
_FIELDS: dict[tuple, tuple] = {}


def _layout(cls, direction: str, rows: int, cols: int, options: dict) -> dict:
    """`cls.layout(direction, rows, cols, **options)` by buffer name, computed once per combination."""
    key = (cls, direction, rows, cols, tuple(options.items()))
    return _cached(_LAYOUTS, key, lambda: {spec.name: spec for spec in cls.layout(direction, rows, cols, **options)})


def _buffer_names(cls, direction: str, options: tuple) -> tuple[str, ...]:
    """The names of a storage's buffers, in layout order (they depend on the direction and the
    options, never on the size)."""
    compute = lambda: tuple(b.name for b in cls.layout(direction, 1, 1, **dict(zip(cls.option_names(), options))))
    return _cached(_BUFFER_NAMES, (cls, direction, options), compute)


def _fields(cls, direction: str, options: tuple) -> tuple[tuple[str, ...], frozenset]:
    """(buffer names, every keyword field a storage takes: its options and buffers)."""
    names = lambda: _buffer_names(cls, direction, options)
    return _cached(_FIELDS, (cls, direction, options), lambda: (names(), frozenset(cls.option_names()).union(names())))


@dataclass(frozen=True)
class TensorScale:
    """The fp32 factor that multiplies a GEMM's fp32 result for one operand (`Storage.bf16_operand`,
    `Storage.block_scaled_operand`): `tensor` itself (a 0-d fp32 scale_inv), or, given `amax_max`, the
    inverse of the encode scale `scale_from_amax(tensor, amax_max)` of the global amax `tensor`
    (NVFP4's 1/S_enc), left for the GEMM's epilogue kernel to compute where it applies it."""

    tensor: torch.Tensor
    amax_max: float | None = None

    def value(self) -> torch.Tensor:
        """The factor as a 0-d fp32 tensor (the reference computation)."""
        if self.amax_max is None:
            return self.tensor
        return exact_quotient(1.0, scale_from_amax(self.tensor, self.amax_max))


@dataclass(frozen=True)
class FP8TensorwiseOperand:
    """A storage as an operand of an FP8 GEMM with one scale per tensor (`torch._scaled_mm`):
    `data` FP8 codes [R, K] with the reduction dimension contiguous, `scale_inv` the 0-d fp32
    factor their products take."""

    data: torch.Tensor
    scale_inv: torch.Tensor


@dataclass(frozen=True)
class FP8BlockOperand:
    """A storage as an operand of an FP8 GEMM with fp32 scales per block (`torch._scaled_mm`'s
    row-wise scaling, and Hopper's 1x128 / 128x128 block scaling): `data` FP8 codes [R, K] with the
    reduction dimension contiguous, `scale_inv` [ceil(R/block_rows), ceil(K/block_cols)] row-major
    ([R, 1] for row-wise, `block_cols` None), the factors its products take."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block_rows: int
    block_cols: int | None


@dataclass(frozen=True)
class BlockScaledOperand:
    """A storage as an operand of a GEMM that reads block scales in the tensor cores: `data` [R, K]
    (or [R, K/2] in a two-element dtype) with the reduction dimension contiguous, `scales` [R,
    ceil(K/block_size)] one per `block_size` elements along it, in their own dtype and row-major
    (the GEMM backend puts them in its tiled layout), `length` K, and the TensorScale that
    multiplies the GEMM's fp32 result, or None."""

    data: torch.Tensor
    scales: torch.Tensor
    block_size: int
    length: int
    tensor_scale: TensorScale | None = None


class Storage:
    """Base class. A subclass sets `format_name`, `directions` and `option_values` (each format
    option besides direction and size, e.g. `fp8_dtype`, with the values it may take) and implements
    `layout`, `dequantize` and, where it can, `to_direction`."""

    format_name: str = ""
    directions: tuple[str, ...] = DIRECTIONS
    option_values: dict[str, tuple] = {}
    # Options a format gained after files were written, each with the value those files' layout had:
    # a file's storage description without one takes it (plan.py).
    options_added: dict[str, object] = {}
    # True when `to_direction` rebuilds the other direction exactly (Float8: the transpose), so
    # FSDP2 gathers one direction and makes the other locally. A format where that depends on its
    # options makes it a property.
    rebuilds_other_direction: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # Only a class that names its own format is registered: a user subclass never shadows it.
        if "format_name" in cls.__dict__:
            STORAGE_CLASSES[cls.format_name] = cls

    def __init__(self, *, direction: str, rows: int, cols: int, row_slice: bool = False, **fields):
        self.direction, self.rows, self.cols = direction, rows, cols
        # True for a storage made by slicing rows (or columns) out of a larger one: its tensor-wide
        # buffers cover values it does not hold, so nothing may requantize them (ops.copy_ refuses).
        self.row_slice = row_slice
        buffer_names, expected = _fields(type(self), direction, tuple(fields.get(name) for name in self.option_names()))
        if fields.keys() != expected:
            raise TypeError(f"{type(self).__name__} takes {sorted(expected)}, got {sorted(fields)}")
        self.__dict__.update(fields)
        self._first_buffer = buffer_names[0]

    # ---- what every format declares and implements -------------------------------------------
    @classmethod
    def layout(cls, direction: str, rows: int, cols: int, **options) -> tuple[Buffer, ...]:
        """The buffers of a storage of this format for a `[rows, cols]` view, in a fixed order."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """fp32 values in the `[rows, cols]` orientation, whatever the direction."""
        raise NotImplementedError

    def dequantize_as(self, dtype: torch.dtype) -> torch.Tensor:
        """`dequantize()` rounded once to `dtype`, finite values kept finite (a format with a kernel
        that writes `dtype` directly overrides this)."""
        return cast_saturating(self.dequantize(), dtype)

    def bf16_operand(self) -> "tuple[torch.Tensor, TensorScale | None] | None":
        """This storage as an operand of a GEMM on the bf16 tensor cores, where bf16 holds its values
        exactly: (bf16 values with the reduction dimension last, the TensorScale that multiplies
        the GEMM's fp32 result, or None); None for a format without such a form."""
        return None

    def fp8_tensorwise_operand(self) -> "FP8TensorwiseOperand | None":
        """This storage as an operand of an FP8 GEMM with one scale per tensor, or None for a format
        without such a form. Asked for even where the device has no FP8 GEMM (gemm.py: an exclusive
        backend), so it must be cheap: the stored buffers, never a copy."""
        return None

    def fp8_block_operand(self) -> "FP8BlockOperand | None":
        """This storage as an operand of an FP8 GEMM with fp32 scales per row or block, or None for a
        format without such a form. Cheap, as `fp8_tensorwise_operand` (an exclusive backend)."""
        return None

    def block_scaled_operand(self) -> "BlockScaledOperand | None":
        """This storage as an operand of a block-scaled GEMM (Blackwell's tensor cores), or None for
        a format, or a copy, without such a form."""
        return None

    def reduction_transform(self) -> str | None:
        """The name of the transform this storage's values carry along its GEMMs' reduction
        dimension, or None for the tensor's own values. Every GEMM operand form holds the stored
        values, so a fast GEMM multiplies two storages only under the same transform (an orthogonal
        one cancels in the product)."""
        return None

    def oriented(self, direction: str) -> "Storage":
        """This storage as the `direction` operand of a GEMM. A storage that serves both directions
        (Identity) gives an object whose operand forms have that direction's reduction dimension
        last; any other storage is already one direction's and gives itself."""
        return self

    def to_direction(self, direction: str) -> "Storage | None":
        """This storage re-laid out for the other direction, or None when the format cannot."""
        return self if direction == self.direction else None

    def write_direction_into(self, target: "Storage") -> None:
        """This storage re-laid out for `target`'s direction, written into its buffers (versions kept)."""
        rebuilt = self.to_direction(target.direction).buffers
        for name, buffer in target.buffers.items():
            with torch.autograd._unsafe_preserve_version_counter(buffer):  # FSDP2 refills saved buffers
                buffer.copy_(rebuilt[name])

    # ---- derived from the layout --------------------------------------------------------------
    @classmethod
    def empty_buffers(cls, names, direction: str, rows: int, cols: int, device, **options) -> tuple[torch.Tensor, ...]:
        """Uninitialised buffers `names` (in that order) of the layout of a `[rows, cols]` view, on
        `device`: what a kernel writes, and, under a fake tensor mode, what its compiled fake returns."""
        specs = _layout(cls, direction, rows, cols, options)
        return tuple(torch.empty(specs[name].shape, dtype=specs[name].dtype, device=device) for name in names)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(cls.option_values)

    @classmethod
    def check_options(cls, direction, options: dict, where: str) -> None:
        """ValueError unless `direction` and `options` are ones this format declares."""
        if direction not in cls.directions:
            raise ValueError(f"{where}: a {cls.format_name} storage has direction {cls.directions}, got {direction!r}.")
        if set(options) != set(cls.option_values):
            raise ValueError(f"{where}: a {cls.format_name} storage has options {sorted(cls.option_values)}, got {sorted(options)}.")
        for name, value in options.items():
            # `is`: True must not pass for 1, nor a dtype for its name.
            if not any(value is allowed for allowed in cls.option_values[name]):
                raise ValueError(f"{where}.{name}: {value!r} is not one of {list(cls.option_values[name])}.")

    @property
    def options(self) -> dict:
        return {name: getattr(self, name) for name in self.option_names()}

    def buffer_specs(self) -> tuple[Buffer, ...]:
        return tuple(_layout(type(self), self.direction, self.rows, self.cols, self.options).values())

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        return {spec.name: getattr(self, spec.name) for spec in self.buffer_specs()}

    @property
    def device(self) -> torch.device:
        return getattr(self, self._first_buffer).device

    def rebuilt(self, buffers: dict[str, torch.Tensor], *, rows: int | None = None, cols: int | None = None, row_slice: bool = False) -> "Storage":
        """A storage of this kind, direction and options over other buffers (and row or column count)."""
        return type(self)(
            direction=self.direction, rows=self.rows if rows is None else rows, cols=self.cols if cols is None else cols,
            row_slice=row_slice,
            **self.options,
            **buffers,
        )

    def map_buffers(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Storage":
        """A new storage of the same kind with `fn` applied to every buffer (no longer a slice:
        `fn` makes new tensors, or keeps these when it returns them, slice flag included)."""
        mapped = {name: fn(buffer) for name, buffer in self.buffers.items()}
        same = all(mapped[name] is buffer for name, buffer in self.buffers.items())
        return self.rebuilt(mapped, row_slice=self.row_slice and same)

    def ends_mid_block(self) -> bool:
        """True for a row slice whose last block continues past its rows (see slice_rows)."""
        return self.row_slice and self.rows % self.row_block() != 0

    def row_block(self) -> int:
        """Row ranges must start and end on multiples of this (docs/design.md, Dispatch)."""
        return max([max(b.rows_per_entry, b.rows_padded_to) for b in self.buffer_specs() if not b.tensor_wide] or [1])

    def slice_rows(self, start: int, stop: int) -> "Storage":
        """The storage of rows `[start, stop)` of the 2-D view, sharing memory with this one.

        It must start on a block boundary (docs/design.md, Dispatch). It may end inside a block: that last
        block is then partial, its scale shared with the rows after `stop`, and every value it
        holds exact (ops.copy_ refuses to requantize such a slice, which would change those rows).
        A split still needs every edge on a boundary, since the next piece starts there.
        """
        self._check_edges("rows", start, stop, (start,))
        pieces = {}
        for spec in self.buffer_specs():
            buffer = getattr(self, spec.name)
            if spec.tensor_wide:
                pieces[spec.name] = buffer
            else:
                first, last = spec.entries(start), spec.entries(stop)
                pieces[spec.name] = buffer.narrow(spec.row_axis, first, last - first)
        whole = start == 0 and stop == self.rows
        piece = self.rebuilt(pieces, rows=stop - start, row_slice=self.row_slice or not whole)
        if not whole:
            piece.slice_of = (self, start, stop)  # what ops.copy_ checks before requantizing it
        return piece

    def _check_edges(self, lines: str, start: int, stop: int, edges: tuple[int, ...]) -> None:
        """ValueError unless each of `edges` of the range [start, stop) of `lines` ("rows" or
        "columns") falls on a block boundary or at the end."""
        block, count = (self.row_block(), self.rows) if lines == "rows" else (self.col_block(), self.cols)
        for edge in edges:
            if edge % block and edge != count:
                raise ValueError(
                    f"{self.format_name} {self.direction} blocks span {block} {lines}; a {lines[:-1]} range "
                    f"[{start}, {stop}) of a tensor with {count} {lines} (2-D view "
                    f"[{self.rows}, {self.cols}]) breaks a block. Split at multiples of {block} {lines}."
                )

    def col_block(self) -> int:
        """Column ranges must start (and, but at the last column, end) on multiples of this."""
        undeclared = [b.name for b in self.buffer_specs() if b.col_axis == UNDECLARED]
        if undeclared:
            raise ValueError(
                f"{self.format_name}: its layout declares no column axis for {undeclared}, so a "
                f"{self.format_name} tensor cannot be split along its columns (declare col_axis in layout())."
            )
        return max([b.cols_per_entry for b in self.buffer_specs() if b.follows_columns] or [1])

    def slice_cols(self, start: int, stop: int) -> "Storage":
        """The storage of columns `[start, stop)` of the 2-D view (sharing memory with this one): what
        a row-parallel weight's shard holds. Both edges must fall on block boundaries (or `stop` on
        the last column); buffers shared by every column are shared by the slice, which, like a row
        slice, then may not requantize them."""
        self._check_edges("columns", start, stop, (start, stop))
        pieces = {}
        for spec in self.buffer_specs():
            buffer = getattr(self, spec.name)
            if not spec.follows_columns:
                pieces[spec.name] = buffer
            else:
                first, last = ceil_div(start, spec.cols_per_entry), ceil_div(stop, spec.cols_per_entry)
                pieces[spec.name] = buffer.narrow(spec.col_axis, first, last - first)
        whole = start == 0 and stop == self.cols
        return self.rebuilt(pieces, cols=stop - start, row_slice=self.row_slice or not whole)

    def rest_is_zero(self) -> bool:
        """For a row slice: every row of what it was cut from, outside it, holds zero (so a new
        scale for the slice changes no other value). False when that is unknown."""
        parent, start, stop = self.__dict__.get("slice_of") or (None, 0, 0)
        if parent is None:
            return False
        values = parent.dequantize()
        outside_zero = bool((values[:start] == 0).all() and (values[stop:] == 0).all())
        return outside_zero and (not parent.row_slice or parent.rest_is_zero())

    def zero_padded(self, rows: int) -> "Storage":
        """This storage extended to `rows` rows with zero codes (zero in every format; a partial
        last block behaves as zero-padded, docs/numerics.md), tensor-wide buffers unchanged."""
        if rows == self.rows:
            return self
        padded = {}
        for spec, target in zip(self.buffer_specs(), self.layout(self.direction, rows, self.cols, **self.options)):
            buffer = getattr(self, spec.name)
            if spec.tensor_wide:
                padded[spec.name] = buffer
            else:
                grown = torch.zeros(target.shape, dtype=buffer.dtype, device=buffer.device)
                grown.narrow(spec.row_axis, 0, buffer.shape[spec.row_axis]).copy_(buffer)
                padded[spec.name] = grown
        return self.rebuilt(padded, rows=rows)

    @classmethod
    def cat_rows(cls, pieces: list["Storage"]) -> "Storage":
        """Row pieces (in order) back into one storage: what an all-gather of row shards produces.

        Every piece but the last must end on a block boundary, and all must hold the same
        tensor-wide buffers (one scale for the whole tensor).
        """
        return cls._joined(pieces, "rows")

    @classmethod
    def cat_cols(cls, pieces: list["Storage"]) -> "Storage":
        """Column pieces (in order) back into one storage: what gathering a row-parallel weight's
        shards produces. Every piece but the last must end on a block boundary, and all must hold
        the same buffers that every column shares."""
        return cls._joined(pieces, "cols")

    @classmethod
    def _joined(cls, pieces: list["Storage"], along: str) -> "Storage":
        first = pieces[0]
        across = "cols" if along == "rows" else "rows"
        block = first.row_block() if along == "rows" else first.col_block()
        for index, piece in enumerate(pieces):
            if type(piece) is not type(first) or (piece.direction, getattr(piece, across), piece.options) != (
                first.direction,
                getattr(first, across),
                first.options,
            ):
                raise ValueError(f"cat_{along}: piece {index} ({piece!r}) is not the same kind of storage as piece 0 ({first!r}).")
            if index < len(pieces) - 1 and getattr(piece, along) % block:
                raise ValueError(
                    f"cat_{along}: piece {index} has {getattr(piece, along)} {along}; every piece but the last must "
                    f"hold a multiple of {block} {along} ({first.format_name} {first.direction} blocks)."
                )
        joined = {}
        for spec in first.buffer_specs():
            buffers = [getattr(piece, spec.name) for piece in pieces]
            axis = spec.row_axis if along == "rows" else (spec.col_axis if spec.follows_columns else None)
            if axis is None:  # one buffer for all the pieces
                if any(b is not buffers[0] and not torch.equal(b, buffers[0]) for b in buffers):
                    raise ValueError(
                        f"cat_{along}: the pieces hold different {spec.name} values; pieces quantized with "
                        "different tensor-wide scales cannot form one tensor. Quantize them with one scale."
                    )
                joined[spec.name] = buffers[0]
            else:
                joined[spec.name] = torch.cat(buffers, dim=axis)
        total = sum(getattr(piece, along) for piece in pieces)
        return first.rebuilt(joined, **{along: total})

    @classmethod
    def check_buffers(cls, buffers: dict[str, torch.Tensor], direction: str, rows: int, cols: int, options: dict, where: str = "") -> None:
        """ValueError naming the buffer unless `buffers` are exactly what the layout declares."""
        specs = cls.layout(direction, rows, cols, **options)
        expected = {spec.name for spec in specs}
        if set(buffers) != expected:
            missing, extra = sorted(expected - set(buffers)), sorted(set(buffers) - expected)
            raise ValueError(
                f"{where or cls.format_name}: a {cls.format_name} {direction} storage holds buffers "
                f"{sorted(expected)}; missing {missing}, unexpected {extra}."
            )
        for spec in specs:
            buffer = buffers[spec.name]
            if buffer.dtype != spec.dtype or tuple(buffer.shape) != spec.shape:
                raise ValueError(
                    f"{where}{spec.name}: expected {spec.dtype} of shape {list(spec.shape)} for a "
                    f"{cls.format_name} {direction} storage of a [{rows}, {cols}] view, got "
                    f"{buffer.dtype} of shape {list(buffer.shape)}."
                )

    def same_layout(self, other: "Storage") -> bool:
        """True when `other` holds buffers of the same kind, shapes and dtypes (byte-copyable)."""
        return type(self) is type(other) and self.describe() == other.describe() and (self.rows, self.cols) == (other.rows, other.cols)

    def describe(self) -> tuple:
        """Hashable description of everything but the buffers and the size: format, direction, options."""
        return (self.format_name, self.direction, tuple(self.options.items()))

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}={tuple(b.shape)}:{str(b.dtype).replace('torch.', '')}" for n, b in self.buffers.items())
        return f"{type(self).__name__}({self.direction}, [{self.rows}, {self.cols}], {shapes})"

