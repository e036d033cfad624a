"""Fixtures shared across test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.server_harness import Server, running_server

# The test files that take longest (seconds, all their tests, a clean-clone run on 2 cores,
# 2026-11-27), in that order. `make test` runs two pytest-xdist workers a file at a time in
# collection order (--no-loadscope-reorder: xdist would otherwise order files by their number
# of tests, which left the 78 s soak to start near the end while the other worker idled).
# The longest files start first, and the two workers finish together.
LONGEST_FILES = (
    "test_soak.py",               # 78
    "test_server_parity.py",      # 72
    "test_bench_gpu.py",          # 67
    "test_batch_invariance.py",   # 64
    "test_triton_worker.py",      # 58
    "test_triton_kernels.py",     # 222 with an empty Triton cache (its PTX compiles), a few s cached
    "test_tensor_parallel.py",    # 46
    "test_unsupported_model.py",  # 41 (2026-12-02, run alone)
    "test_families.py",           # 50 (2026-12-02, run alone on an AMX machine; more families since)
    "test_families_gguf.py",      # 183 under load (2026-12-02)
    "test_worker_model.py",       # 38
    "test_production.py",         # 32
    "test_security_flags.py",     # 25 (test_security.py before its split: the real `jitney serve`)
    "test_e2e_router.py",         # 25
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first (``LONGEST_FILES``); the others after, in their own order."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`jitney serve` with no flags (the bundled default model, its default
    dtype and limits), started once for every test that needs it: its start
    is the slowest in the suite. Tests must leave it idle (every request
    ended) and may not assume fresh counters."""
    with running_server([], tmp_path_factory.mktemp("default-server")) as server:
        yield server
