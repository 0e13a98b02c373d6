"""Roles and recipes: which quantizer each tensor of each layer gets (docs/recipes.md), and the
ready factories: `qtensor.quantize_(model, qtensor.recipes.mxfp8())`.

`Recipe` is a factory plus how the backward runs. Each ready factory below is a call that returns a
factory giving every linear layer fresh quantizers of its own (delayed scaling keeps per-layer
state) and leaving other module types alone.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from .formats.float8 import Float8Quantizer
from .formats.float8_block import Float8BlockQuantizer
from .formats.hybrid import HybridQuantizer
from .formats.identity import IdentityQuantizer
from .formats.mxfp8 import MXFP8Quantizer
from .formats.nvfp4 import NVFP4Quantizer
from .core.quantizer import Quantizer
from .layers.config import BACKWARD_OVERRIDES

TENSOR_TYPES = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class Role:
    """One tensor of one module: `Role("linear", "weight", "layers.0.mlp.up_proj")`."""

    module_type: str
    tensor_type: str
    name: str


Factory = Callable[[Role], "Quantizer | None"]


class Recipe:
    """A factory plus how the backward runs.

    `backward_override=None` runs the backward GEMMs as the factory says; `"high_precision"` runs
    them on the original input and weight and the unquantized gradient; `"dequantized"` on the
    dequantized forward-quantized input and weight and the unquantized gradient.

    `fprop_fast_accumulation` runs the forward GEMM with the FP8 tensor cores' fast accumulation
    where it runs on them; None takes the factory's own choice (its `fprop_fast_accumulation`
    attribute: on for the ready Float8 recipes), else off. `backward_fast_accumulation=True` runs
    dgrad and wgrad with it too (off by default: the backward keeps the split fp32 accumulator,
    whose error bound is 4x tighter, docs/numerics.md).
    """

    def __init__(
        self, factory: Factory, backward_override: str | None = None, fprop_fast_accumulation: bool | None = None,
        backward_fast_accumulation: bool = False,
    ):
        if not callable(factory):
            raise TypeError(f"Recipe needs a callable factory(role) -> Quantizer | None, got {factory!r}.")
        if not _takes_one_argument(factory):
            raise TypeError(
                f"{getattr(factory, '__name__', factory)!r} is not a factory(role): it cannot take a Role. "
                "A ready recipe must be called to make one: qtensor.recipes.mxfp8(), not qtensor.recipes.mxfp8."
            )
        if backward_override not in BACKWARD_OVERRIDES:
            raise ValueError(f"Recipe: backward_override must be one of {BACKWARD_OVERRIDES}, got {backward_override!r}.")
        if fprop_fast_accumulation is None:
            fprop_fast_accumulation = getattr(factory, "fprop_fast_accumulation", False)
        if not isinstance(fprop_fast_accumulation, bool):
            raise ValueError(f"Recipe: fprop_fast_accumulation must be True, False or None, got {fprop_fast_accumulation!r}.")
        if not isinstance(backward_fast_accumulation, bool):
            raise ValueError(f"Recipe: backward_fast_accumulation must be True or False, got {backward_fast_accumulation!r}.")
        self.factory = factory
        self.backward_override = backward_override
        self.fprop_fast_accumulation = fprop_fast_accumulation
        self.backward_fast_accumulation = backward_fast_accumulation

    def quantizers_for(self, module_type: str, name: str) -> dict[str, Quantizer | None]:
        """Ask the factory for each tensor type of one module; check what it returns."""
        chosen = {}
        for tensor_type in TENSOR_TYPES:
            quantizer = self.factory(Role(module_type, tensor_type, name))
            if quantizer is not None and not isinstance(quantizer, Quantizer):
                raise TypeError(
                    f"The factory returned {quantizer!r} for {Role(module_type, tensor_type, name)}; "
                    "it must return a qtensor quantizer or None."
                )
            chosen[tensor_type] = quantizer
        if self.backward_override is not None:
            # Running state is a delayed-scaling history (a hybrid's child's included).
            delayed = [t for t, q in chosen.items() if q is not None and q.state_buffers()]
            if delayed:
                raise ValueError(
                    f"Layer {name!r}: backward_override={self.backward_override!r} cannot be honoured with "
                    f"delayed scaling ({', '.join(delayed)}): the override skips the quantized casts whose "
                    "amaxes the history needs. Use Float8Quantizer(scaling='current') or no override."
                )
        return chosen

    def __repr__(self) -> str:
        return (
            f"Recipe({self.factory!r}, backward_override={self.backward_override!r}, "
            f"fprop_fast_accumulation={self.fprop_fast_accumulation!r}, backward_fast_accumulation={self.backward_fast_accumulation!r})"
        )


def _takes_one_argument(factory) -> bool:
    try:
        inspect.signature(factory).bind(None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (some builtins): let the call decide
        return True
    return True


class ByTensorType:
    """A factory that makes a new quantizer per linear layer and tensor type. Each maker is called
    once here, so a bad option raises when the recipe is made, not at quantize_ time."""

    def __init__(
        self, name: str, input: Callable[[], Quantizer], weight: Callable[[], Quantizer], grad_output: Callable[[], Quantizer],
        options: dict | None = None, fprop_fast_accumulation: bool = False,
    ):
        self.name = name
        self.makers = {"input": input, "weight": weight, "grad_output": grad_output}
        self.options = options or {}
        # Read by Recipe: the forward GEMM on the FP8 tensor cores' fast accumulation.
        self.fprop_fast_accumulation = fprop_fast_accumulation
        for make in self.makers.values():
            make()

    def __call__(self, role: Role) -> Quantizer | None:
        if role.module_type not in ("linear", "experts"):  # an expert stack's experts are linear layers too
            return None
        return self.makers[role.tensor_type]()

    def __repr__(self) -> str:
        options = ", ".join(f"{name}={_show(value)}" for name, value in self.options.items())
        return f"qtensor.recipes.{self.name}({options})"


def _show(value) -> str:
    return str(value) if isinstance(value, torch.dtype) else repr(value)


def _changed(defaults: dict, given: dict) -> dict:
    """The options a call changed from their defaults (what the recipe's repr shows)."""
    return {name: value for name, value in given.items() if defaults[name] != value}


def float8_current(
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    grad_fp8_dtype: torch.dtype = torch.float8_e5m2,
    amax_epsilon: float = 0.0,
    force_pow_2_scales: bool = False,
    fprop_fast_accumulation: bool = True,
) -> ByTensorType:
    """Per-tensor FP8 with current scaling: `fp8_dtype` (E4M3) for input and weight, `grad_fp8_dtype`
    (E5M2) for the gradient; `amax_epsilon` and `force_pow_2_scales` as `Float8Quantizer` takes them;
    `fprop_fast_accumulation`: the forward GEMM on the FP8 tensor cores' fast accumulation (dgrad
    and wgrad keep the split fp32 accumulator; docs/numerics.md, FP8 GEMMs)."""
    options = dict(amax_epsilon=amax_epsilon, force_pow_2_scales=force_pow_2_scales)
    return _float8(float8_current, "current", fp8_dtype, grad_fp8_dtype, fprop_fast_accumulation, options)


def float8_delayed(
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    grad_fp8_dtype: torch.dtype = torch.float8_e5m2,
    amax_history_len: int = 1024,
    amax_compute_algo: str = "max",
    margin: int = 0,
    amax_epsilon: float = 0.0,
    force_pow_2_scales: bool = False,
    fprop_fast_accumulation: bool = True,
) -> ByTensorType:
    """Per-tensor FP8 with delayed scaling (an amax history per tensor): `fp8_dtype` (E4M3) for input
    and weight, `grad_fp8_dtype` (E5M2) for the gradient; the history's length, how it is reduced
    (`"max"` or `"most_recent"`) and the `margin` (scale / 2**margin) as `Float8Quantizer` takes them;
    `fprop_fast_accumulation` as in `float8_current`."""
    options = dict(
        amax_history_len=amax_history_len, amax_compute_algo=amax_compute_algo, margin=margin,
        amax_epsilon=amax_epsilon, force_pow_2_scales=force_pow_2_scales,
    )
    return _float8(float8_delayed, "delayed", fp8_dtype, grad_fp8_dtype, fprop_fast_accumulation, options)


def _float8(recipe, scaling: str, fp8_dtype, grad_fp8_dtype, fprop_fast_accumulation: bool, options: dict) -> ByTensorType:
    """A Float8 recipe: `fp8_dtype` for input and weight, `grad_fp8_dtype` for the gradient, each a
    `Float8Quantizer` with `scaling` and `options`; its repr shows the arguments `recipe` was given."""
    given = dict(fp8_dtype=fp8_dtype, grad_fp8_dtype=grad_fp8_dtype, fprop_fast_accumulation=fprop_fast_accumulation, **options)
    return ByTensorType(
        recipe.__name__,
        input=lambda: Float8Quantizer(fp8_dtype, scaling=scaling, **options),
        weight=lambda: Float8Quantizer(fp8_dtype, scaling=scaling, **options),
        grad_output=lambda: Float8Quantizer(grad_fp8_dtype, scaling=scaling, **options),
        options=_changed(_defaults(recipe), given),
        fprop_fast_accumulation=fprop_fast_accumulation,
    )


def float8_rowwise(
    *, fp8_dtype: torch.dtype = torch.float8_e4m3fn, pow2_scales: bool = True, fprop_fast_accumulation: bool = True
) -> ByTensorType:
    """Row-wise FP8: one scale per row of each GEMM operand, every tensor `fp8_dtype` (E4M3), scales
    rounded down to powers of two (`pow2_scales`). The input's and the gradient's columnwise copies
    (the weight gradient's operands) take one scale per column. `fprop_fast_accumulation` as in
    `float8_current`."""
    return _rowwise(float8_rowwise, fp8_dtype, pow2_scales, fprop_fast_accumulation, high_precision_wgrad=False)


def float8_rowwise_gw_hp(
    *, fp8_dtype: torch.dtype = torch.float8_e4m3fn, pow2_scales: bool = True, fprop_fast_accumulation: bool = True
) -> ByTensorType:
    """`float8_rowwise` with the weight gradient in high precision: the input's and the gradient's
    columnwise copies, which only dW = dYᵀ·X reads, keep their high-precision values (Identity, in
    the autocast dtype under autocast, as `nn.Linear`'s operands); the forward GEMM and the input
    gradient stay row-wise FP8."""
    return _rowwise(float8_rowwise_gw_hp, fp8_dtype, pow2_scales, fprop_fast_accumulation, high_precision_wgrad=True)


def _rowwise(recipe, fp8_dtype, pow2_scales: bool, fprop_fast_accumulation: bool, high_precision_wgrad: bool) -> ByTensorType:
    row = lambda: Float8BlockQuantizer(fp8_dtype, block_rows=1, block_cols=None, pow2_scales=pow2_scales)
    activation = (lambda: HybridQuantizer(row(), IdentityQuantizer("autocast"))) if high_precision_wgrad else row
    given = dict(fp8_dtype=fp8_dtype, pow2_scales=pow2_scales, fprop_fast_accumulation=fprop_fast_accumulation)
    return ByTensorType(
        recipe.__name__, input=activation, weight=row, grad_output=activation,
        options=_changed(_defaults(recipe), given), fprop_fast_accumulation=fprop_fast_accumulation,
    )


def float8_blockwise(
    *, fp8_dtype: torch.dtype = torch.float8_e4m3fn, pow2_scales: bool = False, fprop_fast_accumulation: bool = False
) -> ByTensorType:
    """Block-wise FP8 as DeepSeek-V3 trained: 1x128 blocks for the input and the gradient (each copy
    along its own reduction dimension), 128x128 blocks for the weight, every tensor `fp8_dtype`
    (E4M3), fp32 scales (powers of two with `pow2_scales`). `fprop_fast_accumulation` as in
    `float8_current` (DeepSeek-V3 promoted partial sums to fp32 instead: off by default)."""
    vector = lambda: Float8BlockQuantizer(fp8_dtype, block_rows=1, block_cols=128, pow2_scales=pow2_scales)
    tile = lambda: Float8BlockQuantizer(fp8_dtype, block_rows=128, block_cols=128, pow2_scales=pow2_scales)
    given = dict(fp8_dtype=fp8_dtype, pow2_scales=pow2_scales, fprop_fast_accumulation=fprop_fast_accumulation)
    return ByTensorType(
        "float8_blockwise", input=vector, weight=tile, grad_output=vector,
        options=_changed(_defaults(float8_blockwise), given), fprop_fast_accumulation=fprop_fast_accumulation,
    )


def mxfp8(
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    grad_fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_rounding: str = "rceil",
) -> ByTensorType:
    """MXFP8 (E8M0 scale per 32 elements) for every tensor: `fp8_dtype` for input and weight,
    `grad_fp8_dtype` for the gradient (both E4M3 by default), `scale_rounding` "rceil" or "floor"."""
    return ByTensorType(
        "mxfp8",
        input=lambda: MXFP8Quantizer(fp8_dtype, scale_rounding),
        weight=lambda: MXFP8Quantizer(fp8_dtype, scale_rounding),
        grad_output=lambda: MXFP8Quantizer(grad_fp8_dtype, scale_rounding),
        options=_changed(_defaults(mxfp8), dict(fp8_dtype=fp8_dtype, grad_fp8_dtype=grad_fp8_dtype, scale_rounding=scale_rounding)),
    )


def nvfp4(
    *, weight_block_2d: bool = True, rht: bool = True, stochastic_rounding: bool = True, seed: int | None = None, weight_only: bool = False
) -> ByTensorType:
    """NVFP4: 16x16 tiles for weights (`weight_block_2d`); 1x16 blocks with the Hadamard transform
    on the wgrad copies of inputs and gradients (`rht`); stochastic rounding for gradients
    (`stochastic_rounding`, seeded with `seed`). `weight_only=True`: the weights alone in NVFP4,
    inputs and gradients in the autocast dtype (W4A16, as NF4 holds a frozen base): the GEMMs
    multiply bf16 values over the dequantized weight, and `rht`, `stochastic_rounding` and `seed`,
    which have nothing to apply to, are refused."""
    unused = [name for name, given in (("rht", not rht), ("stochastic_rounding", not stochastic_rounding), ("seed", seed is not None)) if given]
    if weight_only and unused:
        raise ValueError(
            f"recipes.nvfp4: {', '.join(unused)} set the casts of inputs and gradients, which weight_only=True leaves in "
            "high precision; drop them."
        )
    if weight_only:
        activations = lambda: IdentityQuantizer("autocast")
        input_quantizer = grad_quantizer = activations
    else:
        input_quantizer = lambda: NVFP4Quantizer(rht=rht)
        grad_quantizer = lambda: NVFP4Quantizer(rht=rht, stochastic_rounding=stochastic_rounding, seed=seed if stochastic_rounding else None)
    given = dict(weight_block_2d=weight_block_2d, rht=rht, stochastic_rounding=stochastic_rounding, seed=seed, weight_only=weight_only)
    return ByTensorType(
        "nvfp4",
        input=input_quantizer,
        weight=lambda: NVFP4Quantizer(block_2d=weight_block_2d),
        grad_output=grad_quantizer,
        options=_changed(_defaults(nvfp4), given),
    )


def mxfp8_fwd_nvfp4_bwd(
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_rounding: str = "rceil",
    rht: bool = True,
    stochastic_rounding: bool = True,
    seed: int | None = None,
) -> ByTensorType:
    """MXFP8 rowwise (forward GEMM, `fp8_dtype`, `scale_rounding`) + NVFP4 columnwise (backward GEMMs)
    for input and weight, NVFP4 for gradients (stochastic rounding, seeded with `seed`). With `rht`
    the wgrad operands (input columnwise, gradient columnwise) both carry the Hadamard transform, so
    it cancels in dYᵀ·X."""
    return ByTensorType(
        "mxfp8_fwd_nvfp4_bwd",
        input=lambda: HybridQuantizer(MXFP8Quantizer(fp8_dtype, scale_rounding), NVFP4Quantizer(rht=rht)),
        weight=lambda: HybridQuantizer(MXFP8Quantizer(fp8_dtype, scale_rounding), NVFP4Quantizer()),
        grad_output=lambda: NVFP4Quantizer(rht=rht, stochastic_rounding=stochastic_rounding, seed=seed if stochastic_rounding else None),
        options=_changed(
            _defaults(mxfp8_fwd_nvfp4_bwd),
            dict(fp8_dtype=fp8_dtype, scale_rounding=scale_rounding, rht=rht, stochastic_rounding=stochastic_rounding, seed=seed),
        ),
    )


def _defaults(recipe) -> dict:
    return {name: parameter.default for name, parameter in inspect.signature(recipe).parameters.items()}
