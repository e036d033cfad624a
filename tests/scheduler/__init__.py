"""Tests of the scheduler process (jitney.scheduler)."""
