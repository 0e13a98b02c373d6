"""Roles and recipes: which quantizer each tensor of each layer gets (docs/recipes.md)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from .layer import BACKWARD_OVERRIDES
from .quantizer import Quantizer

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
    where it runs on them (the backward GEMMs never do); None takes the factory's own choice (its
    `fprop_fast_accumulation` attribute: on for the ready Float8 recipes), else off.
    """

    def __init__(self, factory: Factory, backward_override: str | None = None, fprop_fast_accumulation: bool | None = None):
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
        self.factory = factory
        self.backward_override = backward_override
        self.fprop_fast_accumulation = fprop_fast_accumulation

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
            f"fprop_fast_accumulation={self.fprop_fast_accumulation!r})"
        )


def _takes_one_argument(factory) -> bool:
    try:
        inspect.signature(factory).bind(None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (some builtins): let the call decide
        return True
    return True
