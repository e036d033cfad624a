"""Tensor parallelism: the process group and weight sharding."""
