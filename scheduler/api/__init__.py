"""What every door shares: the servicer, validation, metrics; the doors themselves (gRPC, HTTP)."""
