"""The benchmark workloads (JSONL) and their generator, generate.py."""
