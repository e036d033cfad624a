"""Jitney's tests: one folder per part of the source, shared helpers in tests/support/."""
