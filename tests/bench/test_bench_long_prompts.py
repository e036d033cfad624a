"""bench/long_prompts.py: its workload and the prefill rates it reads from a step trace."""

from __future__ import annotations

import math

from bench.long_prompts import prefill_rates, workload


def step(prefill: int, decode: int, keys: int, model_s: float) -> dict[str, float]:
    return {"prefill_tokens": prefill, "decode_tokens": decode, "attended_keys": keys, "model_s": model_s}


def test_the_workload_is_fixed_and_in_the_models_id_range() -> None:
    items = workload(3, 50, 7)
    assert items == workload(3, 50, 7)
    assert [len(i.prompt_token_ids) for i in items] == [50] * 3 and {i.max_tokens for i in items} == {7}
    assert all(100 <= t < 49_000 for i in items for t in i.prompt_token_ids)
    assert {i.arrival_s for i in items} == {0.0} and len({tuple(i.prompt_token_ids) for i in items}) == 3


def test_prefill_rates_band_steps_by_keys_a_token_attends() -> None:
    trace = [
        step(512, 0, 512 * 257, 0.2),          # first chunk: 257 keys a token -> short
        step(512, 2, 512 * 800 + 2 * 600, 9.0),  # in between: neither band
        step(440, 8, 440 * 2780 + 8 * 3000, 0.4),  # last chunk -> long
        step(500, 0, 500 * 2600, 0.5),         # long
        step(0, 8, 8 * 3000, 0.01),            # decodes only: no prefill
    ]
    r = prefill_rates(trace)
    assert (r["short_steps"], r["long_steps"]) == (1, 2)
    assert r["short_tok_s"] == 2560.0
    assert r["long_tok_s"] == round(940 / 0.9, 1)
    assert r["long_over_short"] == round((940 / 0.9) / 2560, 3)
    assert math.isnan(prefill_rates(trace[:1])["long_tok_s"])
