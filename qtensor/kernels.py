"""Fast kernels for CUDA tensors: one table, every format (the kernels live in qtensor_kernels/).

Each entry is the fast twin of one pure-torch reference function and is bit-identical to it (tested
on the GPU). `lookup(name, tensor)` gives the kernel where it applies (a CUDA tensor, Triton
importable) and None otherwise; the caller then runs the reference, which stays the CPU path and
the oracle. `reference_kernels()` (or QTENSOR_KERNELS=reference) makes every eager lookup miss
(code torch.compile traces does not read it).

Traced by torch.compile, the Float8 and MXFP8 casts, their amaxes and dequantizes (`TRACED`) trace
their pure-torch references, which are exact under the compiler too (docs/compile.md), so inductor
fuses them with their neighbours: the amax into the producer's kernel (an RMSNorm, a SiLU·mul, a
residual add), the codes of both directions into one kernel. The other kernels reach the compiled
graph as custom ops (qtensor_kernels/compiled.py). QTENSOR_COMPILED_CASTS=custom_ops makes the
traced ones custom ops too (to compare the two).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
from typing import Callable

import torch
from torch._subclasses.fake_tensor import is_fake as _torch_is_fake


def is_fake(tensor) -> bool:
    """torch's `is_fake`, answered at once for a plain tensor that nothing wraps (the eager case)."""
    if type(tensor) is torch.Tensor and not torch._is_functional_tensor(tensor) and not torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        return False
    return _torch_is_fake(tensor)

# name → (module, function). The reference each one replaces is named beside it.
TABLE: dict[str, tuple[str, str]] = {
    "finite_amax": ("qtensor_kernels.float8", "finite_amax"),  # numerics.finite_amax
    # formats.float8: quantize_per_tensor (+ its transpose), with the current-scaling scale from
    # an amax (Float8Quantizer.compute_scale) and 1/scale computed in the kernel
    "float8.cast": ("qtensor_kernels.float8", "cast"),
    "float8.amax_partials": ("qtensor_kernels.float8", "amax_partials"),  # numerics.finite_amax, in parts
    "float8.delayed_scale": ("qtensor_kernels.float8", "delayed_scale"),  # Float8Quantizer.compute_scale, delayed
    "float8.record_amax": ("qtensor_kernels.float8", "record_amax"),  # Float8Quantizer.record_amax
    "float8.dequantize": ("qtensor_kernels.float8", "dequantize"),  # formats.float8.dequantize_per_tensor
    # formats.mxfp8: quantize_row_blocks of both directions, from one read
    "mxfp8.cast": ("qtensor_kernels.mxfp8", "cast"),
    "mxfp8.dequantize": ("qtensor_kernels.mxfp8", "dequantize"),  # formats.mxfp8.dequantize_row_blocks
    # formats.nvfp4: quantize_row_blocks of both directions (tiles, transform and stochastic
    # rounding included), from one read
    "nvfp4.cast": ("qtensor_kernels.nvfp4", "cast"),
    "nvfp4.amaxes": ("qtensor_kernels.nvfp4", "amaxes"),  # numerics.finite_amax of x and of apply_rht(x.t())
    "nvfp4.dequantize": ("qtensor_kernels.nvfp4", "dequantize"),  # formats.nvfp4.dequantize_row_blocks
    # formats.hybrid: the MXFP8 rowwise and NVFP4 columnwise children's casts, from one read
    "hybrid.cast": ("qtensor_kernels.hybrid", "cast"),
    # formats.float8_block: quantize_blocks of both copies, from one read
    "float8_block.cast": ("qtensor_kernels.float8_block", "cast"),
    "gemm.scale_output": ("qtensor_kernels.gemm", "scale_output"),  # gemm._scale_and_finish
}

# The kernels whose reference the compiler traces and fuses (see the module's docstring).
TRACED = frozenset({"finite_amax", "float8.cast", "float8.amax_partials", "float8.dequantize", "mxfp8.cast", "mxfp8.dequantize"})
_traced_under_compile = os.environ.get("QTENSOR_COMPILED_CASTS", "traced") != "custom_ops"

# A switch (per thread and task): QTENSOR_KERNELS=reference sets it for the whole process.
_forced_reference = contextvars.ContextVar("qtensor_reference_kernels", default=os.environ.get("QTENSOR_KERNELS", "") == "reference")


@contextlib.contextmanager
def reference_kernels():
    """Inside, every operation runs its pure-torch reference, also on CUDA tensors."""
    token = _forced_reference.set(True)
    try:
        yield
    finally:
        _forced_reference.reset(token)


def lookup(name: str, tensor) -> Callable | None:
    if tensor.device.type != "cuda":
        return None
    compiling = torch.compiler.is_compiling()
    # Not read while torch.compile traces (dynamo cannot trace ContextVar.get): the switch governs
    # eager calls, and a graph compiled inside it still calls the kernels below.
    if not compiling and _forced_reference.get():
        return None
    if compiling or is_fake(tensor):
        # Traced by torch.compile: the reference of a TRACED kernel, which inductor fuses; any other
        # kernel as a custom op (qtensor_kernels/compiled.py), which the compiled graph calls.
        if name in TRACED and _traced_under_compile:
            return None
        return _compiled_wrappers().get(name)
    if name not in _resolved:
        module_name, function = TABLE[name]
        try:
            _resolved[name] = getattr(importlib.import_module(module_name), function)
        except ImportError:  # no Triton: the reference is exact, only slower
            _resolved[name] = None
    return _resolved[name]


# Caches of imported kernels: filled once per name; a race between threads imports the same function twice.
_resolved: dict[str, Callable | None] = {}


def _compiled_wrappers() -> dict[str, Callable]:
    if _compiled[0] is None:
        try:  # by name, as TABLE's kernels: the kernels build on the formats, not the other way round
            WRAPPERS = importlib.import_module("qtensor_kernels.compiled").WRAPPERS
        except ImportError:  # no Triton
            WRAPPERS = {}
        _compiled[0] = WRAPPERS
    return _compiled[0]


_compiled: list = [None]  # a cache, as _resolved
