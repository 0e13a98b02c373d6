"""The kernel table is filled from above (qtensor_kernels registers into qtensor.core.kernels), and a
kernel module that fails to import raises with its cause instead of leaving the reference to run."""

import importlib.abc
import importlib.util
import sys

import pytest
import torch

import qtensor  # noqa: F401  (hands the table its loader)
import qtensor_kernels
from qtensor.core import kernels


class _BrokenKernelModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `qtensor_kernels.float8` as a module whose import fails the way a renamed symbol makes it fail."""

    def find_spec(self, fullname, path, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname == "qtensor_kernels.float8" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        exec("from qtensor.formats.float8 import Float8StorageRenamed", module.__dict__)


@pytest.fixture
def fresh_table(monkeypatch):
    """A table that has not loaded yet, restored afterwards."""
    monkeypatch.setattr(kernels, "TABLE", kernels.KernelTable())
    kernels.set_loader(qtensor_kernels.register)
    return kernels.TABLE


def test_a_kernel_module_that_fails_to_import_raises_with_its_cause(fresh_table, monkeypatch):
    monkeypatch.setattr(qtensor_kernels, "triton_available", lambda: True)
    for name in [n for n in sys.modules if n.startswith("qtensor_kernels.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_BrokenKernelModule(), *sys.meta_path])
    with pytest.raises(qtensor_kernels.KernelImportError, match="failed to import") as raised:
        kernels.registered()
    cause = raised.value.__cause__
    assert isinstance(cause, ImportError) and "Float8StorageRenamed" in str(cause)
    assert not fresh_table.loaded and not fresh_table.eager  # nothing half-registered, and the next lookup tries again


def test_without_triton_nothing_registers_and_the_reference_runs(fresh_table, monkeypatch):
    monkeypatch.setattr(qtensor_kernels, "triton_available", lambda: False)
    assert kernels.registered() == frozenset()
    assert fresh_table.loaded


def test_a_name_outside_the_table_is_refused():
    with pytest.raises(KeyError, match="no kernel named 'float8.cats'"):
        kernels.register("float8.cats", lambda x: x)


def test_a_cpu_lookup_finds_no_kernel_and_loads_none(fresh_table):
    """The kernels are for CUDA tensors: a CPU lookup answers None without running the loader."""
    assert kernels.lookup("float8.cast", torch.ones(2)) is None
    assert not fresh_table.loaded
