"""Kernels: the CPU's batch-invariant C++ extension and the Triton kernels."""
