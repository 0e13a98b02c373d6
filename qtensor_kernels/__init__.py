"""qtensor's Triton kernels, registered into the core's kernel table (qtensor/core/kernels.py) from
above: `import qtensor` hands `register` to the table, which runs it at its first CUDA lookup.

Each kernel module lists what it registers in `KERNELS` (table name -> function); `compiled.py`
lists the custom ops compiled graphs call in `WRAPPERS`. A machine without Triton registers nothing
and every operation runs its pure-torch reference, which is exact. Any other failure to import a
kernel module raises, naming the module and its cause: a kernel that silently went missing would
make every CUDA cast run the slow reference while the kernel-against-reference tests compared the
reference with itself.
"""

from __future__ import annotations

import importlib.util


class KernelImportError(ImportError):
    """A kernel module failed to import on a machine that has Triton."""


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def register() -> None:
    """Register every kernel into qtensor's table; nothing where Triton is not installed."""
    if not triton_available():
        return
    from qtensor.core import kernels as table

    try:
        from . import compiled, float8, float8_block, float8_groups, gemm, grouped_mm, hybrid, mxfp8, nvfp4, nvfp4_groups
    except ImportError as error:
        raise KernelImportError(
            f"qtensor_kernels: a kernel module failed to import ({type(error).__name__}: {error}). Triton is "
            "installed, so this is a broken kernel module, not a machine without kernels; without them every "
            "CUDA cast would run the slow reference. Fix the import, or set QTENSOR_KERNELS=reference to run "
            "the references on purpose."
        ) from error
    for module in (float8, float8_block, float8_groups, gemm, grouped_mm, hybrid, mxfp8, nvfp4, nvfp4_groups):
        for name, kernel in module.KERNELS.items():
            table.register(name, kernel)
    for name, wrapper in compiled.WRAPPERS.items():
        table.register_compiled(name, wrapper)
