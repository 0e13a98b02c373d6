"""Hybrid: a rowwise copy in one format and a columnwise copy in another (docs/numerics.md, Hybrid)."""

from ..core.kernels import lookup
from ..core.numerics import cast_saturating, check_choice
from ..core.quantizer import Quantizer
from ..core.tensor import QuantizedTensor
from .mxfp8 import MXFP8Quantizer
from .nvfp4 import NVFP4Quantizer


class HybridQuantizedTensor(QuantizedTensor):
    """Two storages of possibly different formats; `rowwise` and `columnwise` are the children's."""

    def _rebuild_direction(self, direction: str):
        raise ValueError(
            f"HybridQuantizedTensor cannot rebuild its {direction} copy: it comes from the "
            f"{direction} child quantizer ({getattr(self.quantizer, direction)!r}). Quantize the "
            f"high-precision tensor again with {direction}=True."
        )


class HybridQuantizer(Quantizer):
    """`rowwise` quantizes the rowwise copy, `columnwise` the columnwise copy, from the input
    (`columnwise_source="original"`) or from the dequantized rowwise result (`"rowwise_dequantized"`)."""

    format_name = "hybrid"
    tensor_class = HybridQuantizedTensor

    def __init__(self, rowwise: Quantizer, columnwise: Quantizer, columnwise_source: str = "original"):
        for direction, child in (("rowwise", rowwise), ("columnwise", columnwise)):
            if not isinstance(child, Quantizer) or isinstance(child, HybridQuantizer):
                raise ValueError(
                    f"HybridQuantizer: {direction} must be a non-hybrid qtensor quantizer, got {child!r}."
                )
        if rowwise is columnwise:
            raise ValueError(
                "HybridQuantizer: the same quantizer instance was given for rowwise and columnwise; "
                "each direction needs its own (delayed scaling keeps per-instance state). "
                "Pass columnwise=rowwise.copy()."
            )
        check_choice(columnwise_source, ("original", "rowwise_dequantized"), "columnwise_source", "HybridQuantizer")
        self.rowwise = rowwise
        self.columnwise = columnwise
        self.columnwise_source = columnwise_source

    def _quantize_2d(self, x, rowwise, columnwise, *, update_state=True):
        if rowwise and columnwise and self._casts_in_one_read():
            kernel = lookup("hybrid.cast", x)
            if kernel is not None:
                return self._cast_in_one_read(kernel, x, update_state)
        from_rowwise = columnwise and self.columnwise_source == "rowwise_dequantized"
        rowwise_storage = columnwise_storage = None
        if rowwise or from_rowwise:
            rowwise_storage, _ = self.rowwise._quantize_2d(x, True, False, update_state=update_state)
        if columnwise:
            source = cast_saturating(rowwise_storage.dequantize(), x.dtype) if from_rowwise else x
            _, columnwise_storage = self.columnwise._quantize_2d(source, False, True, update_state=update_state)
        return (rowwise_storage if rowwise else None), columnwise_storage

    def _casts_in_one_read(self) -> bool:
        """MXFP8 rowwise and NVFP4 columnwise from the input: one kernel writes both (hybrid.cast)."""
        return isinstance(self.rowwise, MXFP8Quantizer) and isinstance(self.columnwise, NVFP4Quantizer) and self.columnwise_source == "original"

    def _cast_in_one_read(self, kernel, x, update_state):
        # Bit for bit the two children's casts: the same amax, and the keys the NVFP4 child draws.
        mx, nv = self.rowwise, self.columnwise
        keys = nv._draw_keys(x, update_state)
        _, column_amax = nv._amaxes(x, columnwise=True)
        row, col = kernel(x, mx.fp8_dtype, mx.scale_rounding, column_amax, keys, nv.block_2d, nv.rht)
        return mx._storage("rowwise", x.shape, *row), nv._storage("columnwise", x.shape, *col, column_amax)

    def tensor_amaxes(self, x, rowwise, columnwise):
        # The children's, in the order the cast runs them (the one-read kernel asks the columnwise
        # child for the same). A columnwise copy made from the dequantized rowwise one has amaxes
        # known only after the rowwise cast: not declared, such a cast reduces its own.
        if columnwise and self.columnwise_source == "rowwise_dequantized":
            return None
        amaxes = [self.rowwise.tensor_amaxes(x, True, False) if rowwise else []]
        amaxes.append(self.columnwise.tensor_amaxes(x, False, True) if columnwise else [])
        return None if None in amaxes else amaxes[0] + amaxes[1]

    def casts_reproducibly(self) -> bool:
        return self.rowwise.casts_reproducibly() and self.columnwise.casts_reproducibly()

    def quantizer_for(self, direction: str) -> Quantizer:
        return getattr(self, direction)

    # ---- grouped GEMMs: each direction by its child, where both children cast groups at once
    def group_block_rows(self) -> int | None:
        if self.columnwise_source != "original" or self.rowwise.group_block_rows() is None:
            return None
        return self.columnwise.group_block_rows()

    def reduction_transform(self, direction):
        return getattr(self, direction).reduction_transform(direction)

    def quantize_padded_groups(self, x, groups, rowwise, columnwise, values=(False, False)):
        row = self.rowwise.quantize_padded_groups(x, groups, True, False, values)[0] if rowwise else None
        col = self.columnwise.quantize_padded_groups(x, groups, False, True, values)[1] if columnwise else None
        return row, col

    def move_state(self, device) -> None:
        self.rowwise.move_state(device)
        self.columnwise.move_state(device)

    def _set_state_buffers(self, buffers: dict) -> None:
        for direction in ("rowwise", "columnwise"):
            child = getattr(self, direction)
            child._set_state_buffers({name.partition(".")[2]: b for name, b in buffers.items() if name.startswith(f"{direction}.")})

    def state_buffers(self) -> dict:
        # Each child keeps its own running state (delayed scaling); named by the child's direction.
        return {f"{direction}.{name}": buffer for direction in ("rowwise", "columnwise") for name, buffer in getattr(self, direction).state_buffers().items()}
