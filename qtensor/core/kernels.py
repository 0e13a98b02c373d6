"""Fast kernels for CUDA tensors: one table, every format, filled from above.

Each entry is the fast twin of one pure-torch reference function and is bit-identical to it (tested
on the GPU). The kernels live in the package `qtensor_kernels`, which builds on the formats; the
core never imports it. `import qtensor` hands this table a loader (`qtensor_kernels.register`),
which runs once, at the first lookup for a CUDA tensor, and registers each kernel under its name
(`register`, `register_compiled`). `lookup(name, tensor)` then gives the kernel where it applies
(a CUDA tensor, a kernel registered under the name) and None otherwise; the caller runs the
reference, which stays the CPU path and the oracle. Only a machine without Triton registers none;
a kernel module that fails to import for any other reason raises from the loader, with its cause.
`reference_kernels()` (or QTENSOR_KERNELS=reference) makes every eager lookup miss (code
torch.compile traces does not read it).

Traced by torch.compile, the Float8 and MXFP8 casts, their amaxes and dequantizes, NVFP4's
dequantize and the GEMM epilogue without a bias (`TRACED`) trace their pure-torch references,
which are exact under the compiler too (docs/compile.md), so inductor fuses them with their
neighbours: the amax into the producer's kernel (an RMSNorm, a SiLU·mul, a residual add), the
codes of both directions into one kernel. The other kernels reach the compiled graph as custom ops
(`register_compiled`). QTENSOR_COMPILED_CASTS=custom_ops makes the traced ones custom ops too (to
compare the two).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from typing import Callable

import torch
from torch._subclasses.fake_tensor import is_fake as _torch_is_fake


def is_fake(tensor) -> bool:
    """torch's `is_fake`, answered at once for a plain tensor that nothing wraps (the eager case)."""
    if type(tensor) is torch.Tensor and not torch._is_functional_tensor(tensor) and not torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        return False
    return _torch_is_fake(tensor)


# The names a kernel may be registered under, each with the reference it replaces.
REFERENCES: dict[str, str] = {
    "finite_amax": "core.numerics.finite_amax",
    "float8.cast": "core.numerics.quantize_per_tensor (+ its transpose), with Float8Quantizer.compute_scale and 1/scale",
    "float8.amax_partials": "core.numerics.finite_amax, in parts",
    "float8.delayed_scale": "Float8Quantizer.compute_scale, delayed",
    "float8.record_amax": "Float8Quantizer.record_amax",
    "float8.dequantize": "formats.float8.dequantize_per_tensor",
    "float8.transpose": "out.copy_(codes.t()): Float8Storage's other direction",
    "mxfp8.cast": "formats.mxfp8.quantize_row_blocks of both directions, from one read",
    "mxfp8.dequantize": "formats.mxfp8.dequantize_row_blocks",
    "mxfp8.cast_values": "mxfp8.cast, a direction asked for as values giving MXFP8Storage.dequantize_as(bf16) of its copy instead",
    "nvfp4.cast": "formats.nvfp4.quantize_row_blocks of both directions (tiles, transform, stochastic rounding)",
    "nvfp4.amaxes": "core.numerics.finite_amax of x and of apply_rht(x.t())",
    "nvfp4.dequantize": "formats.nvfp4.dequantize_row_blocks",
    "hybrid.cast": "formats.hybrid: the MXFP8 rowwise and NVFP4 columnwise children's casts, from one read",
    "float8_block.cast": "formats.float8_block.quantize_blocks of both copies, from one read",
    "float8_groups.column_amax": "formats.float8_groups._column_amax: each group's column amaxes",
    "float8_groups.cast": "formats.float8_groups._cast: each group's codes at its column scales, rowwise and padded columnwise",
    "float8_groups.scales": "core.numerics.current_scale of the amaxes, and exact_quotient(1.0, ·) of them",
    "gemm.scale_output": "gemm.backends._scale_and_finish, without a bias",
    "gemm.scale_bias_output": "gemm.backends._scale_and_finish, with a bias",
    "grouped_mm.float8_rows": "torch._scaled_grouped_mm of FP8 rows and a stack, split accumulator (fprop, dgrad)",
    "grouped_mm.float8_columns": "torch._scaled_grouped_mm of two columnwise copies, split accumulator (wgrad)",
    "grouped_mm.bf16_rows": "gemm.grouped.values_nt of rows and a stack, times each group's factor (fprop, dgrad)",
    "grouped_mm.bf16_columns": "gemm.grouped.values_nt of two columnwise copies, times each group's factor (wgrad)",
    "nvfp4_groups.amaxes": "formats.nvfp4_groups: each group's finite amax, and of its transformed columnwise copy",
    "nvfp4_groups.cast": "formats.nvfp4_groups._cast_each: each group's nvfp4 cast of both directions",
}

