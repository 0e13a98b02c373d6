"""qtensor's quantization method registered with `transformers` by `import qtensor` alone.

`transformers` knows `quant_method: "qtensor"` in a checkpoint's `config.json` only once
`qtensor.hf` has registered it. `import qtensor` calls `register_with_transformers()`: where
`transformers` is already imported, `qtensor.hf` is imported at once; where it is installed but not
yet imported, a finder on `sys.meta_path` imports `qtensor.hf` right after `transformers` itself has
been executed (a probe that only finds its spec leaves the finder in place), so a process that
never imports transformers pays nothing for it. Where neither applies (transformers not
installed), nothing happens.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings


def register_with_transformers() -> None:
    """Register qtensor with transformers now, or as soon as transformers is imported."""
    if "transformers" in sys.modules:
        _register()
    elif not any(isinstance(finder, _AfterTransformers) for finder in sys.meta_path) and _installed("transformers"):
        sys.meta_path.insert(0, _AfterTransformers())


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _register() -> None:
    try:
        from . import hf  # noqa: F401 (registers quant_method "qtensor" as it is imported)
    except Exception as error:  # an incompatible transformers: importing it must still work
        warnings.warn(
            f"qtensor could not register its quantization method with transformers ({type(error).__name__}: {error}); "
            "from_pretrained of a qtensor checkpoint will refuse it until `import qtensor.hf` succeeds.",
            stacklevel=2,
        )


class _AfterTransformers(importlib.abc.MetaPathFinder):
    """Finds `transformers` through the other finders and has its module register qtensor once it
    has been executed. A spec only asked for (`importlib.util.find_spec("transformers")`, as
    libraries probe for it) executes nothing, so the finder stays until transformers is imported."""

    def __init__(self):
        self._finding = False  # its own search for the spec must not come back to it

    def find_spec(self, name, path=None, target=None):
        if name != "transformers" or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def execute_then_register(module):
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            execute(module)
            _register()

        spec.loader.exec_module = execute_then_register  # this spec's own loader, made for this search
        return spec
