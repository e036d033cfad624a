"""The scheduler's core: the engine loop, the scheduling policy, the block manager, requests, plans and the worker link."""
