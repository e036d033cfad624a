"""Tests of the code both processes share (jitney.common)."""
