"""Quantized data: numerics, storage, quantizers, QuantizedTensor, its ops, the kernel table."""
