"""The GEMMs of quantized layers: `backends` multiplies two operand storages (C = A · Bᵀ) on the
fastest backend both offer a form for, or the fp32 reference; `dense` gives a linear layer's three
GEMMs over it. A grouped GEMM (one per expert of a mixture of experts) is a module beside `dense`
over the same backends."""

from .backends import BACKENDS, Backend, backend_counts, swizzle_scales
from .dense import dgrad, fprop, wgrad

__all__ = ["BACKENDS", "Backend", "backend_counts", "dgrad", "fprop", "swizzle_scales", "wgrad"]
