"""The module paths files written before qtensor's layout by layer still name.

A pickle (`torch.save(model)`, `pickle.dump`, a `weights_only` state_dict) stores each class and
function it holds by module path: `qtensor.layer.LinearQuantizers`, `qtensor.weight.
_rebuild_quantized_weight`, the forward hooks `quantize_` installs (`qtensor.tensor_parallel.enter`).
Those modules now live in folders (docs/architecture.md); each old path is registered here as a
module that forwards every name to the module holding it today, so such files load (tested on files
written before the move, tests/test_legacy_files.py). safetensors files, DCP checkpoints and
`save_pretrained` directories name no module and need none of this.
"""

from __future__ import annotations

import importlib
import sys
import types

import torch

# old module -> the modules that hold its names now, searched in order
MODULES: dict[str, tuple[str, ...]] = {
    "qtensor.numerics": ("qtensor.core.numerics",),
    "qtensor.kernels": ("qtensor.core.kernels",),
    "qtensor.storage": ("qtensor.core.storage",),
    "qtensor.quantizer": ("qtensor.core.quantizer",),
    "qtensor.plan": ("qtensor.core.plan",),
    "qtensor.tensor": ("qtensor.core.tensor",),
    "qtensor.ops": ("qtensor.core.ops",),
    "qtensor.running_state": ("qtensor.core.running_state",),
    "qtensor.packing": ("qtensor.distributed.packing",),
    "qtensor.fsdp": ("qtensor.distributed.fsdp",),
    "qtensor.sequence_parallel": ("qtensor.distributed.sequence_parallel", "qtensor.distributed.tensor_parallel"),
    "qtensor.layer": ("qtensor.layers.config",),
    "qtensor.linear": ("qtensor.layers.linear",),
    "qtensor.routing": ("qtensor.layers.routing",),
    "qtensor.attention": ("qtensor.layers.attention",),
    "qtensor.layer_state": ("qtensor.layers.traced_state",),
    "qtensor.weight": ("qtensor.layers.weight",),
    "qtensor.dynamic_weight": ("qtensor.layers.dynamic_weight",),
    "qtensor.tensor_parallel": ("qtensor.distributed.tensor_parallel",),
    "qtensor.recipe": ("qtensor.recipes",),
    "qtensor.formats_table": ("qtensor.demo.formats_table",),
}


def _forwarding_module(old: str, homes: tuple[str, ...]) -> types.ModuleType:
    module = types.ModuleType(old, f"Moved: the names of {old} now live in {', '.join(homes)}.")

    def forward(name: str):
        for home in homes:
            target = importlib.import_module(home)
            if hasattr(target, name):
                return getattr(target, name)
        raise AttributeError(f"module {old!r} (moved to {', '.join(homes)}) has no attribute {name!r}")

    module.__getattr__ = forward  # PEP 562: looked up for every name the module does not hold
    module.__path__ = []  # a package to the import system, so `import qtensor.weight` finds it as is
    return module


def install() -> None:
    """Register every old path that no module of the package holds any more."""
    for old, homes in MODULES.items():
        sys.modules.setdefault(old, _forwarding_module(old, homes))
    # A state_dict saved for `torch.load(weights_only=True)` names its quantized tensors' rebuild
    # function by its old path; torch's safe list matches names, so the function is listed under it too.
    from .core.tensor import _rebuild_quantized_tensor

    torch.serialization.add_safe_globals([(_rebuild_quantized_tensor, "qtensor.tensor._rebuild_quantized_tensor")])
