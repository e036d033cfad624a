"""Tests of the benchmark scripts (bench/) and `jitney bench`."""
