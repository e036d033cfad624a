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

Every other step (any prefill chunk, or more sequences than the largest
graph) runs eagerly. Needs an attention backend that reads no host value
but the grid (``AttentionBackend.graph_safe``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from jitney.worker.input_batch import InputBatch, StepChunk
from jitney.worker.kv_cache import PagedKVCache
from jitney.worker.model import CausalLM


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to ``max_num_seqs`` (always included)."""
    ladder = [1, 2, 4, 8, *range(16, max_num_seqs + 1, 16)]
    return sorted({s for s in ladder if s <= max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """One captured forward + logits per batch size.

    With ``capture=False`` nothing is captured and ``logits`` runs the same
    padded forward eagerly over the staging buffer (tests do this on CPU).
    """

    def __init__(self, model: CausalLM, cache: PagedKVCache, batch: InputBatch, sizes: Sequence[int],
                 *, capture: bool = True) -> None:
        self.model, self.cache, self.batch = model, cache, batch
        self.sizes = sorted(sizes)
        self.rows = torch.arange(self.sizes[-1], dtype=torch.int64, device=batch.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool_bytes = 0  # memory the captured graphs hold
        if capture:
            self._capture_all()

    def size_for(self, chunks: Sequence[StepChunk]) -> int | None:
        """The captured size a step pads to, or None when it runs eagerly."""
        if not chunks or len(chunks) > self.sizes[-1] or any(len(c.tokens) != 1 for c in chunks):
            return None
        return self.sizes[bisect.bisect_left(self.sizes, len(chunks))]

    def logits(self, size: int) -> torch.Tensor:
        """Float32 logits ``(size, vocab)`` of the staged decode step, padded to ``size``."""
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

    def _forward(self, size: int) -> torch.Tensor:
        b = self.batch
        meta = b.metadata(size, size, query_start_loc_host=tuple(range(size + 1)), seq_lens_host=(1,) * size,
                          num_decodes=size)  # host tuples: not read by graph-safe backends
        hidden = self.model(b.region("input_ids", size), b.region("positions", size), meta, self.cache)
        return self.model.compute_logits(hidden, self.rows[:size])

    def _capture_all(self) -> None:
        # Staged inputs of a harmless decode step: every row padding.
        self.batch.stage([], pad_seqs_to=self.sizes[-1])
        before = torch.cuda.memory_reserved()
        pool = None
        for size in reversed(self.sizes):  # largest first: the pool fits the rest
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(size)  # warm-up: compiles the kernels outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
        self.pool_bytes = torch.cuda.memory_reserved() - before
