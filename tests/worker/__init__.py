"""Tests of the worker process (jitney.worker)."""
