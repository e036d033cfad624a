"""The model runner: the step, its input batch, sampling, the KV cache, CUDA graphs, warm-up."""
