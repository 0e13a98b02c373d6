"""The GEMMs of quantized layers: `backends` multiplies two operand storages (C = A · Bᵀ) on the
fastest backend both offer a form for, or the fp32 reference; `dense` gives a linear layer's three
GEMMs over it; `grouped` the three GEMMs of an expert stack, one product per group of rows, over
the same backends."""

from . import grouped
from .backends import BACKENDS, Backend, backend_counts, swizzle_scales
from .dense import dgrad, fprop, wgrad

__all__ = ["BACKENDS", "Backend", "backend_counts", "dgrad", "fprop", "grouped", "swizzle_scales", "wgrad"]
