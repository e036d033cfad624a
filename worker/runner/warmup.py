"""Before Ready: measure what a step needs, then run every kind of step once.

``profile_activations`` (CUDA) runs the largest steps the worker accepts on
a small scratch cache before the real cache exists, so the KV cache is
sized from the memory left after the model *and* the activations:

    # reserve.activations  peak of one max-budget prefill step + logits of every seat
    #                      (stays reserved by the caching allocator for eager steps)
    # reserve.graphs       what the captured graphs' private pool takes: the peak of an
    #                      all-seats decode step or of the largest mixed bucket (x 1.25),
    #                      plus every graph's kept outputs (logits per decode size, ...)

``warm_up`` then drives the runner's own ``execute`` with a few synthetic
plans (a long prefill, a mixed step, decodes, every sampling group), so
every Triton kernel variant is compiled and every code path touched before
the first request arrives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from jitney.engine.v1 import engine_pb2
from jitney.worker.attention.backend import AttentionMetadata
from jitney.worker.runner.cuda_graphs import capture_sizes, mixed_buckets
from jitney.worker.attention.kv_cache import CacheGeometry, PagedKVCache
from jitney.worker.models.registry import ServedModel

if TYPE_CHECKING:
    from jitney.worker.runner.model_runner import ModelRunner

GRAPH_MARGIN = 1.25
CPU_WARMUP_PREFILL = 32
# Seq ids of the warm-up's sequences: far above any the scheduler hands out first.
WARMUP_SEQ_BASE = 1 << 62


@dataclass(frozen=True)
class MemoryReserve:
    activations: int = 0
    graphs: int = 0


@torch.inference_mode()
def profile_activations(model: ServedModel, geometry: CacheGeometry, device: torch.device,
                        max_tokens: int, max_seqs: int, context_length: int) -> MemoryReserve:
    """Peak memory of the largest prefill and decode steps (CUDA; zero elsewhere)."""
    if device.type != "cuda":
        return MemoryReserve()
    tokens = min(max_tokens, context_length)
    bs = geometry.block_size
    blocks = -(-tokens // bs) + max_seqs
    scratch = PagedKVCache(geometry, blocks, device, model.backend.block_shapes(geometry))
    prefill = _peak(model, scratch, [tokens], bs, logits_rows=max_seqs)
    decode = _peak(model, scratch, [1] * max_seqs, bs, logits_rows=max_seqs)
    mixed = max((_peak(model, scratch, [t], bs, logits_rows=1) for t in mixed_buckets(tokens)[-1:]), default=0)
    del scratch
    torch.cuda.empty_cache()
    return MemoryReserve(activations=prefill, graphs=int(max(decode, mixed) * GRAPH_MARGIN)
                         + _graph_outputs(model, max_seqs, tokens, geometry.dtype.itemsize))


def _graph_outputs(model: ServedModel, max_seqs: int, max_tokens: int, itemsize: int) -> int:
    """Bytes the captured graphs keep as their outputs: each decode size's float32
    logits and greedy choice, each mixed bucket's hidden states (``itemsize`` bytes an element)."""
    cfg = model.config
    decode = sum(s * (cfg.vocab_size * 4 + 16) for s in capture_sizes(max_seqs))
    mixed = sum(t * cfg.hidden_size * itemsize for t in mixed_buckets(max_tokens))
    return decode + mixed


def _peak(model: ServedModel, cache: PagedKVCache, query_lens: list[int], block_size: int, logits_rows: int) -> int:
    """Bytes allocated at the peak of one forward + logits, beyond what was allocated before."""
    device = cache.tensor.device
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    tables, next_block = [], 0
    for n in query_lens:
        need = -(-n // block_size)
        tables.append(list(range(next_block, next_block + need)))
        next_block += need
    meta = AttentionMetadata.build(query_lens=query_lens, seq_lens=query_lens, block_tables=tables,
                                   block_size=block_size, device=device)
    total = sum(query_lens)
    ids = torch.zeros(total, dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in query_lens])
    hidden = model(ids, positions, meta, cache)
    rows = torch.arange(min(logits_rows, total), device=device)
    logits = model.compute_logits(hidden, rows)
    logits.log_softmax(dim=-1)  # the sampler's largest temporary
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def warm_up(runner: ModelRunner) -> None:
    """Run a prefill, a mixed and a decode step, each sampling group, through ``execute``; free it all."""
    limits = runner.limits
    bs = limits.block_size
    ids = [WARMUP_SEQ_BASE + i for i in range(4)]
    sampling = [engine_pb2.SamplingConfig(),                                   # greedy
                engine_pb2.SamplingConfig(temperature=1.0, seed=1),            # plain random
                engine_pb2.SamplingConfig(temperature=0.8, top_p=0.9, top_k=20, seed=2),  # filtered
                engine_pb2.SamplingConfig()]
    # The long prefill fills the step budget, as far as the cache and the context allow.
    long = max(2, min(limits.max_num_batched_tokens - 4, limits.context_length - 4,
                      (limits.num_blocks - 8) * bs))
    if runner.device.type != "cuda":
        # Nothing is compiled per shape on the CPU: a short prefill touches the
        # same code, and a restarted worker does not spend ~1 s on a long one.
        long = min(long, CPU_WARMUP_PREFILL)
    lens = [long, 2, 2, 3]
    if limits.max_num_seqs < 4 or limits.num_blocks < sum(-(-(n + 2) // bs) for n in lens):
        lens, ids, sampling = lens[:1], ids[:1], sampling[:1]
        long = lens[0] = max(1, min(lens[0], limits.num_blocks * bs - 2))
    next_block = 0
    blocks = {}
    for sid, n in zip(ids, lens):
        need = -(-(n + 2) // bs)
        blocks[sid] = list(range(next_block, next_block + need))
        next_block += need
    first = engine_pb2.StepPlan(step_id=0)
    for sid, cfg, n in zip(ids[:3], sampling[:3], lens[:3]):
        first.new_sequences.add(seq_id=sid, sampling=cfg)
        first.chunks.add(seq_id=sid, start_position=0, token_ids=[1] * n, new_block_ids=blocks[sid], sample=True)
    runner.execute(first)                                      # prefill (one long chunk + short ones)
    mixed = engine_pb2.StepPlan(step_id=1)
    for sid, n in zip(ids[:3], lens[:3]):
        mixed.chunks.add(seq_id=sid, start_position=n, last_token_from_sample=True, sample=True)
    if len(ids) == 4:
        mixed.new_sequences.add(seq_id=ids[3], sampling=sampling[3])
        mixed.chunks.add(seq_id=ids[3], start_position=0, token_ids=[1] * lens[3], new_block_ids=blocks[ids[3]],
                         sample=True)
    runner.execute(mixed)                                      # decodes + a prefill chunk
    decode = engine_pb2.StepPlan(step_id=2)
    for i, (sid, n) in enumerate(zip(ids, lens)):
        decoded = 1 if i < 3 else 0  # the first three decoded in the mixed step
        decode.chunks.add(seq_id=sid, start_position=n + decoded, last_token_from_sample=True, sample=True)
    runner.execute(decode)                                     # decode only (a graph on CUDA)
    runner.execute(engine_pb2.StepPlan(step_id=3, freed_seq_ids=ids))
