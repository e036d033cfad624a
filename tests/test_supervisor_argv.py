"""`jitney serve` hands each child process the flags it was given."""

from __future__ import annotations

import argparse

import pytest

from jitney.scheduler.supervisor import child_argv
from jitney.worker.config import WorkerConfig, add_worker_arguments


def worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser


@pytest.mark.parametrize("flags,expected", [
    ([], None), (["--batch-invariant"], True), (["--no-batch-invariant"], False),
])
def test_boolean_flags_reach_the_worker_as_given(flags: list[str], expected: bool | None) -> None:
    parser = worker_parser()
    argv = child_argv(parser, parser.parse_args([*flags, "--dtype", "float32", "--threads", "2"]))
    again = WorkerConfig.from_namespace(parser.parse_args(argv))
    assert again.batch_invariant is expected
    assert (again.dtype, again.threads) == ("float32", 2)
