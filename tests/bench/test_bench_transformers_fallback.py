"""bench/transformers_fallback.py: a tiny run of both paths gives every row, and its
forcing of the fallback is undone after."""

from __future__ import annotations

import pytest

from jitney.worker.loading import loader


@pytest.mark.slow
def test_smoke_run_measures_both_paths(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import transformers_fallback as bench

    chosen = loader.family_for
    assert bench.main(["--dtype", "float32", "--batch", "1", "2", "--prefill", "16", "--context", "8",
                       "--reps", "2", "--hidden", "64", "--layers", "2", "--vocab", "320"]) == 0
    assert loader.family_for is chosen
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| float32")]
    assert [r[1].strip() for r in rows] == ["decode 1", "decode 2", "prefill 16"]
    for _, _, native, slow, ratio in rows:
        assert float(native) > 0 and float(slow) > 0
        # The ms columns are rounded to 0.1 (sub-ms steps here): the ratio of the unrounded
        # times lies within the ratios the rounding allows.
        n, t = float(native), float(slow)
        assert (t - 0.05) / (n + 0.05) - 0.01 <= float(ratio) <= (t + 0.05) / max(n - 0.05, 1e-9) + 0.01
