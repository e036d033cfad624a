"""Triton kernels (CUDA, and the CPU under TRITON_INTERPRET=1) and their tuned configs."""
