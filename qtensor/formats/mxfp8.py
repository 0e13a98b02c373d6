"""MXFP8: blocks of 32 elements share a power-of-two E8M0 scale (docs/numerics.md, MXFP8)."""

import torch

from ..core.numerics import (
    FP8_DTYPES,
    block_amax,
    ceil_div,
    check_choice,
    check_fp8_dtype,
    exact_pow2,
    fp32,
    fp8_max,
    pad_to_multiple,
    to_fp8_saturating,
)
from ..core.groups import GroupedCopy
from ..core.kernels import lookup
from ..core.quantizer import Quantizer
from ..core.storage import BlockScaledOperand, Buffer, Storage
from ..core.tensor import QuantizedTensor

BLOCK_SIZE = 32
E8M0_NAN = 255
# OCP MX v1.0: the largest power of two an element format holds, log2 (E4M3: 2**8, E5M2: 2**15).
ELEMENT_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}


# ---- numerics ------------------------------------------------------------------------------------
def e8m0_codes(amax: torch.Tensor, fp8_dtype: torch.dtype, scale_rounding: str) -> torch.Tensor:
    """Biased E8M0 scale code (value 2**(code-127), 255 = NaN) for each block amax."""
    if scale_rounding == "rceil":
        # Round amax/fp8_max up to a power of two, so no element of the block saturates.
        ratio = amax * fp32(1.0 / fp8_max(fp8_dtype), amax.device)
        bits = ratio.view(torch.int32)
        codes = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
        codes = torch.where(ratio <= fp32(2.0**-127, amax.device), 0, codes.clamp(max=254))
        finite = torch.isfinite(ratio)
    else:
        # floor(log2(amax)): frexp gives amax = m * 2**e with m in [0.5, 1).
        _, exponent = torch.frexp(amax)
        codes = (exponent - 1 - ELEMENT_EMAX[fp8_dtype] + 127).clamp(0, 254)
        codes = torch.where(amax == 0, 0, codes)
        finite = torch.isfinite(amax)
    return torch.where(finite, codes, E8M0_NAN).to(torch.uint8)


