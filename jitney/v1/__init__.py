"""Jitney's public API, generated from protos/jitney/v1 (`make proto`). Clients import it."""
