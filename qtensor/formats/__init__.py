"""One module per format: its numerics, its storage, its tensor subclass and its quantizer."""
