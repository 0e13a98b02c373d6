"""What a quantized layer does."""
