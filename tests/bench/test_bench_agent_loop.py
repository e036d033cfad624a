"""bench/agent_loop.py's arithmetic: the per-turn summary and the tool results it feeds back."""

from __future__ import annotations

import pytest

from bench.agent_loop import Turn, summary, tool_result


def test_summary_fits_ttft_against_input_tokens() -> None:
    # Turn 1 cold; then TTFT = 100 ms + 50 ms per 1000 input tokens.
    turns = [Turn(1, 900.0, 1000.0, 50, 0, 8, 1)]
    turns += [Turn(n, 100.0 + 50.0 * (n * 200) / 1000, 500.0, n * 200, n * 200 - 40, 8, 1) for n in range(2, 7)]
    out = summary(turns)
    assert out["ttft_turn1_ms"] == 900.0
    assert out["ttft_ms_per_1k_input_tokens"] == pytest.approx(50.0)
    assert out["ttft_last_over_turn2"] == pytest.approx(160.0 / 120.0)
    assert out["ttft_median_turns_2_on_ms"] == pytest.approx(140.0)
    assert out["cached_fraction_turns_2_on"] == pytest.approx(1 - 5 * 40 / sum(n * 200 for n in range(2, 7)))


def test_tool_results_name_the_query_and_survive_bad_arguments() -> None:
    assert "'fares'" in tool_result(3, '{"query": "fares"}')
    assert "not json" in tool_result(3, "not json")
