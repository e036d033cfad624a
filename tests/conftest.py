"""Fixtures shared across test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.server_harness import Server, running_server


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`jitney serve` with no flags (the bundled default model, its default
    dtype and limits), started once for every test that needs it: its start
    is the slowest in the suite. Tests must leave it idle (every request
    ended) and may not assume fresh counters."""
    with running_server([], tmp_path_factory.mktemp("default-server")) as server:
        yield server
