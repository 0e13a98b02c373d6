"""Exact fp32 building blocks shared by the formats (docs/numerics.md).

Each function is pure torch and bit-exact on CPU and GPU; the format modules compose them.
"""

import contextlib
import contextvars

import torch

from .kernels import lookup

FLT_MAX = torch.finfo(torch.float32).max

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype: 448 (E4M3) or 57344 (E5M2)."""
    return torch.finfo(fp8_dtype).max


def check_fp8_dtype(fp8_dtype, owner: str) -> None:
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(
            f"{owner}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}."
        )


def check_choice(value, allowed: tuple, option: str, owner: str) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}: {option} must be one of {allowed}, got {value!r}.")


# One NaN code per FP8 format (0 1111 111 in E4M3, 0 11111 11 in E5M2): devices disagree on the sign
# and payload of a cast NaN, and stored bytes must not depend on the device that wrote them.
FP8_NAN_CODE = 0x7F


def to_fp8(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 to FP8 (nearest even) with one canonical NaN code; values must already be in range."""
    codes = x.to(fp8_dtype).view(torch.uint8)
    return torch.where(torch.isnan(x), FP8_NAN_CODE, codes).view(fp8_dtype)


def saturate(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Clamp to ±max of the FP8 format; NaN stays NaN, ±Inf becomes ±max."""
    limit = fp8_max(fp8_dtype)
    return x.clamp(-limit, limit)


def to_fp8_saturating(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 to FP8 (nearest even), clamping to ±max first. NaN stays NaN; ±Inf clamps."""
    return to_fp8(saturate(x, fp8_dtype), fp8_dtype)


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| over the finite values, as an fp32 0-d tensor (0 for an empty or all-non-finite x)."""
    kernel = lookup("finite_amax", x)
    if kernel is not None and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return kernel(x)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.where(torch.isfinite(x), x.abs(), 0.0).amax().float()


class AmaxReduction:
    """How the cast of one shard of a tensor spread over ranks takes the whole tensor's tensor-wide
    amaxes, so that every shard gets one scale and a sharded run equals a single-process one
    (docs/design.md, FSDP2): each amax the cast makes (`tensor_amax`, `reduce_amax`) is the MAX over
    the ranks of `groups` (one process group, or several mesh dimensions, reduced over in turn).

    With `reduced`, the amaxes were reduced before the cast (in one collective with other shards'),
    and the cast takes them in the order it asks for them (`Quantizer.tensor_amaxes`) without
    reading its own values for them; it must take every one. Entered with `sharded_cast`."""

    def __init__(self, groups, reduced=None, owner: str = "a cast"):
        self.groups = groups if isinstance(groups, tuple) else (groups,)
        self.reduced = None if reduced is None else list(reduced)
        self.owner, self.taken = owner, 0

    @property
    def pre_reduced(self) -> bool:
        return self.reduced is not None

    def reduce(self, amax: torch.Tensor) -> torch.Tensor:
        """`amax`, this rank's, max-ed in place over the groups; or the next amax reduced before."""
        if self.reduced is None:
            all_reduce_max(amax, self.groups)
            return amax
        if self.taken == len(self.reduced):
            raise RuntimeError(
                f"{self.owner}: its cast asks for more tensor-wide amaxes than the {len(self.reduced)} reduced "
                "before it; the quantizer's tensor_amaxes() must list every amax its cast reduces, in order."
            )
        self.taken += 1
        return self.reduced[self.taken - 1]

    def check_all_taken(self) -> None:
        if self.reduced is not None and self.taken != len(self.reduced):
            raise RuntimeError(
                f"{self.owner}: its cast took {self.taken} tensor-wide amaxes of the {len(self.reduced)} reduced "
                "before it; the quantizer's tensor_amaxes() must list exactly the amaxes its cast reduces, in order."
            )


# The reduction of the shard being cast, or None: the tensor is whole (a context variable: per
# thread and task; the casts run deep inside the formats and inside aten.copy_, whose signatures
# carry no process group).
_sharded: contextvars.ContextVar = contextvars.ContextVar("qtensor_sharded_cast", default=None)


@contextlib.contextmanager
def sharded_cast(groups, *, reduced=None, owner: str = "a cast"):
    """Inside, every cast is of one shard of a tensor spread over the ranks of `groups`: its
    tensor-wide amaxes are the whole tensor's (`AmaxReduction`). No groups: the tensor is whole."""
    reduction = AmaxReduction(groups, reduced, owner) if groups or reduced is not None else None
    token = _sharded.set(reduction)
    try:
        yield
    finally:
        _sharded.reset(token)
    if reduction is not None:
        reduction.check_all_taken()


def sharded_quantization() -> bool:
    """True inside `sharded_cast`: the tensor being quantized is one shard of a larger one."""
    return _sharded.get() is not None


def amaxes_pre_reduced() -> bool:
    """True inside a `sharded_cast` given its reduced amaxes: a cast need not compute its local ones."""
    reduction = _sharded.get()
    return reduction is not None and reduction.pre_reduced


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """The amax that sets a tensor-wide scale: `finite_amax`, made the whole tensor's inside
    `sharded_cast` (reduced over the ranks, or the next one reduced before; `x` is not read then)."""
    reduction = _sharded.get()
    if reduction is not None and reduction.pre_reduced:
        return reduction.reduce(None)
    return reduce_amax(finite_amax(x))


def reduce_amax(amax: torch.Tensor) -> torch.Tensor:
    """`amax`, this rank's, made the whole tensor's inside `sharded_cast`; as is outside it."""
    reduction = _sharded.get()
    return amax if reduction is None else reduction.reduce(amax)


def all_reduce_max(tensor: torch.Tensor, groups) -> None:
    """`tensor` max-ed in place over the ranks of `groups`: one process group or a tuple of them."""
    import torch.distributed as dist

    for group in groups if isinstance(groups, tuple) else (groups,):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def exact_pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent as fp32, exactly, for integer exponents in [-149, 127] (subnormals included)."""
    exponent = exponent.to(torch.int32)
    normal = (exponent + 127).clamp(min=0) << 23
    subnormal = torch.ones_like(exponent) << (exponent + 149).clamp(0, 22)
    return torch.where(exponent >= -126, normal, subnormal).view(torch.float32)


def round_down_pow2(x: torch.Tensor) -> torch.Tensor:
    """Clear the mantissa bits of positive fp32 values: the largest power of two at or below x."""
    return (x.view(torch.int32) & 0x7F800000).view(torch.float32)


def fp32(value: float, device=None) -> torch.Tensor:
    """A 0-d fp32 constant (Python floats are doubles; the spec's constants are fp32), filled on the
    device (no host-to-device copy, so no host synchronisation)."""
    return torch.full((), value, dtype=torch.float32, device=device)


def exact_quotient(numerator, denominator: torch.Tensor) -> torch.Tensor:
    """fp32 `numerator / denominator` correctly rounded, also where a compiler lowers fp32 division to
    an approximate one (Triton's `/` is within 2 ulp): taken in fp64, whose division every backend
    rounds correctly, then rounded to fp32. Rounding twice gives the once-rounded fp32 quotient
    because fp64 carries more than twice fp32's 24 bits plus two (a known property of division)."""
    if not isinstance(numerator, torch.Tensor):
        numerator = torch.full((), numerator, dtype=torch.float64, device=denominator.device)
    return (numerator.double() / denominator.double()).float()


def scale_from_amax(amax: torch.Tensor, max_value: float, margin: int = 0) -> torch.Tensor:
    """fp32 `(max_value / amax) / 2**margin`, 1 when amax is 0, FLT_MAX when it overflows."""
    scale = exact_quotient(fp32(max_value, amax.device), amax)
    if margin:  # 2**margin is an fp32 number (margin <= 127): dividing by it equals multiplying by 2**-margin
        scale = scale * fp32(2.0**-margin, amax.device)
    scale = torch.where(torch.isinf(scale), FLT_MAX, scale)
    return torch.where(amax == 0, 1.0, scale)


def current_scale(amax: torch.Tensor, max_value: float, amax_epsilon: float, pow2: bool) -> torch.Tensor:
    """Float8's current scaling: `max_value / max(amax, amax_epsilon)` (scale_from_amax's edges),
    rounded down to a power of two with `pow2`."""
    scale = scale_from_amax(torch.clamp_min(amax, amax_epsilon), max_value)
    return round_down_pow2(scale) if pow2 else scale


def pad_to_multiple(x: torch.Tensor, block: int, dim: int) -> torch.Tensor:
    """Zero-pad `dim` of a 2-D tensor up to a multiple of `block` (docs/numerics.md: partial blocks behave as zero-padded)."""
    remainder = x.shape[dim] % block
    if remainder == 0:
        return x
    pad = [0, 0, 0, 0]
    pad[1 if dim == 1 else 3] = block - remainder
    return torch.nn.functional.pad(x, pad)


def block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """max|x| of each run of `block` elements along the rows of a 2-D tensor: [R, ceil(C/block)].

    NaN anywhere in a block gives NaN; Inf gives Inf.
    """
    rows, num_blocks = x.shape[0], ceil_div(x.shape[1], block)
    blocks = pad_to_multiple(x, block, dim=1).reshape(rows, num_blocks, block)
    if blocks.numel() == 0:
        return blocks.new_zeros(rows, num_blocks)
    return blocks.abs().amax(dim=-1)


def expand_blocks(per_block: torch.Tensor, block: int, columns: int) -> torch.Tensor:
    """Repeat each per-block value over its `block` columns and crop to `columns`."""
    return per_block.repeat_interleave(block, dim=1)[:, :columns]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def cast_saturating(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values to `dtype`, finite values clamped to its range: a dequantized value may round just
    past the largest fp16 (64000 in MXFP8 is 2**16), and finite input must not come back infinite."""
    if dtype == torch.float16:
        limit = torch.finfo(dtype).max
        values = torch.where(torch.isinf(values), values, values.clamp(-limit, limit))
    return values.to(dtype)


# E5M2's ±Inf codes. They are written as codes: a saturating conversion (the one compiled kernels
# use) would clamp an infinity to the largest finite value.
E5M2_INF_CODES = (0x7C, 0xFC)


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """`fp8(x * scale)`, saturating; NaN stays NaN, ±Inf becomes NaN (E4M3) or stays ±Inf (E5M2)."""
    infinite = torch.isinf(x)
    if fp8_dtype == torch.float8_e4m3fn:
        return to_fp8(torch.where(infinite, float("nan"), saturate(x * scale, fp8_dtype)), fp8_dtype)
    codes = to_fp8(saturate(x * scale, fp8_dtype), fp8_dtype).view(torch.uint8)
    positive, negative = E5M2_INF_CODES
    return torch.where(infinite, torch.where(x > 0, positive, negative).to(torch.uint8), codes).view(fp8_dtype)
