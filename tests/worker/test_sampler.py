"""The sampler: greedy, temperature, top-k, top-p, and seeded determinism."""

from __future__ import annotations

import pytest
import torch

from jitney.worker.runner.input_batch import InputBatch, StepChunk
from jitney.worker.runner.sampler import RowGroups, SamplingBatch, _fmix32_, _mul32_, sample, uniform_noise

CPU = torch.device("cpu")


def params(
    n: int,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seeds: list[int] | None = None,
    positions: list[int] | None = None,
) -> SamplingBatch:
    return SamplingBatch.from_lists(
        temperature=[temperature] * n,
        top_p=[top_p] * n,
        top_k=[top_k] * n,
        seed=seeds if seeds is not None else list(range(n)),
        position=positions if positions is not None else [0] * n,
        device=CPU,
    )


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_is_argmax_with_raw_logprobs() -> None:
    logits = random_logits(6, 500)
    tokens, logprobs = sample(logits, params(6, temperature=0.0))
    assert torch.equal(tokens, logits.argmax(-1))
    expected = logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected)


def test_top_k_one_is_greedy() -> None:
    logits = random_logits(8, 1000, seed=1)
    tokens, _ = sample(logits, params(8, temperature=1.5, top_k=1))
    assert torch.equal(tokens, logits.argmax(-1))


def test_same_seed_and_position_same_token_whatever_the_batch() -> None:
    logits = random_logits(1, 2000, seed=2, scale=1.0)
    alone, _ = sample(logits, params(1, top_p=0.95, seeds=[1234], positions=[17]))
    # The same row placed among strangers, at different indices.
    others = random_logits(9, 2000, seed=3, scale=1.0)
    for where in (0, 4, 9):
        batch = torch.cat([others[:where], logits, others[where:]])
        seeds = [7] * where + [1234] + [8] * (9 - where)
        positions = [3] * where + [17] + [5] * (9 - where)
        got, _ = sample(batch, params(10, top_p=0.95, seeds=seeds, positions=positions))
        assert got[where] == alone[0]


def test_different_seeds_and_positions_differ() -> None:
    logits = torch.zeros(1, 1000)  # uniform: the draw is decided by the noise alone
    by_seed = {int(sample(logits, params(1, seeds=[s]))[0]) for s in range(20)}
    by_position = {int(sample(logits, params(1, positions=[p]))[0]) for p in range(20)}
    assert len(by_seed) > 10 and len(by_position) > 10


def test_64_bit_seeds_use_their_high_bits() -> None:
    p = params(2, seeds=[5, 5 + (1 << 40)])
    noise = uniform_noise(p.seed_lo, p.seed_hi, p.position, torch.arange(100))
    assert not torch.equal(noise[0], noise[1])


def test_top_p_never_picks_outside_the_nucleus() -> None:
    # probabilities 0.5, 0.3, 0.15, then a long tail of 0.05 in total.
    head = torch.tensor([0.5, 0.3, 0.15])
    tail = torch.full((997,), 0.05 / 997)
    logits = torch.cat([head, tail]).log()[None].repeat(2000, 1)
    tokens, _ = sample(logits, params(2000, top_p=0.9, seeds=list(range(2000))))
    # 0.5 + 0.3 < 0.9 <= 0.95: the nucleus is exactly the first three tokens.
    assert set(tokens.tolist()) == {0, 1, 2}


def test_top_k_keeps_k_tokens() -> None:
    logits = torch.linspace(0, 1, 300)[None].repeat(1000, 1)
    tokens, _ = sample(logits, params(1000, temperature=5.0, top_k=4, seeds=list(range(1000))))
    assert set(tokens.tolist()) == {296, 297, 298, 299}


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.9), (5, 1.0), (300, 0.95), (0, 0.5), (50, 0.7), (2000, 0.8)])
def test_candidate_shortcut_never_changes_the_result(top_k: int, top_p: float) -> None:
    # Rows range from flat (nucleus beyond any shortlist) to peaked.
    logits = random_logits(64, 1000, seed=4, scale=1.0) * torch.linspace(0.1, 6, 64)[:, None]
    p = params(64, temperature=0.9, top_k=top_k, top_p=top_p, seeds=list(range(64)), positions=[7] * 64)
    short, _ = sample(logits, p, candidates=8)
    full, _ = sample(logits, p, candidates=1000)
    assert torch.equal(short, full)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.0, 0.999)])
