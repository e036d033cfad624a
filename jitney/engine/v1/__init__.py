"""Generated from protos/jitney/engine/v1 (`make proto`); internal."""
