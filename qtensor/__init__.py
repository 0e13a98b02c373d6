"""qtensor: quantized tensor subclasses for low-precision training in PyTorch."""

from .core import ops as _ops  # noqa: F401  (registers the format-independent dispatch ops)
from . import optim, recipes
from .checkpoint import load_file, load_model, save_file, save_model
from .formats.float8 import Float8Quantizer, Float8Tensor
from .formats.float8_block import Float8BlockQuantizer, Float8BlockTensor
from .formats.hybrid import HybridQuantizedTensor, HybridQuantizer
from .formats.identity import IdentityQuantizer, IdentityTensor
from .formats.mxfp8 import MXFP8Quantizer, MXFP8Tensor
from .formats.nvfp4 import NVFP4Quantizer, NVFP4Tensor
from .layers.dynamic_weight import DynamicWeight
from .layers.config import LinearQuantizers
from .quantize import QuantizeReport, dequantize_, keep_forward_copies_, quantize_
from .core.quantizer import Quantizer
from .recipes import Recipe, Role
from .schedule import Phase, PrecisionSchedule, Switch, forward_in
from .layers.routing import high_precision
from .core.tensor import QuantizedTensor, fallback_report, fallbacks
from . import legacy

legacy.install()  # the module paths files written before the layout by layer name

import qtensor_kernels  # noqa: E402
from .core import kernels as _kernels  # noqa: E402

# The Triton kernels register themselves into the core's table at its first CUDA lookup.
_kernels.set_loader(qtensor_kernels.register)

from .hf_registration import register_with_transformers  # noqa: E402

# transformers loads a qtensor checkpoint (quant_method "qtensor") after `import qtensor` alone.
register_with_transformers()

__all__ = [
    "DynamicWeight",
    "LinearQuantizers",
    "Phase",
    "PrecisionSchedule",
    "Switch",
    "forward_in",
    "QuantizeReport",
    "Recipe",
    "Role",
    "dequantize_",
    "keep_forward_copies_",
    "high_precision",
    "fallback_report",
    "fallbacks",
    "load_file",
    "load_model",
    "save_file",
    "save_model",
    "optim",
    "quantize_",
    "recipes",
    "Float8BlockQuantizer",
    "Float8BlockTensor",
    "Float8Quantizer",
    "Float8Tensor",
    "HybridQuantizedTensor",
    "HybridQuantizer",
    "IdentityQuantizer",
    "IdentityTensor",
    "MXFP8Quantizer",
    "MXFP8Tensor",
    "NVFP4Quantizer",
    "NVFP4Tensor",
    "Quantizer",
    "QuantizedTensor",
]
