"""Identity: keeps the high-precision values, one buffer serving both directions (docs/numerics.md, Identity)."""

import torch

from ..core.quantizer import INPUT_DTYPES, Quantizer, autocast_dtype
from ..core.storage import Buffer, Storage
from ..core.tensor import QuantizedTensor


class IdentityStorage(Storage):
    """`data` is the `[rows, cols]` tensor itself (in `dtype`); `direction` is "both": one storage
    serves both directions."""

    format_name = "identity"
    directions = ("both",)
    option_values = {"dtype": INPUT_DTYPES}

    @classmethod
    def layout(cls, direction, rows, cols, dtype):
        return (Buffer("data", dtype, (rows, cols), row_axis=0, col_axis=1),)

    def dequantize(self) -> torch.Tensor:
        return self.data.to(torch.float32, copy=True)  # never an alias of the stored buffer

    def to_direction(self, direction: str) -> "IdentityStorage":
        return self

    def oriented(self, direction: str) -> "IdentityOperand":
        return IdentityOperand(self.data, direction)


class IdentityOperand:
    """An Identity storage as one direction's GEMM operand: bf16 values are their own exact bf16
    operand (the rowwise copy as stored, the columnwise one transposed, reduction dimension last);
    other dtypes, and every other form, have none (the reference multiplies them)."""

    def __init__(self, data: torch.Tensor, direction: str):
        self.data, self.direction = data, direction

    def bf16_operand(self):
        if self.data.dtype != torch.bfloat16:
            return None
        return (self.data if self.direction == "rowwise" else self.data.t()), None

    def reduction_transform(self):
        return None

    def fp8_tensorwise_operand(self):
        return None

    def fp8_block_operand(self):
        return None

    def block_scaled_operand(self):
        return None


class IdentityTensor(QuantizedTensor):
    """A high-precision tensor behind the QuantizedTensor interface (a role left unquantized)."""


class IdentityQuantizer(Quantizer):
    """Stores `x` unchanged, cast to `dtype` when one is given. `dtype="autocast"`: cast to the
    autocast dtype while autocast is on for `x`'s device (as `nn.Linear` casts its operands there),
    else kept in `x`'s dtype: `float8_rowwise_gw_hp`'s high-precision copies, so that its weight
    gradient in a bf16-autocast model is a bf16 GEMM, as the unquantized layer's."""

    format_name = "identity"
    tensor_class = IdentityTensor

    def __init__(self, dtype: torch.dtype | str | None = None):
        if dtype is not None and dtype != "autocast" and dtype not in INPUT_DTYPES:
            raise ValueError(
                f"IdentityQuantizer: dtype must be None, torch.float32, torch.bfloat16, torch.float16 or 'autocast', got {dtype}."
            )
        self.dtype = dtype

    def tensor_amaxes(self, x, rowwise, columnwise):
        return []

    def _quantize_2d(self, x, rowwise, columnwise, *, update_state=True):
        dtype = (autocast_dtype(x) if self.dtype == "autocast" else self.dtype) or x.dtype
        data = x.to(dtype, copy=True).contiguous()
        storage = IdentityStorage(direction="both", rows=x.shape[0], cols=x.shape[1], dtype=data.dtype, data=data)
        return (storage if rowwise else None), (storage if columnwise else None)

