"""Launching a Triton kernel again for a fraction of `kernel[grid](...)`'s host time.

`kernel[grid](*args, **constexprs)` binds and specializes every argument and looks the compiled
kernel up on every call: about 40 µs of Python per launch on the H100 hosts, for a cast whose GPU
work at common layer sizes takes as long. `launch(kernel, grid, *args, **constexprs)` does the
first launch of each *launch key* through `kernel[grid]` (which compiles), keeps the compiled
kernel, and launches it directly from then on (about 10 µs).

The launch key tells apart every two calls Triton would compile differently: the constexprs and
options, the current device, and per argument what Triton specializes on (a tensor's dtype and
whether its address is 16-byte aligned; an int's width, whether it is 1 and whether 16 divides it;
a bool; None; a float). It is finer than Triton's own key, never coarser: tests/test_cuda_kernels.py
checks that arguments of one launch key get one Triton specialization, so a Triton that starts to
specialize on something else fails there. A launch hook (set by a profiler such as Proton) or a
Triton without the direct path sends every launch through `kernel[grid]`.
"""

from __future__ import annotations

import inspect

import torch
import triton

try:
    from triton import knobs as _knobs

    _RUNTIME = _knobs.runtime  # launch_enter_hook / launch_exit_hook live here
except (ImportError, AttributeError):  # an older Triton: always through kernel[grid]
    _RUNTIME = None

_INT32, _INT64 = range(-(2**31), 2**31), range(-(2**63), 2**63)


def _argument_key(value):
    """What Triton specializes a non-constexpr argument on, or finer (see the module's docstring)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    kind = type(value)
    if kind is int:
        width = "i32" if value in _INT32 else "i64" if value in _INT64 else "u64"
        return width, value == 1, value % 16 == 0
    if kind is bool or value is None:
        return value
    if kind is float:
        return float
    raise TypeError(f"qtensor_kernels.launch: no launch key for a {kind.__name__} argument; pass it to kernel[grid] instead.")


class _Compiled:
    """A compiled kernel, ready to launch: its launcher, handle, packed metadata and the values of
    the parameters past the positional ones (constexprs and defaults, in the kernel's order)."""

    __slots__ = ("run", "function", "metadata", "tail")

    def __init__(self, compiled, kernel, positional: int, constexprs: dict):
        self.run = compiled.run  # initializes the handles: the first launch already loaded the binary
        self.function = compiled.function
        self.metadata = compiled.packed_metadata
        parameters = list(inspect.signature(kernel.fn).parameters.values())[positional:]
        self.tail = tuple(constexprs[p.name] if p.name in constexprs else p.default for p in parameters)


# Compiled kernels by launch key. A few dozen keys in a training run (one per kernel, shape class
# and option set); emptied when it grows past _MAX_KEYS. A race between threads compiles one twice.
_COMPILED: dict[tuple, _Compiled] = {}
_MAX_KEYS = 4096


def _is_set(hook) -> bool:
    calls = getattr(hook, "calls", None)  # a chain of hooks (Triton 3.6): set when it holds any
    return bool(calls) if calls is not None else hook is not None


def _hooked() -> bool:
    return _RUNTIME is None or _is_set(_RUNTIME.launch_enter_hook) or _is_set(_RUNTIME.launch_exit_hook)


def launch(kernel, grid: tuple, *args, **constexprs) -> None:
    """`kernel[grid](*args, **constexprs)`: positional arguments are the kernel's runtime arguments
    (tensors, ints, floats, bools, None), keywords its constexprs and launch options."""
    device = torch.cuda.current_device()  # Triton launches on the current device, as kernel[grid] does
    key = (kernel, device, tuple(map(_argument_key, args)), tuple(constexprs.items()))
    compiled = _COMPILED.get(key)
    if compiled is None or _hooked():
        result = kernel[grid](*args, **constexprs)
        if hasattr(result, "result"):  # compiled asynchronously
            result = result.result()
        if not _hooked() and result is not None:
            if len(_COMPILED) >= _MAX_KEYS:
                _COMPILED.clear()
            _COMPILED[key] = _Compiled(result, kernel, len(args), constexprs)
        return
    x, y, z = (*grid, 1, 1)[:3]
    compiled.run(x, y, z, torch._C._cuda_getCurrentRawStream(device), compiled.function, compiled.metadata, None, None, None, *args, *compiled.tail)


def launch_key(*args) -> tuple:
    """The part of the launch key the runtime arguments make (for the test of its rule)."""
    return tuple(map(_argument_key, args))


def triton_specialization(kernel, *args, **constexprs) -> list:
    """Triton's own specialization of `args` for `kernel` (for the test of the launch key's rule)."""
    binder = kernel.device_caches[torch.cuda.current_device()][-1]
    _, specialization, _ = binder(*args, **constexprs)
    return specialization[: len(args)]
