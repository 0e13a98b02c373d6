"""The one seam between a quantized linear layer and the ways its tensors are spread over ranks.

A quantized linear multiplies three tensors: its input, its weight and (in the backward) its output
gradient. Under a parallel mode some of them are pieces of larger tensors, or arrive already cast
and gathered. The linear (layers/linear.py) does not know the modes; for each of its tensors it asks
that tensor's `Placement`:

- `casting()`: the context its cast of the tensor runs in. A piece of a tensor spread over ranks
  reduces its tensor-wide amaxes over them (`numerics.sharded_cast`), so each rank holds exactly its
  slice of what one process would quantize.
- `arrived(...)`: the 2-D operand a GEMM reads when the tensor arrived already quantized (a quantized
  all-gather made it before the layer), checked against the layer's quantizer.
- `saved(...)` / `restored(...)`: what of a quantized operand the backward keeps, and how it is made
  whole again when the backward reads it (a gathered activation keeps this rank's rows and gathers
  the rest then).

and for the call as a whole its `LayerPlacement`, held by the weight (`LayerWeight.placement`):
the local operands of the call, the placement of each of its three tensors, and the layer's output
made from the local one. A tensor that arrived quantized names its own placement (`place`,
`placement_of`), held by its storage, which every view of the tensor keeps.

The defaults here describe one process: every tensor whole. The modes live in qtensor/distributed/:
FSDP2 gathers the weight before the layer runs (the linear sees it whole), tensor parallelism gives
the weight a `LayerPlacement` for the length of each forward, sequence parallelism places the
activations it gathers quantized. A new mode is a new module there (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from .numerics import sharded_cast
from .quantizer import fold_to_2d
from .storage import Storage


class Placement:
    """Where one tensor of a quantized linear lives over ranks. This class: whole on every rank, or
    `groups` given, one piece of a tensor whose other pieces the ranks of `groups` hold."""

    # For the refusals of `arrived`: what made a tensor that arrived quantized, and what to use
    # instead of the quantized arrival (a mode's placement names its own).
    made_by = ""
    instead = "Give every layer that reads it the quantizer that cast it, or hand it the tensor unquantized."

    def __init__(self, groups: tuple = ()):
        self.groups = groups if isinstance(groups, tuple) else (groups,)

    def casting(self):
        """The context the layer casts this tensor in: its amaxes the whole tensor's."""
        return sharded_cast(self.groups) if self.groups else contextlib.nullcontext()

    def arrived(self, quantizer, tensor, layer, role: str, *, directions: tuple) -> torch.Tensor:
        """The 2-D operand for `tensor`, which arrived already quantized, as layer `layer` (its
        `LinearQuantizers`) reads it in role `role` ("input" or "grad_output") in `directions`: it
        must be what the layer's own quantizer makes, in every direction the layer reads."""
        name, what = layer.name or "<root>", role.replace("_", " ")
        if quantizer is None or quantizer != tensor.quantizer:
            raise ValueError(
                f"layer {name!r}: its {what} arrived quantized{self.made_by} with {tensor.quantizer.describe()}, but "
                f"the layer's {role} quantizer is {'none' if quantizer is None else quantizer.describe()}. {self.instead}"
            )
        if role == "input" and layer.backward_override == "high_precision":
            raise ValueError(
                f"layer {name!r}: backward_override='high_precision' computes its gradients from the high-precision "
                f"input, and its input arrived quantized{self.made_by}, without one. {self.instead}"
            )
        missing = [d for d in directions if getattr(tensor, d) is None]
        if missing:
            raise ValueError(
                f"layer {name!r}: its {role.replace('_', ' ')} arrived quantized without the {missing[0]} copy the "
                "layer's GEMMs read; quantize it with both directions the layer needs."
            )
        return tensor.with_storages(tensor.rowwise, tensor.columnwise, shape=fold_to_2d(tensor).shape)

    def saved(self, tensor, direction: str) -> tuple[Storage, "Placement | None"]:
        """The storage of `tensor`'s `direction` that the backward keeps, and the placement that makes
        it whole again when read (`restored`), or None: it is whole. A tensor holding only its other
        copy (a frozen weight that keeps the forward's) keeps that one, rebuilt when read."""
        if getattr(tensor, direction) is None and tensor.storage_for(None).direction != direction:
            return tensor.storage_for(None), Rebuilt(direction, tensor.quantizer)
        return tensor.storage_for(direction), None

    def restored(self, storage: Storage) -> Storage:
        return storage


class Rebuilt(Placement):
    """A saved copy of the other direction, re-laid out for `direction` when the backward reads it
    by the quantizer that made it (`Quantizer.rebuild_direction`: a format whose two copies hold the
    same values)."""

    def __init__(self, direction: str, quantizer):
        super().__init__()
        self.direction, self.quantizer = direction, quantizer

    def restored(self, storage: Storage) -> Storage:
        return self.quantizer.rebuild_direction(storage, self.direction)


WHOLE = Placement()


class LayerPlacement:
    """How one call of a quantized linear is spread over ranks: `input`, `weight` and `grad_output`
    are the placements of its three tensors, and the two methods turn the call's operands into the
    local ones its GEMMs multiply and the local output into the layer's. This class: one process."""

    input: Placement = WHOLE
    weight: Placement = WHOLE
    grad_output: Placement = WHOLE

    def local_operands(self, x: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        """(the input the GEMMs multiply, the bias added to the local output)."""
        return x, bias

    def output(self, y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's output from `y`, the local linear of `x` (the local input) and `weight`; `bias`
        as the call was given it."""
        return y


LOCAL = LayerPlacement()

# The storage of a quantized tensor that arrived placed -> its placement. Views of the tensor
# (DTensor.to_local, a reshape to 2-D) keep the storage object, so every view finds it; the entry
# lives as long as the storage does.
_PLACED: "weakref.WeakKeyDictionary[Storage, Placement]" = weakref.WeakKeyDictionary()


def place(tensor, placement: Placement) -> None:
    """Record that the quantized `tensor` is placed `placement` (a mode that gathered it says so)."""
    _PLACED[_key(tensor)] = placement


def placement_of(tensor) -> Placement:
    """The placement of a quantized tensor that arrived for a layer: the one recorded for it, or
    whole (a tensor the caller quantized)."""
    return _PLACED.get(_key(tensor), WHOLE)


def _key(tensor) -> Storage:
    return tensor.rowwise if tensor.rowwise is not None else tensor.columnwise
