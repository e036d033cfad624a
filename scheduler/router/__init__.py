"""The cache-aware router (`jitney router`): replicas, routing policy, its gRPC service."""
