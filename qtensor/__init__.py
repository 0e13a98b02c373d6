"""qtensor: quantized tensor subclasses for low-precision training in PyTorch."""

from . import ops as _ops  # noqa: F401  (registers the format-independent dispatch ops)
from . import optim, recipes
from .checkpoint import load_file, load_model, save_file, save_model
from .formats.float8 import Float8Quantizer, Float8Tensor
from .formats.float8_block import Float8BlockQuantizer, Float8BlockTensor
from .formats.hybrid import HybridQuantizedTensor, HybridQuantizer
from .formats.identity import IdentityQuantizer, IdentityTensor
from .formats.mxfp8 import MXFP8Quantizer, MXFP8Tensor
from .formats.nvfp4 import NVFP4Quantizer, NVFP4Tensor
from .dynamic_weight import DynamicWeight
from .layer import LinearQuantizers
from .quantize import QuantizeReport, dequantize_, quantize_
from .quantizer import Quantizer
from .recipe import Recipe, Role
from .routing import high_precision
from .tensor import QuantizedTensor, fallback_report, fallbacks

__all__ = [
    "DynamicWeight",
    "LinearQuantizers",
    "QuantizeReport",
    "Recipe",
    "Role",
    "dequantize_",
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