def test_draws_follow_the_softmax(temperature: float, top_p: float) -> None:
    vocab, draws = 8, 20000
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]]).repeat(draws, 1)
    # One sequence over many positions, as in real decoding.
    p = params(draws, temperature=temperature, top_p=top_p, seeds=[99] * draws, positions=list(range(draws)))
    tokens, _ = sample(logits, p)
    counts = torch.bincount(tokens, minlength=vocab).float()
    expected = (logits[0] / temperature).softmax(-1) * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 7 degrees of freedom: p(chi2 > 30) < 1e-4.
    assert chi2 < 30, (counts, expected)


def test_uniform_noise_is_uniform_and_open() -> None:
    u = uniform_noise(torch.tensor([1, 2]), torch.tensor([0, 3]), torch.tensor([10, 10]), torch.arange(50000))
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005


def test_hash_matches_python_reference() -> None:
    def fmix32(h: int) -> int:  # murmur3, on Python ints
        h ^= h >> 16
        h = (h * 0x85EBCA6B) % 2**32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) % 2**32
        return h ^ (h >> 16)

    edge = [0, 1, 0xFFFF, 0x10000, 2**31 - 1, 2**31, 0xDEADBEEF, 2**32 - 1]
    x = torch.tensor(edge + torch.randint(0, 2**32, (500,), generator=torch.Generator().manual_seed(0)).tolist())
    for c in (0x85EBCA6B, 0xC2B2AE35, 12345):
        assert _mul32_(x.clone(), c, torch.empty_like(x)).tolist() == [(v * c) % 2**32 for v in x.tolist()]
    assert _fmix32_(x.clone()).tolist() == [fmix32(v) for v in x.tolist()]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_host_row_groups_sample_the_same_tokens(device: str) -> None:
    """Row groups staged from the host (no sync), with either sort, give the on-device groups' tokens."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    temperature, top_p, top_k = [0.0, 0.9, 0.7, 1.2, 0.5], [1.0, 1.0, 0.8, 1.0, 0.95], [0, 0, 0, 5, 40]
    dev = torch.device(device)
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0)).to(dev) * 3
    params = SamplingBatch.from_lists(temperature=temperature, top_p=top_p, top_k=top_k,
                                      seed=[1, 2, 3, 4, 5], position=[7, 8, 9, 10, 11], device=dev)
    batch = InputBatch(max_num_seqs=8, max_num_tokens=16, max_blocks_per_seq=2, block_size=4, device=dev)
    for row, (t, p, k) in enumerate(zip(temperature, top_p, top_k)):
        batch.add(row, t, p, k, seed=row + 1)
    step = batch.stage([StepChunk(row, 0, [1], sample=True, plan_index=row) for row in range(5)])
    _, staged_params, groups = batch.sampling(step)
    assert groups.full_sort == (device == "cuda")  # the CPU tries the top candidates first
    assert groups.plain.tolist() == [1] and groups.filtered.tolist() == [2, 3, 4]
    torch.testing.assert_close(staged_params.temperature, params.temperature)
    assert torch.equal(staged_params.seed_lo, params.seed_lo) and torch.equal(staged_params.top_k, params.top_k)
    want = sample(logits, params)
    for rows in (groups, RowGroups(groups.plain, groups.filtered, full_sort=not groups.full_sort)):
        got = sample(logits, params, rows)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])


def test_uniform_noise_never_reaches_one() -> None:
    """The 24-bit version rounded (2**24 - 1) + 0.5 up to 2**24 in float32: U = 1,
    infinite Gumbel noise. Seed 72, position 36, token 42583 drew exactly that."""
    u = uniform_noise(torch.tensor([72]), torch.tensor([0]), torch.tensor([36]), torch.arange(49152))
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0
    assert float(u[0, 42583]) == 1.0 - 2.0**-24     # the top of the range, no longer 1