def decode_scales(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of E8M0 codes: 2**(code-127), NaN for 255."""
    codes = codes.int()
    values = exact_pow2(codes.clamp(max=254) - 127)
    return torch.where(codes == E8M0_NAN, float("nan"), values)


def times_block_scales(values: torch.Tensor, scales: torch.Tensor, along_rows: bool) -> torch.Tensor:
    """fp32 `values` [R, C] times the scale of each one's block of 32: blocks along the rows (scales
    [R, ceil(C/32)]) or down the columns (scales [ceil(R/32), C]); partial blocks as zero-padded.

    The scales multiply a [.., blocks, 32, ..] view of the values, never an element-wise expansion:
    an expansion indexes the scales by `column // 32`, and torch 2.13's inductor on the CPU fails
    (AssertionError in CppScheduling.try_loop_split) when it fuses such a kernel with one over the
    same elements in transposed order, as a backward does with a gradient's two copies. Plain torch:
        a, s, b = torch.randn(16, 128), torch.randn(16, 4), torch.randn(128, 1)
        torch.compile(lambda a, s, b: (a * s.repeat_interleave(32, 1), a.t() * b))(a, s, b)
    (docs/compile.md). Each product is the same fp32 product of the same two values."""
    rows, cols = values.shape
    if along_rows:
        blocks = pad_to_multiple(values, BLOCK_SIZE, dim=1).reshape(rows, scales.shape[1], BLOCK_SIZE)
        return (blocks * scales[:, :, None]).reshape(rows, scales.shape[1] * BLOCK_SIZE)[:, :cols]
    blocks = pad_to_multiple(values, BLOCK_SIZE, dim=0).reshape(scales.shape[0], BLOCK_SIZE, cols)
    return (blocks * scales[:, None, :]).reshape(scales.shape[0] * BLOCK_SIZE, cols)[:rows]


def quantize_row_blocks(x: torch.Tensor, fp8_dtype: torch.dtype, scale_rounding: str):
    """Blocks of 32 along each row of fp32 `x` [R, C] → (fp8 data [R, C], E8M0 codes [R, ceil(C/32)])."""
    codes = e8m0_codes(block_amax(x, BLOCK_SIZE), fp8_dtype, scale_rounding)
    element_scale = exact_pow2(127 - codes.int().clamp(max=254))
    return to_fp8_saturating(times_block_scales(x, element_scale, along_rows=True), fp8_dtype).contiguous(), codes


def quantize_column_blocks(x: torch.Tensor, fp8_dtype: torch.dtype, scale_rounding: str):
    """Blocks of 32 down each column of fp32 `x` [R, C] → (fp8 data [R, C], E8M0 codes
    [ceil(R/32), C]): quantize_row_blocks of `x.t()`, transposed back, computed in place."""
    rows, cols = x.shape
    blocks = pad_to_multiple(x, BLOCK_SIZE, dim=0).reshape(ceil_div(rows, BLOCK_SIZE), BLOCK_SIZE, cols)
    amax = blocks.abs().amax(dim=1) if blocks.numel() else x.new_zeros(blocks.shape[0], cols)
    codes = e8m0_codes(amax, fp8_dtype, scale_rounding)
    element_scale = exact_pow2(127 - codes.int().clamp(max=254))
    return to_fp8_saturating(times_block_scales(x, element_scale, along_rows=False), fp8_dtype), codes


def dequantize_row_blocks(data: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    return times_block_scales(data.float(), decode_scales(codes), along_rows=True).contiguous()


def dequantize_column_blocks(data: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """dequantize_row_blocks of `data.t()`, transposed back, computed in place."""
    return times_block_scales(data.float(), decode_scales(codes), along_rows=False)


class MXFP8Storage(Storage):
    """`data` keeps the `[rows, cols]` element order in both directions. `scale_inv` holds E8M0
    codes: rowwise `[rows, ceil(cols/32)]` (blocks along a row), columnwise `[ceil(rows/32), cols]`
    (blocks down a column)."""

    format_name = "mxfp8"
    option_values = {"fp8_dtype": FP8_DTYPES}

    @classmethod
    def layout(cls, direction, rows, cols, fp8_dtype):
        data = Buffer("data", fp8_dtype, (rows, cols), row_axis=0, col_axis=1)
        if direction == "rowwise":
            scales = Buffer("scale_inv", torch.uint8, (rows, ceil_div(cols, BLOCK_SIZE)), row_axis=0, col_axis=1, cols_per_entry=BLOCK_SIZE)
        else:
            scales = Buffer("scale_inv", torch.uint8, (ceil_div(rows, BLOCK_SIZE), cols), row_axis=0, rows_per_entry=BLOCK_SIZE, col_axis=1)
        return (data, scales)

    def dequantize(self) -> torch.Tensor:
        kernel = lookup("mxfp8.dequantize", self.data)
        if kernel is not None:
            return kernel(self.data, self.scale_inv, self.direction == "rowwise", torch.float32)
        if self.direction == "rowwise":
            return dequantize_row_blocks(self.data, self.scale_inv)
        return dequantize_column_blocks(self.data, self.scale_inv)

    def dequantize_as(self, dtype: torch.dtype) -> torch.Tensor:
        kernel = lookup("mxfp8.dequantize", self.data)
        if kernel is None or dtype != torch.bfloat16:  # fp16 needs the clamp of cast_saturating
            return super().dequantize_as(dtype)
        return kernel(self.data, self.scale_inv, self.direction == "rowwise", dtype)  # the fp32 product, rounded once

    def bf16_operand(self):
        # E4M3/E5M2 codes times a power of two: exact in bf16 at or above 2**-126 (tested).
        values = self.dequantize_as(torch.bfloat16)
        return (values if self.direction == "rowwise" else values.t()), None

    def block_scaled_operand(self):
        # Both directions keep the [rows, cols] element order: the columnwise copy is transposed so
        # that its blocks run along the reduction dimension, which the GEMM reads contiguously.
        data, codes = self.data, self.scale_inv
        if self.direction == "columnwise":
            data, codes = data.t().contiguous(), codes.t().contiguous()
        return BlockScaledOperand(data, codes.view(torch.float8_e8m0fnu), BLOCK_SIZE, data.shape[1])


class MXFP8Tensor(QuantizedTensor):
    """A tensor stored as FP8 codes with one E8M0 scale per 32-element block."""


class MXFP8Quantizer(Quantizer):
    """OCP microscaling FP8. `scale_rounding="rceil"` rounds the block scale up (no saturation);
    `"floor"` is the OCP MX v1.0 rule (may saturate the block's largest elements)."""

    format_name = "mxfp8"
    tensor_class = MXFP8Tensor

    def __init__(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn, scale_rounding: str = "rceil"):
        check_fp8_dtype(fp8_dtype, "MXFP8Quantizer")
        check_choice(scale_rounding, ("rceil", "floor"), "scale_rounding", "MXFP8Quantizer")
        self.fp8_dtype = fp8_dtype
        self.scale_rounding = scale_rounding

    def tensor_amaxes(self, x, rowwise, columnwise):
        return []  # block scales only: a shard's cast needs nothing from the other ranks

    def group_block_rows(self) -> int:
        return BLOCK_SIZE  # E8M0 scales: the values are exact in bf16

    def _cast_rows(self, rows, rowwise, columnwise, values):
        # A copy that the grouped GEMM multiplies at once and nothing keeps comes as its bf16 values
        # alone, written by the cast: no codes are written and then read back by a dequantize pass.
        # The values are the codes', bit for bit (the reference path dequantizes the codes instead).
        kernel = lookup("mxfp8.cast_values", rows)
        if kernel is None or not any(values):
            return super()._cast_rows(rows, rowwise, columnwise, values)
        made = kernel(rows, self.fp8_dtype, self.scale_rounding, rowwise, columnwise, values=values)

        def copy(direction, made):
            if made is None:
                return None
            if isinstance(made, torch.Tensor):  # values, [rows, cols]: the columnwise copy reduces along its rows
                return GroupedCopy(None, values=made if direction == "rowwise" else made.t())
            return GroupedCopy(self._storage(direction, rows.shape, *made))

        return copy("rowwise", made[0]), copy("columnwise", made[1])

    def _storage(self, direction, shape, data, scale_inv) -> "MXFP8Storage":
        return MXFP8Storage(direction=direction, rows=shape[0], cols=shape[1], fp8_dtype=self.fp8_dtype, data=data, scale_inv=scale_inv)

    def _quantize_2d(self, x, rowwise, columnwise, *, update_state=True):
        # docs/numerics.md, MXFP8: both directions come from the high-precision input, never one from the other.
        kernel = lookup("mxfp8.cast", x)
        if kernel is not None:  # both directions from one read of each tile
            row, col = kernel(x, self.fp8_dtype, self.scale_rounding, rowwise, columnwise)
            return (self._storage("rowwise", x.shape, *row) if rowwise else None, self._storage("columnwise", x.shape, *col) if columnwise else None)
        x = x.float()
        rowwise_storage = columnwise_storage = None
        if rowwise:
            rowwise_storage = self._storage("rowwise", x.shape, *quantize_row_blocks(x, self.fp8_dtype, self.scale_rounding))
        if columnwise:
            columnwise_storage = self._storage("columnwise", x.shape, *quantize_column_blocks(x, self.fp8_dtype, self.scale_rounding))
        return rowwise_storage, columnwise_storage
