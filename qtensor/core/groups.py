"""The groups of a grouped GEMM (an expert stack's grouped linear, layers/grouped_linear.py) and its
operands as the grouped casts give them: `RowGroups` (the routed rows sorted by expert, or a stack's
experts), `GroupedOperand` (FP8 codes with a factor per row: formats/float8_groups.py) and
`GroupedCopy` (one direction of a block format's copy, each group at its own tensor scale:
`Quantizer.quantize_padded_groups`)."""

from __future__ import annotations

import functools

from typing import NamedTuple

import torch

from .storage import Storage


class RowGroups:
    """Groups of consecutive rows: a grouped GEMM's routed rows (rows sorted by expert), or an expert
    stack's experts. `lengths` holds each group's rows on the host; on the device, `ends` (given),
    `starts` and `device_lengths`, and where a columnwise copy runs each group on to a multiple of
    `align` columns (zero codes after its rows), `padded` lengths and the `bases` of those runs.
    Everything on the device is derived from `ends` there (no copy from the host, no sync), each
    when first asked for: a grouped GEMM's host time is mostly such small launches.

    Made with `lengths` None, the host does not know the groups' sizes: `rows` bounds them (the
    groups lie within the first `rows` rows), and `lengths` is read from the device only where
    something asks for it (a sync: the host waits for the GPU). A path that never asks launches
    everything at once (layers/grouped_linear.py, Float8 on a GPU)."""

    def __init__(self, lengths: tuple[int, ...] | None, ends: torch.Tensor, align: int = 1, bases: torch.Tensor | None = None, rows: int | None = None):
        self.align, self.ends = align, ends
        if lengths is not None:
            self.__dict__["lengths"] = tuple(lengths)
        self.rows = sum(lengths) if lengths is not None else rows
        if bases is not None:
            self.bases = bases
        self._aligned: dict[int, RowGroups] = {align: self}

    @functools.cached_property
    def lengths(self) -> tuple[int, ...]:
        return tuple(int(n) for n in torch.diff(self.ends, prepend=self.ends.new_zeros(1)).tolist())

    @property
    def sized_on_host(self) -> bool:
        """Whether the host knows the groups' sizes (asking for them costs no sync)."""
        return "lengths" in self.__dict__

    def padded_rows(self) -> int:
        """The groups' padded runs together, or where the host does not know the sizes, a bound: a
        whole number of `align`s (a GEMM over the runs reads rows of whole 16-byte lines)."""
        if self.sized_on_host:
            return sum(self.padded)
        return -(-(self.rows + self.ends.shape[0] * (self.align - 1)) // self.align) * self.align

    @functools.cached_property
    def padded(self) -> tuple[int, ...]:
        return self.lengths if self.align == 1 else tuple(-(-n // self.align) * self.align for n in self.lengths)

    @functools.cached_property
    def device_lengths(self) -> torch.Tensor:
        return torch.diff(self.ends, prepend=self.ends.new_zeros(1)).long()

    @functools.cached_property
    def starts(self) -> torch.Tensor:
        return self.ends.long() - self.device_lengths

    @functools.cached_property
    def padded_ends(self) -> torch.Tensor:
        if self.align == 1:
            return self.ends.long()
        return torch.cumsum((self.device_lengths + self.align - 1) // self.align * self.align, 0)

    @functools.cached_property
    def bases(self) -> torch.Tensor:
        """Where each group's padded run starts."""
        return self.padded_ends - (self.device_lengths + self.align - 1) // self.align * self.align

    def aligned(self, align: int) -> RowGroups:
        """These groups with columnwise runs of multiples of `align`, sharing what both derive alike
        (made once per alignment)."""
        if align not in self._aligned:
            other = RowGroups(self.__dict__.get("lengths"), self.ends, align=align, rows=self.rows)
            other.__dict__.update({name: self.__dict__[name] for name in ("device_lengths", "starts") if name in self.__dict__})
            other._aligned = self._aligned
            self._aligned[align] = other
        return self._aligned[align]

    def offsets(self, padded: bool) -> torch.Tensor:
        """int32 group ends on the device, of the rows or of the padded runs: a grouped GEMM's `offs`."""
        ends = self.padded_ends if padded else self.ends
        return ends if ends.dtype == torch.int32 else ends.to(torch.int32)

    def of_rows(self) -> torch.Tensor:
        """The group of every row, on the device (of each of the first `rows` where the host does not
        know the sizes; a row past the last group: the last group)."""
        if not self.sized_on_host:
            rows = torch.arange(self.rows, device=self.ends.device)
            return torch.searchsorted(self.ends.long(), rows, right=True).clamp_(max=self.ends.shape[0] - 1)
        groups = torch.arange(len(self.lengths), device=self.ends.device)
        return torch.repeat_interleave(groups, self.device_lengths, output_size=sum(self.lengths))

    def positions(self) -> torch.Tensor:
        """Where every row lands in the padded runs: its group's base plus its place in the group."""
        return torch.arange(sum(self.lengths), device=self.ends.device) + (self.bases - self.starts)[self.of_rows()]

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` (the groups' rows) with each group followed by zero rows up to its padded length."""
        if self.padded == self.lengths:
            return rows
        out = rows.new_zeros((sum(self.padded), rows.shape[1]))
        out.index_copy_(0, self.positions(), rows)
        return out


class GroupedOperand(NamedTuple):
    """One operand of a grouped GEMM, every group cast at once (`Quantizer.quantize_groups`,
    `quantize_stack`): FP8 codes with the GEMM's reduction dimension last, the fp32 factor that
    dequantizes each row of `data`, and for routed rows their groups, along `data`'s rows, or along
    its columns run on to the groups' `padded` lengths (a columnwise copy)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    groups: RowGroups | None = None
    padded: bool = False

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.groups.padded if self.padded else self.groups.lengths


class GroupedCopy(NamedTuple):
    """One direction of a grouped GEMM's operand in a block format whose values, less a tensor
    scale, bf16 holds exactly (`Quantizer.group_block_rows`), every group cast at once
    (`Quantizer.quantize_padded_groups`, or an expert stack's bytes in place): `storage` over all
    groups' rows (rowwise) or over their rows each run on to whole blocks of zero rows
    (columnwise), and where the format scales each group by its own tensor scale (NVFP4), each
    group's tensor-wide scale buffer [G] (NVFP4's global amax), from which `storage`'s TensorScale
    is made per group (`storage`'s own tensor-wide buffer is then not used)."""

    storage: Storage | None
    group_scales: torch.Tensor | None = None
    # The bf16 operand's values, where the cast wrote them: beside the codes (NVFP4's: its storage
    # then gives the tensor scale, `tensor_scale()`, without a dequantize pass), or instead of
    # them (MXFP8's, no storage: a copy that one GEMM multiplies and nothing keeps needs only them).
    values: torch.Tensor | None = None

    def operand(self):
        """(bf16 values with the reduction dimension last, each group's TensorScale over [G] or None)."""
        if self.values is not None:
            values, scale = self.values, getattr(self.storage, "tensor_scale", lambda: None)()
        else:
            values, scale = self.storage.bf16_operand()
        if scale is None:
            return values, None
        return values, type(scale)(self.group_scales if self.group_scales is not None else scale.tensor.reshape(1), scale.amax_max)
