"""Decode steps replayed from CUDA graphs, one per batch size of a ladder.

Each graph is captured around the whole decode forward plus the logits,
reading its inputs from the persistent batch's staging buffer (fixed
device addresses). Block tables and slot mapping are computed inside the
graph from that buffer, so a replay needs only the step's one host-to-device
copy. A decode-only step of ``n`` sequences is padded to the next captured
size ``m``:

    # rows [0, n)   -> the step's decodes
    # rows [n, m)   -> padding: token row -1 (slot -1: the cache write skips it),
    #                  seq_len 0 (attention reads nothing), logits unused

Steps with prefill chunks of up to ``MIXED_GRAPH_TOKENS[-1]`` tokens replay a
*mixed* graph of the next token bucket, captured around the forward only
(the logits of the sampled rows follow eagerly): its metadata has a row for
every seat (padding rows hold no token), padding tokens have no row (no
cache write, output unused), and attention launches over a tile map staged
with the inputs, so no host value of the step enters the graph. Larger
steps (a step budget over 2048 tokens) run eagerly. Needs an attention backend that
reads no host value but the grid (``AttentionBackend.graph_safe``).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from jitney.worker.runner.input_batch import InputBatch, StepChunk
from jitney.worker.attention.kv_cache import PagedKVCache
from jitney.worker.runner.sampler import greedy_logprobs, pack_results
from jitney.worker.models.registry import ServedModel


# Token buckets of the mixed-step graphs: powers of two to 512, then every 256 tokens (a step
# pads at most 25% there) to 2048. On an H200 an eager step launched ~10 ms of host work
# (Triton's Python launcher, ~150 launches) whatever its size: 2048 tokens of the 135M shape
# took 11.3 ms eagerly for ~1.5 ms of GPU work, 512 tokens 11.9 ms against 2.3 ms as a graph.
MIXED_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)


def mixed_buckets(max_num_batched_tokens: int) -> list[int]:
    """The mixed-graph buckets a step budget can use."""
    return [t for t in MIXED_GRAPH_TOKENS if t <= max_num_batched_tokens]


def greedy_packed(logits: torch.Tensor) -> torch.Tensor:
    """(2, rows) float64: each row's greedy token id and its logprob, as ``sampler.sample`` computes them."""
    return pack_results(*greedy_logprobs(logits))


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to ``max_num_seqs`` (always included)."""
    ladder = [1, 2, 4, 8, *range(16, max_num_seqs + 1, 16)]
    return sorted({s for s in ladder if s <= max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """One captured forward + logits per batch size.

    With ``capture=False`` nothing is captured and ``logits`` runs the same
    padded forward eagerly over the staging buffer (tests do this on CPU).
    """

    def __init__(self, model: ServedModel, cache: PagedKVCache, batch: InputBatch, sizes: Sequence[int],
                 *, capture: bool = True, mixed_tokens: Sequence[int] = ()) -> None:
        self.model, self.cache, self.batch = model, cache, batch
        self.sizes = sorted(sizes)
        self.mixed_tokens = sorted(mixed_tokens) if batch.tile_block_q else []
        self.rows = torch.arange(self.sizes[-1], dtype=torch.int64, device=batch.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.mixed: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool_bytes = 0  # memory the captured graphs hold
        if capture:
            self._capture_all()

    def size_for(self, chunks: Sequence[StepChunk]) -> int | None:
        """The captured size a step pads to, or None when it runs eagerly."""
        if not chunks or len(chunks) > self.sizes[-1] or any(len(c.tokens) != 1 for c in chunks):
            return None
        return self.sizes[bisect.bisect_left(self.sizes, len(chunks))]

    def mixed_bucket(self, num_tokens: int) -> int | None:
        """The token bucket of a mixed step's graph, or None when it runs eagerly."""
        if not self.mixed_tokens or num_tokens > self.mixed_tokens[-1]:
            return None
        return self.mixed_tokens[bisect.bisect_left(self.mixed_tokens, num_tokens)]

    def mixed_hidden(self, tokens: int) -> torch.Tensor:
        """Hidden states ``(tokens, hidden)`` of the staged mixed step, padded to its bucket."""
        if tokens in self.mixed:
            graph, out = self.mixed[tokens]
            graph.replay()
            return out
        return self._forward_mixed(tokens)

    def logits(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Of the staged decode step, padded to ``size`` rows: float32 logits
        ``(size, vocab)`` and the greedy choice ``(2, size)`` float64 (token
        ids, their logprobs; what ``sample`` gives greedy rows), both computed
        in the graph so that an all-greedy step needs no more kernels."""
        if size in self.graphs:
            graph, out = self.graphs[size]
            graph.replay()
            return out
        return self._forward(size)

    def replay_seconds(self, size: int, reps: int = 20) -> float:
        """Mean GPU time of one replay of the graph of ``size`` rows (CUDA events)."""
        graph, _ = self.graphs[size]
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000 / reps

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batch
        meta = b.metadata(size, size, query_start_loc_host=tuple(range(size + 1)), seq_lens_host=(1,) * size,
                          num_decodes=size)  # host tuples: not read by graph-safe backends
        hidden = self.model(b.region("input_ids", size), b.region("positions", size), meta, self.cache)
        logits = self.model.compute_logits(hidden, self.rows[:size])
        return logits, greedy_packed(logits)

    def _forward_mixed(self, tokens: int) -> torch.Tensor:
        b = self.batch
        seats = b.max_num_seqs
        meta = b.metadata(tokens, seats, query_start_loc_host=(0,) * (seats + 1), seq_lens_host=(0,) * seats,
                          num_decodes=0, tiles=True)  # host tuples: not read with a tile map
        return self.model(b.region("input_ids", tokens), b.region("positions", tokens), meta, self.cache)

    def _capture_all(self) -> None:
        before = torch.cuda.memory_reserved()
        pool = None
        # One side stream for every warm-up: the caching allocator keeps blocks (and cuBLAS a
        # workspace) per stream, so a new stream per size would hold that many copies.
        side = torch.cuda.Stream()
        # Staged inputs of harmless steps: every row and token padding.
        self.batch.stage([], pad_seqs_to=self.batch.max_num_seqs, pad_tokens_to=max(self.mixed_tokens, default=1))
        for tokens in reversed(self.mixed_tokens):  # largest first: the pool fits the rest
            self.mixed[tokens], pool = _capture(functools.partial(self._forward_mixed, tokens), side, pool)
        self.batch.stage([], pad_seqs_to=self.sizes[-1])
        for size in reversed(self.sizes):
            self.graphs[size], pool = _capture(functools.partial(self._forward, size), side, pool)
        torch.cuda.synchronize()
        self.pool_bytes = torch.cuda.memory_reserved() - before


def _capture(forward: Callable[[], Any], side: torch.cuda.Stream, pool: Any) -> tuple[tuple[torch.cuda.CUDAGraph, Any], Any]:
    """Warm ``forward`` up on ``side`` (compiling its kernels outside the capture), then capture it."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return (graph, out), (graph.pool() if pool is None else pool)
