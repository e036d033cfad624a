"""Loading weights: checkpoints, GGUF, the converted-weights cache."""