# The kernels whose reference the compiler traces and fuses (see the module's docstring).
TRACED = frozenset({
    "finite_amax", "float8.cast", "float8.amax_partials", "float8.dequantize", "float8.transpose", "mxfp8.cast", "mxfp8.dequantize",
    "nvfp4.dequantize", "gemm.scale_output",
})
# (Not "gemm.scale_bias_output": inductor contracts the product's scaling and the bias add into one
# fused multiply-add, one rounding where the reference has two; its custom op keeps both.)
_traced_under_compile = os.environ.get("QTENSOR_COMPILED_CASTS", "traced") != "custom_ops"


def skipped_by_compiler(fn: Callable, *, recursive: bool = True) -> Callable:
    """`torch.compiler.disable(fn, recursive=...)` without the wrapper it puts around `fn`: the code
    of `fn` is marked for torch.compile's frame hook to run as it is (with `recursive`, the frames
    it calls too), and a graph that traces into `fn` breaks there, as at a disabled function. For
    functions compiled code calls at every step, where the wrapper's cost counts: a quantized
    tensor's `__getattr__`, which reads its inner tensors for the graph's guards and inputs."""
    try:
        from torch._dynamo.eval_frame import FrameAction, FrameExecStrategy, set_code_exec_strategy
    except ImportError:  # a torch without per-code strategies: the wrapper
        return torch.compiler.disable(fn, recursive=recursive)
    nested = FrameAction.SKIP if recursive else FrameAction.DEFAULT
    set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, nested))
    fn._torchdynamo_disable = True  # what tracing reads: do not inline, break the graph here
    return fn


class KernelTable:
    """The registered kernels (eager, and as custom ops for compiled graphs) and the loader that fills
    them, run once under a lock by the first CUDA lookup."""

    def __init__(self):
        self.eager: dict[str, Callable] = {}
        self.compiled: dict[str, Callable] = {}
        self.loader: Callable[[], None] | None = None
        self.loaded = False
        self.lock = threading.Lock()

    # Run eagerly even when the first lookup comes while torch.compile traces (a model compiled
    # before any eager step): one graph break there, never a lock or an import inside a graph.
    @torch.compiler.disable
    def load(self) -> None:
        with self.lock:
            if self.loaded:
                return
            if self.loader is not None:
                self.loader()
            self.loaded = True


TABLE = KernelTable()


def set_loader(loader: Callable[[], None]) -> None:
    """The function that registers the kernels, run at the first lookup for a CUDA tensor (`import
    qtensor` sets it). It may raise; the next lookup then runs it again."""
    TABLE.loader, TABLE.loaded = loader, False


def _checked(name: str) -> str:
    if name not in REFERENCES:
        raise KeyError(f"no kernel named {name!r} in qtensor's kernel table; the names are {sorted(REFERENCES)}.")
    return name


def register(name: str, kernel: Callable) -> None:
    """`kernel` as the eager fast path of `name` (one of `REFERENCES`)."""
    TABLE.eager[_checked(name)] = kernel


def register_compiled(name: str, wrapper: Callable) -> None:
    """`wrapper` (a custom op with the eager kernel's signature) as what compiled graphs call for `name`."""
    TABLE.compiled[_checked(name)] = wrapper


def registered() -> frozenset[str]:
    """The names with an eager kernel, once the loader has run (loaded now if it has not)."""
    TABLE.load()
    return frozenset(TABLE.eager)


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
    if not TABLE.loaded:
        TABLE.load()
    if compiling or is_fake(tensor):
        # Traced by torch.compile: the reference of a TRACED kernel, which inductor fuses; any other
        # kernel as a custom op, which the compiled graph calls.
        if name in TRACED and _traced_under_compile:
            return None
        return TABLE.compiled.get(name)
    return TABLE.eager.get(name)
