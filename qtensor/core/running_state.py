"""When a delayed-scaling cast writes its amax into its history: one owner, one rule.

A delayed-scaling quantizer scales each cast by the amax history of earlier casts and then records
this cast's amax (docs/numerics.md, Float8). Who records, and when, is decided here and nowhere else
(docs/running-state.md states the rule for users):

- A quantizer used on its own (`quantizer.quantize(x)`, a `copy_` into a quantized weight) writes
  its amax at once.
- Inside `noting()`, casts do not write: they note `(quantizer, amax)` in the list it yields, and
  the code that opened it decides. The quantized linear layer opens it around every forward cast:
  a training forward hands its notes to its backward, which writes them together with the
  gradient's amax (so eager and compiled steps write at the same point, and activation
  recomputation, which runs before that backward, casts from the same history as the forward did);
  an evaluation or inference forward drops them.
- `write(notes, group)` writes notes, each amax first reduced (MAX) over a data-parallel process
  group in one all-reduce, so every rank holds the same histories.

The notes live in a context variable: threads and asyncio tasks each see their own.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from .kernels import is_fake

_notes: contextvars.ContextVar[list | None] = contextvars.ContextVar("qtensor_amax_notes", default=None)


@contextlib.contextmanager
def noting():
    """Inside, delayed-scaling casts note their amax in the yielded list instead of writing it."""
    notes: list = []
    token = _notes.set(notes)
    try:
        yield notes
    finally:
        _notes.reset(token)


def record(quantizer, amax: torch.Tensor) -> None:
    """Called by a delayed-scaling quantizer after a cast: note the amax, or write it at once."""
    notes = _notes.get()
    if notes is None:
        quantizer.write_amax(amax)
    else:
        notes.append((quantizer, amax))


def write(notes: list, group=None) -> None:
    """Write noted amaxes into their quantizers' histories, in order. With a process `group` of more
    than one rank, each amax is first the MAX over the group's ranks (one all-reduce for all)."""
    if not notes:
        return
    if group is not None and _world_size(group) > 1:
        # An amax may come as the partial maxima of a cast kernel: reduce each to one value first.
        amaxes = _all_reduce_max(torch.stack([amax.reshape(-1).max().float() for _, amax in notes]), group)
        notes = [(quantizer, amax) for (quantizer, _), amax in zip(notes, amaxes.unbind())]
    for quantizer, amax in notes:
        quantizer.write_amax(amax)


def _world_size(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_initialized() else 1


def _all_reduce_max(values: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    # Traced: Dynamo's trace of the forward, and AOTAutograd's trace of the backward, which runs this
    # on functional or fake tensors while torch.compiler.is_compiling() is False.
    if torch.compiler.is_compiling() or type(values) is not torch.Tensor or is_fake(values):
        # A traceable collective: the compiled backward reduces the amaxes it writes.
        from torch.distributed import _functional_collectives as funcol

        # By the group's name: a ProcessGroup object would be a constant of the compiled backward's
        # graph, which AOTAutograd deep-copies (and a ProcessGroup cannot be copied).
        return funcol.all_reduce(values, "max", group.group_name)
    values = values.clone()
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values
