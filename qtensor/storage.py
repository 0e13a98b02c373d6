"""Storage: the buffers of one direction of a quantized tensor, and the math to read them back.

A storage is a plain object, not a tensor. It holds the 2-D `[rows, cols]` view of the tensor it
belongs to (leading dimensions folded into rows) and knows its own layout: which buffers it has,
how to dequantize them, and how to cut a range of rows out of them. The tensor subclass adds only
tensor behaviour on top of one or two storages (DESIGN.md §1).
"""

from __future__ import annotations

from typing import Callable

import torch

DIRECTIONS = ("rowwise", "columnwise")

STORAGE_CLASSES: dict[str, type["Storage"]] = {}


class Storage:
    """Base class. Subclasses declare their tensor buffers and plain attributes by name."""

    format_name: str = ""
    tensor_data_names: tuple[str, ...] = ()
    # Buffers that describe the whole tensor (a per-tensor scale), shared by every row slice.
    tensor_wide_names: tuple[str, ...] = ()
    tensor_attribute_names: tuple[str, ...] = ("direction", "rows", "cols")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # Only a class that names its own format is registered: a user subclass never shadows it.
        if "format_name" in cls.__dict__:
            STORAGE_CLASSES[cls.format_name] = cls

    def __init__(self, **fields):
        names = set(self.tensor_data_names) | set(self.tensor_attribute_names)
        if set(fields) != names:
            raise TypeError(f"{type(self).__name__} takes exactly {sorted(names)}, got {sorted(fields)}")
        for name, value in fields.items():
            setattr(self, name, value)

    # ---- what every format implements -------------------------------------------------------
    def dequantize(self) -> torch.Tensor:
        """fp32 values in the `[rows, cols]` orientation, whatever the direction."""
        raise NotImplementedError

    def slice_rows(self, start: int, stop: int) -> "Storage":
        """The storage of rows `[start, stop)` of the 2-D view, sharing memory where it can."""
        raise NotImplementedError

    # ---- generic ------------------------------------------------------------------------------
    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.tensor_data_names}

    @property
    def attributes(self) -> dict:
        return {name: getattr(self, name) for name in self.tensor_attribute_names}

    @property
    def device(self) -> torch.device:
        return next(iter(self.buffers.values())).device

    def map_buffers(self, fn: Callable[[torch.Tensor], torch.Tensor], **attribute_changes) -> "Storage":
        """A new storage of the same kind with `fn` applied to every buffer."""
        fields = {name: fn(buffer) for name, buffer in self.buffers.items()}
        fields.update(self.attributes)
        fields.update(attribute_changes)
        return type(self)(**fields)

    def same_layout(self, other: "Storage") -> bool:
        """True when `other` holds buffers of the same kind, shapes and dtypes (byte-copyable)."""
        if type(self) is not type(other) or self.attributes != other.attributes:
            return False
        return all(
            mine.shape == theirs.shape and mine.dtype == theirs.dtype
            for mine, theirs in zip(self.buffers.values(), other.buffers.values())
        )

    def copy_from(self, other: "Storage") -> None:
        """Byte-for-byte copy of `other`'s buffers into this storage's, in place."""
        for mine, theirs in zip(self.buffers.values(), other.buffers.values()):
            mine.copy_(theirs)

    def is_row_slice(self) -> bool:
        """True when this storage views part of a larger one (a split or slice of a tensor)."""
        data = self.buffers[self.tensor_data_names[0]]
        return data.untyped_storage().nbytes() > data.numel() * data.element_size()

    def to_direction(self, direction: str) -> "Storage | None":
        """This storage re-laid out for the other direction, or None when the format cannot."""
        return self if direction == self.direction else None

    def check_row_split(self, start: int, stop: int, block: int) -> None:
        """DESIGN.md §3: a row range of a block format must start and end on block boundaries."""
        for edge in (start, stop):
            if edge % block and edge != self.rows:
                raise ValueError(
                    f"{self.format_name} {self.direction} blocks span {block} rows; a row range "
                    f"[{start}, {stop}) of a tensor with {self.rows} rows (2-D view "
                    f"[{self.rows}, {self.cols}]) breaks a block. Split at multiples of {block} rows."
                )

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}={tuple(b.shape)}:{str(b.dtype).replace('torch.', '')}" for n, b in self.buffers.items())
        return f"{type(self).__name__}({self.direction}, [{self.rows}, {self.cols}], {shapes})"
