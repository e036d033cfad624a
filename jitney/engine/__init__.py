"""The internal scheduler <-> worker contract. Only jitney.scheduler and jitney.worker import it."""
