"""The CUDA step: decode-only steps replay CUDA graphs; sampling never syncs.

Graphs are captured at start for a ladder of batch sizes. A decode-only
step of ``n`` sequences is padded to the next captured size ``m``:

    # rows [0, n)   -> the step's decodes, copied into static buffers
    # rows [n, m)   -> padding: slot -1 (the cache write skips it),
    #                  seq_len 0 (attention reads nothing), logits unused

Every other step (any prefill chunk, or more sequences than the largest
graph) runs eagerly. Either way the step's one host sync is the copy of
the sampled ids and logprobs (``cuda_sampling.to_host``).

Requires an attention backend whose kernels take no host values but the
grid (``TritonPagedAttention``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Protocol

import torch

from client._generated.jitney.engine.v1 import engine_pb2
from worker.attention import AttentionMetadata
from worker.cuda_sampling import sample_without_sync, to_host
from worker.kv_cache import PagedKVCache
from worker.model import CausalLM
from worker.plan import SequenceState
from worker.sampler import SamplingBatch


class Step(Protocol):
    """What this module reads of the runner's ``StepBatch``."""

    @property
    def input_ids(self) -> torch.Tensor: ...
    @property
    def positions(self) -> torch.Tensor: ...
    @property
    def meta(self) -> AttentionMetadata: ...
    @property
    def sample_indices(self) -> torch.Tensor: ...
    @property
    def sampled_seq_ids(self) -> list[int]: ...
    @property
    def sampling(self) -> SamplingBatch | None: ...


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to ``max_num_seqs`` (always included)."""
    ladder = [1, 2, 4, 8, *range(16, max_num_seqs + 1, 16)]
    return sorted({s for s in ladder if s <= max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """Static input buffers and one captured forward + logits per batch size.

    With ``capture=False`` nothing is captured and ``logits`` runs the same
    padded forward eagerly on the static buffers (tests use this on CPU).
    """

    def __init__(
        self, model: CausalLM, cache: PagedKVCache, sizes: Sequence[int], max_blocks: int, *, capture: bool = True
    ) -> None:
        self.model, self.cache = model, cache
        self.sizes = sorted(sizes)
        device, largest = cache.tensor.device, self.sizes[-1]

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.input_ids, self.positions, self.seq_lens = zeros(largest), zeros(largest), zeros(largest)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int64, device=device)
        self.block_tables = zeros(largest, max_blocks)
        self.rows = torch.arange(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture_all()

    def handles(self, step: Step) -> bool:
        """Decode-only, and fits the largest size and the static block tables."""
        meta = step.meta
        return (
            meta.num_decodes == meta.num_seqs > 0
            and meta.num_seqs <= self.sizes[-1]
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def logits(self, step: Step) -> torch.Tensor:
        """Float32 logits ``(S, vocab)`` at ``step.sample_indices``; needs ``handles(step)``."""
        meta, n = step.meta, step.meta.num_seqs
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(step.input_ids)
        self.positions[:n].copy_(step.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:size].zero_()
        # Columns past a row's seq_len may hold stale ids: they are never read.
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if size in self.graphs:
            graph, out = self.graphs[size]
            graph.replay()
        else:
            out = self._forward(size)
        return out[step.sample_indices]

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            num_decodes=size,
            query_start_loc_host=tuple(range(size + 1)),
            seq_lens_host=(1,) * size,  # not read by graph-safe backends
            block_size=self.cache.geometry.block_size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:size], self.positions[:size], self._meta(size), self.cache)
        return self.model.compute_logits(hidden, self.rows[:size])

    def _capture_all(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first: the pool fits the rest
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(size)  # warm-up: compiles the Triton kernels outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()


class CudaSteps:
    """Runs a step's forward (graph or eager), samples and fills the result."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, graphs: DecodeGraphs | None) -> None:
        self.model, self.cache, self.graphs = model, cache, graphs

    def execute(self, step: Step, sequences: dict[int, SequenceState], result: engine_pb2.StepResult) -> None:
        """Forward ``step``, sample where it asks, record the tokens in ``sequences`` and ``result``."""
        if self.graphs is not None and self.graphs.handles(step):
            logits = self.graphs.logits(step)
        else:
            hidden = self.model(step.input_ids, step.positions, step.meta, self.cache)
            logits = self.model.compute_logits(hidden, step.sample_indices)
        if step.sampling is None:
            return
        states = [sequences[seq_id] for seq_id in step.sampled_seq_ids]
        tokens, logprobs = to_host(*sample_without_sync(logits, step.sampling, states))
        for state, token in zip(states, tokens):
            state.last_sampled = token
        result.seq_ids.extend(step.sampled_seq_ids)
        result.token_ids.extend(tokens)
        result.logprobs.extend(logprobs)


def make_cuda_steps(model: CausalLM, cache: PagedKVCache, *, max_num_seqs: int, context_length: int) -> CudaSteps | None:
    """The CUDA step runner, or ``None`` off CUDA (the CPU path stays as it is).

    Graphs are captured only over a graph-safe backend (one reading no
    host values but the grid: ``graph_safe = True``).
    """
    if cache.tensor.device.type != "cuda":
        return None
    graphs = None
    if getattr(model.backend, "graph_safe", False):
        max_blocks = -(-context_length // cache.geometry.block_size)
        graphs = DecodeGraphs(model, cache, capture_sizes(max_num_seqs), max_blocks)
    return CudaSteps(model, cache, graphs)
