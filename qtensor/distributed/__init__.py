"""Collectives on quantized tensors."""
