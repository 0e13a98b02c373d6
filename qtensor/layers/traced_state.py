"""A layer's running state travels on its weight, as inner tensors (torch.compile).

A layer's quantizers travel on its weight (`linear_quantizers`); their running state (delayed
scaling's amax histories) lives on the quantizers. torch.compile only sees tensors it reaches from
the graph's inputs, so the weight also lists that state among its inner tensors
(`__tensor_flatten__`), named `state__<role>__<name>` (`state__input__amax_history`): the compiled
step then takes each history as an input and updates it in place, and a history that moves from
one step to the next is a new value, not a new graph.

Eagerly the names resolve to the quantizers' own tensors. A weight rebuilt from traced inner
tensors (`__tensor_unflatten__`) holds those as its *bound* state, which the layer's casts use
(`LinearQuantizers.using_state`), and a copy from such a weight into another (how the compiled step
writes an updated input back) copies the state too.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

PREFIX = "state__"


def _key(name: str) -> str:
    return name[len(PREFIX):].replace("__", ".")


def inner_names(weight, values: torch.Tensor) -> list[str]:
    """The inner-tensor names of `weight`'s layer state (none for stateless quantizers). The state
    moves to the weight's device first: the compiler reads it here, as an input of the graph it
    traces, and a history left behind on the CPU would be copied to the GPU at every step.
    `values` is one of the weight's own inner tensors (is it real, and where)."""
    linear = weight.linear_quantizers
    if linear is None or not linear.records_amaxes:  # stateless quantizers (checked on every compiled call)
        return []
    state = linear.state_buffers()
    if state and not has_bound_state(weight) and not is_fake(values) and values.device.type != "meta":
        linear.move_state(values.device)
    return [PREFIX + key.replace(".", "__") for key in state]


def is_state_name(name: str) -> bool:
    return name.startswith(PREFIX)


def state_of(weight) -> dict[str, torch.Tensor]:
    """The layer state `weight` carries by `<role>.<name>`: its bound (traced) tensors, else the live ones."""
    linear = weight.linear_quantizers
    live = linear.state_buffers() if linear is not None else {}
    bound = weight.bound_state or {}
    return {key: bound.get(key, tensor) for key, tensor in live.items()}


def traced_state_of(weight) -> dict[str, torch.Tensor] | None:
    """The state a traced weight carries (what its layer's casts must use), None for a real weight
    (its layer's casts use the quantizers' own state, wherever it has moved since)."""
    return state_of(weight) if has_bound_state(weight) else None


def inner_tensor(weight, name: str) -> torch.Tensor:
    """`getattr(weight, "state__input__amax_history")`: the tensor `__tensor_flatten__` names."""
    state = state_of(weight)
    key = _key(name)
    if key not in state:
        raise AttributeError(f"{type(weight).__name__} carries no layer state {key!r}")
    return state[key]


def bind(weight, inner_tensors: dict[str, torch.Tensor]) -> None:
    """Keep the state tensors among `inner_tensors` that are not the quantizers' own (traced copies)."""
    if weight.linear_quantizers is None:
        return
    live = weight.linear_quantizers.state_buffers()
    bound = {_key(n): t for n, t in inner_tensors.items() if is_state_name(n) and t is not live.get(_key(n))}
    if bound:
        weight.bound_state = bound


def has_bound_state(weight) -> bool:
    return bool(getattr(weight, "bound_state", None))  # any tensor may be asked (a copy_ source)


def copy_state(target, source) -> None:
    """Write the bound state of `source` (a traced weight's updated state) into `target`'s state."""
    mine = state_of(target)
    with torch.no_grad():
        for key, value in source.bound_state.items():
            if mine[key] is not value:
                mine[key].copy_(value)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Views of one memory with one layout: a buffer the compiled step did not write."""
    return (
        a.untyped_storage()._cdata == b.untyped_storage()._cdata
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )
