"""The CPU's batch-invariant kernels (C++ in csrc/, built at install or first use)."""
