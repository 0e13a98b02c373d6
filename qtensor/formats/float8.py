"""Float8 with one fp32 scale per tensor: current or delayed scaling (docs/numerics.md, Float8)."""

import torch
from torch._subclasses.fake_tensor import is_fake

from ..core.numerics import (
    FP8_DTYPES,
    check_choice,
    quantize_per_tensor,
    check_fp8_dtype,
    finite_amax,
    exact_quotient,
    reduce_amax,
    sharded_quantization,
    tensor_amax,
    fp8_max,
    round_down_pow2,
    current_scale,
    scale_from_amax,
)
from ..core import running_state
from ..core.kernels import lookup
from ..core.quantizer import Quantizer
from ..core.storage import Buffer, FP8TensorwiseOperand, Storage, TensorScale
from ..core.tensor import QuantizedTensor
from .float8_groups import CastsGroups


# ---- numerics ------------------------------------------------------------------------------------
def dequantize_per_tensor(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return data.float() * scale_inv


# The largest margin: 2**127 is the largest power of two fp32 holds, so dividing by 2**margin equals
# multiplying by the exact 2**-margin (numerics.scale_from_amax).
MAX_MARGIN = 127

# An amax history entry that no cast has filled yet (an amax is never negative).
UNRECORDED = -1.0


class Float8Storage(Storage):
    """Rowwise: `data` is `[rows, cols]`. Columnwise: `data` is the transpose `[cols, rows]` (the
    layout an FP8 GEMM wants for the other reduction). `scale_inv` (0-d fp32) covers the whole
    tensor; a tensor holding both directions holds it once, shared by both."""

    format_name = "float8"
    option_values = {"fp8_dtype": FP8_DTYPES}
    rebuilds_other_direction = True

    @classmethod
    def layout(cls, direction, rows, cols, fp8_dtype):
        data = Buffer("data", fp8_dtype, (rows, cols), row_axis=0, col_axis=1) if direction == "rowwise" else Buffer(
            "data", fp8_dtype, (cols, rows), row_axis=1, col_axis=0
        )
        return (data, Buffer("scale_inv", torch.float32, (), row_axis=None, col_axis=None))

    def dequantize(self) -> torch.Tensor:
        kernel = lookup("float8.dequantize", self.data)
        values = kernel(self.data, self.scale_inv, torch.float32) if kernel else dequantize_per_tensor(self.data, self.scale_inv)
        return values if self.direction == "rowwise" else values.t()

    def dequantize_as(self, dtype: torch.dtype) -> torch.Tensor:
        kernel = lookup("float8.dequantize", self.data)
        if kernel is None or dtype != torch.bfloat16:  # fp16 needs the clamp of cast_saturating
            return super().dequantize_as(dtype)
        values = kernel(self.data, self.scale_inv, dtype)  # the fp32 product, rounded once
        return values if self.direction == "rowwise" else values.t()

    def bf16_operand(self):
        # The codes themselves (E4M3 and E5M2 are exact in bf16), the tensor scale applied to the result.
        return self.data.to(torch.bfloat16), TensorScale(self.scale_inv)

    def fp8_tensorwise_operand(self):
        # Either direction's codes have the reduction dimension last (columnwise: the transpose).
        return FP8TensorwiseOperand(self.data, self.scale_inv)

    def to_direction(self, direction: str) -> "Float8Storage":
        if direction == self.direction:
            return self
        # Same codes and scale either way: the other direction is the physical transpose.
        data = self.data.new_empty(self.data.shape[::-1])
        _transpose_into(self.data, data)
        return type(self)(
            direction=direction, rows=self.rows, cols=self.cols, fp8_dtype=self.fp8_dtype, data=data, scale_inv=self.scale_inv
        )

    def write_direction_into(self, target: "Float8Storage") -> None:
        if target.direction == self.direction:
            return super().write_direction_into(target)
        # The transpose written straight into the target's codes.
        with torch.autograd._unsafe_preserve_version_counter(target.data):
            _transpose_into(self.data, target.data)
        with torch.autograd._unsafe_preserve_version_counter(target.scale_inv):
            target.scale_inv.copy_(self.scale_inv)


def _transpose_into(codes: torch.Tensor, out: torch.Tensor) -> None:
    """`out.copy_(codes.t())`, through the tiled kernel on a GPU."""
    kernel = lookup("float8.transpose", codes)
    if kernel is None:
        out.copy_(codes.t())
    else:
        kernel(codes, out)


class Float8Tensor(QuantizedTensor):
    """A tensor stored as FP8 codes with one fp32 scale."""


class Float8Quantizer(CastsGroups, Quantizer):
    """Per-tensor FP8. `scaling="current"` takes the scale from this tensor's amax; `"delayed"` from
    the amax history of earlier casts (then records this cast's amax)."""

    format_name = "float8"
    tensor_class = Float8Tensor

    def __init__(
        self,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        scaling: str = "current",
        amax_epsilon: float = 0.0,
        force_pow_2_scales: bool = False,
        amax_history_len: int = 1024,
        amax_compute_algo: str = "max",
        margin: int = 0,
    ):
        check_fp8_dtype(fp8_dtype, "Float8Quantizer")
        check_choice(scaling, ("current", "delayed"), "scaling", "Float8Quantizer")
        check_choice(amax_compute_algo, ("max", "most_recent"), "amax_compute_algo", "Float8Quantizer")
        if not isinstance(amax_history_len, int) or amax_history_len < 1:
            raise ValueError(f"Float8Quantizer: amax_history_len must be a positive int, got {amax_history_len!r}.")
        if not isinstance(amax_epsilon, (int, float)) or amax_epsilon < 0:
            raise ValueError(f"Float8Quantizer: amax_epsilon must be a number >= 0, got {amax_epsilon!r}.")
        if not isinstance(margin, int) or isinstance(margin, bool) or not 0 <= margin <= MAX_MARGIN:
            # Past 127, 2**margin is not an fp32 number and every scale would be 0.
            raise ValueError(f"Float8Quantizer: margin must be an int from 0 to {MAX_MARGIN} (scale / 2**margin), got {margin!r}.")
        if not isinstance(force_pow_2_scales, bool):
            raise ValueError(f"Float8Quantizer: force_pow_2_scales must be True or False, got {force_pow_2_scales!r}.")
        self.fp8_dtype = fp8_dtype
        self.scaling = scaling
        self.amax_epsilon = amax_epsilon
        self.force_pow_2_scales = force_pow_2_scales
        self.amax_history_len = amax_history_len
        self.amax_compute_algo = amax_compute_algo
        self.margin = margin
        # Delayed scaling's running state: the amaxes of the last `amax_history_len` casts, oldest
        # first, in a fixed-size fp32 buffer updated in place; -1 marks an entry no cast has filled
        # yet (an amax is never negative). When a cast records is running_state.py's rule.
        self.amax_history = torch.full((amax_history_len,), UNRECORDED) if scaling == "delayed" else None

    def compute_scale(self, x: torch.Tensor) -> torch.Tensor:
        """The fp32 scale this quantizer would use for `x` now (docs/numerics.md, Float8)."""
        if self.scaling == "current":
            return self._current_scale(tensor_amax(x))
        history = self._history_on(x.device)
        window_amax = history.max() if self.amax_compute_algo == "max" else history[-1]
        amax = torch.clamp_min(window_amax, self.amax_epsilon)
        scale = self._finish(scale_from_amax(amax, fp8_max(self.fp8_dtype), self.margin))
        # docs/numerics.md, Float8: scale 1 until a cast has been recorded (chosen on the device: no host sync).
        return torch.where(window_amax >= 0, scale, 1.0)

    def grouped_scaling(self) -> str | None:
        return "tensor" if self.scaling == "current" else None  # delayed: one history per expert, cast one by one

    def group_scale_rule(self, amax: torch.Tensor):
        # One scale per group: from the amax of each group's columns.
        return amax.amax(dim=1, keepdim=True), self.amax_epsilon, self.force_pow_2_scales

    def _current_scale(self, amax: torch.Tensor) -> torch.Tensor:
        """Current scaling's scale (of each element of `amax`, a tensor's amax)."""
        return current_scale(amax, fp8_max(self.fp8_dtype), self.amax_epsilon, self.force_pow_2_scales)

    def _finish(self, scale: torch.Tensor) -> torch.Tensor:
        return round_down_pow2(scale) if self.force_pow_2_scales else scale

    def _history_on(self, device: torch.device) -> torch.Tensor:
        """The history, moved once to the device the data lives on (then updated there in place)."""
        if torch.device(device).type == "meta":
            return self.amax_history.to("meta")  # shapes only; the real history stays
        if is_fake(self.amax_history) and self.amax_history.device != torch.device(device):
            # Traced: a moved copy would take the updates, and the history itself would never move.
            raise RuntimeError(
                f"Float8Quantizer(scaling='delayed'): its amax history is on {self.amax_history.device} but "
                f"it casts a tensor on {device} under torch.compile. Move the model to {device} before "
                "compiling it (the history moves with its layer's weight)."
            )
        self.move_state(device)
        return self.amax_history

    def move_state(self, device: torch.device) -> None:
        # A meta-device model holds no values: the history stays where it is until real data comes.
        if self.amax_history is not None and self.amax_history.device != device and torch.device(device).type != "meta":
            self.amax_history = self.amax_history.to(device)

    def tensor_amaxes(self, x, rowwise, columnwise):
        # Current scaling: the amax its scale comes from; delayed: the amax the cast records (the
        # cast kernel's partial amaxes have the same max).
        return [finite_amax(x)]

    def _quantize_2d(self, x, rowwise, columnwise, *, update_state=True):
        rows, cols = x.shape
        cast = lookup("float8.cast", x)
        if cast is not None and (self.scaling == "current" or lookup("float8.delayed_scale", x) is not None):
            row_data, col_data, scale_inv = self._cast_on_device(x, cast, rowwise, columnwise, update_state)
        else:
            scale = self.compute_scale(x)
            scale_inv = exact_quotient(1.0, scale)  # 1/scale, correctly rounded
            if update_state and self.scaling == "delayed":
                running_state.record(self, tensor_amax(x))
            row_data = quantize_per_tensor(x.float(), scale, self.fp8_dtype)
            col_data = row_data.t().contiguous() if columnwise else None
        storage = lambda direction, data: Float8Storage(
            direction=direction, rows=rows, cols=cols, fp8_dtype=self.fp8_dtype, data=data, scale_inv=scale_inv
        )
        return (storage("rowwise", row_data) if rowwise else None, storage("columnwise", col_data) if columnwise else None)

    def _cast_on_device(self, x, cast, rowwise, columnwise, update_state):
        """The same cast by the kernels of the table (`cast`: the table's "float8.cast"): scale, codes
        of both directions and the history update, with no host sync and no elementwise torch ops on the way."""
        options = dict(amax_epsilon=self.amax_epsilon, force_pow_2_scales=self.force_pow_2_scales)
        if self.scaling == "current":
            # One shard of a sharded tensor needs the amax reduced over the ranks: a 0-d amax.
            amax = tensor_amax(x) if sharded_quantization() else lookup("float8.amax_partials", x)(x)
            row, col, scale_inv, _ = cast(x, self.fp8_dtype, rowwise, columnwise, amax=amax, **options)
            return row, col, scale_inv
        most_recent = self.amax_compute_algo == "most_recent"
        scale = lookup("float8.delayed_scale", x)(
            self._history_on(x.device), self.fp8_dtype, margin=self.margin, most_recent=most_recent, **options
        )
        row, col, scale_inv, partials = cast(x, self.fp8_dtype, rowwise, columnwise, scale=scale, amax_out=update_state)
        if update_state:
            running_state.record(self, reduce_amax(partials.max()) if sharded_quantization() else partials)
        return row, col, scale_inv

    def write_amax(self, amax: torch.Tensor) -> None:
        """Append one cast's amax (0-d, or the partial amaxes whose max it is) to the history."""
        kernel = lookup("float8.record_amax", amax)
        if kernel is not None:
            kernel(self._history_on(amax.device), amax.reshape(-1))
        else:
            self.record_amax(amax.max())

    def record_amax(self, amax: torch.Tensor) -> None:
        """Append one cast's amax to the delayed-scaling history, in place, dropping the oldest."""
        history = self._history_on(amax.device)
        history.copy_(torch.roll(history, -1))
        history[-1:].copy_(amax.reshape(1))

    def state_buffers(self) -> dict[str, torch.Tensor]:
        return {"amax_history": self.amax_history} if self.scaling == "delayed" else {}

    def _set_state_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        if self.scaling == "delayed":
            self.amax_history = buffers["amax_history"]
