"""`jitney serve` hands each child process the flags it was given."""

from __future__ import annotations

import argparse

import pytest

from jitney.scheduler.launch.supervisor import child_argv
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


@pytest.mark.parametrize("flags,expected", [([], True), (["--no-weights-cache"], False)])
def test_store_false_flags_reach_the_worker_as_given(flags: list[str], expected: bool) -> None:
    # A store_false flag's default is True: re-created only when it was given
    # (passing it for its default turned the weights cache off in every child).
    parser = worker_parser()
    argv = child_argv(parser, parser.parse_args(flags))
    assert ("--no-weights-cache" in argv) is not expected
    assert WorkerConfig.from_namespace(parser.parse_args(argv)).use_weights_cache is expected


def test_serve_passes_dist_timeout_and_skinny_rows_to_its_workers() -> None:
    """`jitney serve --dist-timeout` reaches the ranks it starts (through `jitney worker`'s flags),
    as does the worker flag `--skinny-rows`."""
    from jitney.cli import build_parser

    parser = build_parser()
    serve = parser.parse_args(["serve", "--dist-timeout", "42", "--skinny-rows", "8"])
    work = parser._subparsers._group_actions[0].choices["worker"]  # type: ignore[union-attr]
    argv = child_argv(work, serve)
    again = WorkerConfig.from_namespace(work.parse_args(argv))
    assert (again.dist_timeout, again.skinny_rows) == (42.0, 8)
    assert "--tp-rank" not in argv   # the supervisor adds each rank's own


def test_cpu_attention_reaches_the_worker_and_a_bad_name_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    parser = worker_parser()
    argv = child_argv(parser, parser.parse_args(["--cpu-attention", "avx512"]))
    assert WorkerConfig.from_namespace(parser.parse_args(argv)).cpu_attention == "avx512"
    assert WorkerConfig.from_namespace(parser.parse_args(child_argv(parser, parser.parse_args([])))).cpu_attention == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--cpu-attention", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err
