"""Float8 with one fp32 scale per block: row-wise (1 x K), 1 x 128 and 128 x 128 (docs/numerics.md,
Float8 with block scales).

Each copy is quantized in its GEMM's orientation: the rowwise copy is `x` itself, the columnwise one
`xᵀ` (stored as such, reduction dimension last), and the block shape `(block_rows, block_cols)`
applies to the copy as stored. So a 1 x 128 activation's columnwise copy holds blocks of 128 of its
tokens, a row-wise tensor's columnwise copy one scale per column, and a 128 x 128 weight's two copies
the same blocks, one the transpose of the other.
"""

import torch

from ..core.numerics import (
    FP8_DTYPES,
    ceil_div,
    check_fp8_dtype,
    current_scale,
    exact_quotient,
    fp32,
    fp8_max,
    quantize_per_tensor,
    reduce_amax,
    sharded_quantization,
)
from ..core.kernels import lookup
from ..core.quantizer import Quantizer
from ..core.storage import UNDECLARED, Buffer, FP8BlockOperand, Storage
from ..core.tensor import QuantizedTensor
from .float8_groups import CastsGroups

BLOCK_ROWS = (1, 128)
BLOCK_COLS = (128, None)  # None: the whole row


# ---- numerics ------------------------------------------------------------------------------------
def _blocks(y: torch.Tensor, block_rows: int, block_cols: int | None) -> torch.Tensor:
    """fp32 `y` [R, C] zero-padded to whole blocks and viewed as [R/br, br, C/bc, bc]."""
    rows, cols = y.shape
    # A whole-row block is one block per row, even an empty one (one scale per row, as the layout says).
    column_blocks, width = (ceil_div(cols, block_cols), block_cols) if block_cols else (1, cols)
    padded_rows, padded_cols = ceil_div(rows, block_rows) * block_rows, column_blocks * width
    if (padded_rows, padded_cols) != (rows, cols):
        y = torch.nn.functional.pad(y, (0, padded_cols - cols, 0, padded_rows - rows))
    return y.reshape(padded_rows // block_rows, block_rows, column_blocks, width)


def block_amax(y: torch.Tensor, block_rows: int, block_cols: int | None) -> torch.Tensor:
    """[ceil(R/br), ceil(C/bc)] largest finite |value| of each block of fp32 `y` (0 for a block with
    none): NaN and ±Inf elements do not set the scale."""
    blocks = _blocks(y, block_rows, block_cols).abs()
    blocks = torch.where(torch.isfinite(blocks), blocks, 0.0)
    return blocks.amax(dim=(1, 3)) if blocks.numel() else blocks.new_zeros(blocks.shape[0], blocks.shape[2])


def times_blocks(y: torch.Tensor, per_block: torch.Tensor, block_rows: int, block_cols: int | None) -> torch.Tensor:
    """fp32 `y` [R, C] times its block's factor, as a product over a block view (never an
    element-wise expansion of the factors), cut back to [R, C]."""
    rows, cols = y.shape
    blocks = _blocks(y, block_rows, block_cols) * per_block[:, None, :, None]
    return blocks.reshape(blocks.shape[0] * blocks.shape[1], blocks.shape[2] * blocks.shape[3])[:rows, :cols]


def quantize_blocks(y: torch.Tensor, fp8_dtype, block_rows, block_cols, pow2_scales, amax_epsilon, amax=None):
    """fp32 `y` [R, C] → (fp8 codes [R, C], fp32 scale_inv per block). `amax`: the blocks' amaxes
    where they were computed (or reduced over ranks) before."""
    if amax is None:
        amax = block_amax(y, block_rows, block_cols)
    scale = current_scale(amax, fp8_max(fp8_dtype), amax_epsilon, pow2_scales)
    codes = quantize_per_tensor(times_blocks(y, scale, block_rows, block_cols), fp32(1.0, y.device), fp8_dtype)
    return codes.contiguous(), exact_quotient(1.0, scale)


def dequantize_blocks(data: torch.Tensor, scale_inv: torch.Tensor, block_rows: int, block_cols: int | None) -> torch.Tensor:
    return times_blocks(data.float(), scale_inv, block_rows, block_cols).contiguous()


class Float8BlockStorage(Storage):
    """One copy in its GEMM's orientation: rowwise `data` [rows, cols], columnwise the transpose
    [cols, rows]; `scale_inv` fp32, one per block of the copy as stored: [ceil(R'/block_rows),
    ceil(C'/block_cols)] for a stored [R', C'] (one column when `block_cols` is None)."""

    format_name = "float8_block"
    option_values = {"fp8_dtype": FP8_DTYPES, "block_rows": BLOCK_ROWS, "block_cols": BLOCK_COLS}

    @classmethod
    def layout(cls, direction, rows, cols, fp8_dtype, block_rows, block_cols):
        stored_rows, stored_cols = (rows, cols) if direction == "rowwise" else (cols, rows)
        scale_shape = (ceil_div(stored_rows, block_rows), ceil_div(stored_cols, block_cols) if block_cols else 1)
        if direction == "rowwise":
            data = Buffer("data", fp8_dtype, (rows, cols), row_axis=0, col_axis=1)
            # A whole-row scale cannot be split along the columns: each piece would need the whole
            # row's amax (the layout declares no column axis, so such a split is refused).
            scales = Buffer("scale_inv", torch.float32, scale_shape, row_axis=0, rows_per_entry=block_rows,
                            col_axis=1 if block_cols else UNDECLARED, cols_per_entry=block_cols or 1)
        else:
            data = Buffer("data", fp8_dtype, (cols, rows), row_axis=1, col_axis=0)
            # Stored transposed: the tensor's rows run along the scales' second axis. A whole-row
            # scale of the transpose covers every row of the tensor: every row slice shares it.
            scales = Buffer("scale_inv", torch.float32, scale_shape, row_axis=1 if block_cols else None,
                            rows_per_entry=block_cols or 1, col_axis=0, cols_per_entry=block_rows)
        return (data, scales)

    @property
    def rebuilds_other_direction(self) -> bool:
        # Square blocks: the other copy is the same blocks transposed (the amax of a block does not
        # depend on its orientation), so it is rebuilt exactly from this one.
        return self.block_rows == self.block_cols

    def fp8_block_operand(self) -> FP8BlockOperand:
        # Either copy is stored with its GEMM's reduction dimension last.
        return FP8BlockOperand(self.data, self.scale_inv, self.block_rows, self.block_cols)

    def dequantize(self) -> torch.Tensor:
        values = dequantize_blocks(self.data, self.scale_inv, self.block_rows, self.block_cols)
        return values if self.direction == "rowwise" else values.t()

    def to_direction(self, direction: str) -> "Float8BlockStorage | None":
        if direction == self.direction:
            return self
        if not self.rebuilds_other_direction:
            return None
        return type(self)(
            direction=direction, rows=self.rows, cols=self.cols, fp8_dtype=self.fp8_dtype, block_rows=self.block_rows,
            block_cols=self.block_cols, data=self.data.t().contiguous(), scale_inv=self.scale_inv.t().contiguous(),
        )


class Float8BlockTensor(QuantizedTensor):
    """A tensor stored as FP8 codes with one fp32 scale per block (row-wise, 1 x 128 or 128 x 128)."""


class Float8BlockQuantizer(CastsGroups, Quantizer):
    """FP8 with block scales. `block_cols=None` scales each row of a copy as one block (row-wise,
    `block_rows=1`); `block_rows, block_cols` of `1, 128` or `128, 128` give DeepSeek-V3's blocks.
    `pow2_scales` rounds every scale down to a power of two; `amax_epsilon` floors each block's amax."""

    format_name = "float8_block"
    tensor_class = Float8BlockTensor

    def __init__(
        self,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        block_rows: int = 1,
        block_cols: int | None = 128,
        pow2_scales: bool = False,
        amax_epsilon: float = 0.0,
    ):
        check_fp8_dtype(fp8_dtype, "Float8BlockQuantizer")
        if type(block_rows) is not int or block_rows not in BLOCK_ROWS:
            raise ValueError(f"Float8BlockQuantizer: block_rows must be 1 or 128, got {block_rows!r}.")
        if block_cols is not None and (type(block_cols) is not int or block_cols not in BLOCK_COLS):
            raise ValueError(f"Float8BlockQuantizer: block_cols must be 128 or None (the whole row), got {block_cols!r}.")
        if block_cols is None and block_rows != 1:
            raise ValueError("Float8BlockQuantizer: row-wise scaling (block_cols=None) takes block_rows=1.")
        if not isinstance(pow2_scales, bool):
            raise ValueError(f"Float8BlockQuantizer: pow2_scales must be True or False, got {pow2_scales!r}.")
        if not isinstance(amax_epsilon, (int, float)) or isinstance(amax_epsilon, bool) or amax_epsilon < 0:
            raise ValueError(f"Float8BlockQuantizer: amax_epsilon must be a number >= 0, got {amax_epsilon!r}.")
        self.fp8_dtype = fp8_dtype
        self.block_rows = block_rows
        self.block_cols = block_cols
        self.pow2_scales = pow2_scales
        self.amax_epsilon = amax_epsilon

    def grouped_scaling(self) -> str | None:
        return "row" if self.block_cols is None else None

    def group_scale_rule(self, amax: torch.Tensor):
        # A scale per column of each group: a columnwise copy's row scales.
        return amax, self.amax_epsilon, self.pow2_scales

    def _copy(self, direction: str, x: torch.Tensor) -> Float8BlockStorage:
        y = x if direction == "rowwise" else x.t()
        amax = block_amax(y, self.block_rows, self.block_cols)
        if direction == "columnwise" and self.block_cols is None and sharded_quantization():
            # A shard of the tensor's rows: each column's scale is the whole column's, over the ranks.
            amax = reduce_amax(amax)
        data, scale_inv = quantize_blocks(y, self.fp8_dtype, self.block_rows, self.block_cols, self.pow2_scales, self.amax_epsilon, amax)
        return Float8BlockStorage(
            direction=direction, rows=x.shape[0], cols=x.shape[1], fp8_dtype=self.fp8_dtype,
            block_rows=self.block_rows, block_cols=self.block_cols, data=data, scale_inv=scale_inv,
        )

    def _quantize_2d(self, x, rowwise, columnwise, *, update_state=True):
        kernel = lookup("float8_block.cast", x)
        if kernel is not None and x.numel():  # both copies from one read of each tile
            reduce = reduce_amax if sharded_quantization() else None
            row, col = kernel(x, self.fp8_dtype, self.block_rows, self.block_cols, self.pow2_scales, self.amax_epsilon, rowwise, columnwise, reduce)
            storage = lambda direction, buffers: Float8BlockStorage(
                direction=direction, rows=x.shape[0], cols=x.shape[1], fp8_dtype=self.fp8_dtype, block_rows=self.block_rows,
                block_cols=self.block_cols, data=buffers[0], scale_inv=buffers[1],
            )
            return (storage("rowwise", row) if rowwise else None), (storage("columnwise", col) if columnwise else None)
        # docs/numerics.md: each copy from the input, in its own orientation (square blocks give the
        # same codes either way, so the columnwise copy is then the rowwise one transposed).
        x = x.float()
        rowwise_storage = self._copy("rowwise", x) if rowwise or (columnwise and self.block_rows == self.block_cols) else None
        if columnwise:
            columnwise_storage = rowwise_storage.to_direction("columnwise") if self.block_rows == self.block_cols else self._copy("columnwise", x)
        else:
            columnwise_storage = None
        return (rowwise_storage if rowwise else None), columnwise_storage
