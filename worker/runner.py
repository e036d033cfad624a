"""The model runner: the only code that touches the device.

It executes step plans exactly as given: applies the plan's diffs to its
per-sequence state, runs one forward over the flattened tokens of all
chunks, and samples where the plan asks.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from client._generated.jitney.engine.v1 import engine_pb2
from worker.attention import AttentionMetadata
from worker.backends import make_attention_backend
from worker.config import WorkerConfig
from worker.cuda_graphs import make_cuda_steps
from worker.device import dtype_name, resolve_device, resolve_dtype
from worker.kv_cache import CacheGeometry, PagedKVCache, num_blocks_for
from worker.loader import load_model
from worker.plan import PlanLimits, SequenceState, apply_plan_diffs, chunk_tokens, validate_plan
from worker.sampler import SamplingBatch, sample

logger = logging.getLogger("jitney.worker")


@dataclass(frozen=True)
class StepBatch:
    """One fused step, flattened (decodes first) and ready for the model."""

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # (S,) rows of the hidden states to sample, plan order
    sampled_seq_ids: list[int]  # (S,) plan order
    sampling: SamplingBatch | None


class ModelRunner:
    """Owns the model, the paged KV cache and per-sequence state."""

    def __init__(self, config: WorkerConfig) -> None:
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.config = config
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config)
        self.model, self.facts = load_model(config.model, self.dtype, self.device, config.max_model_len)
        self.model.backend = make_attention_backend(config.attention_backend, self.device)
        cfg = self.model.config
        geometry = CacheGeometry(cfg.num_layers, config.block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        num_blocks = num_blocks_for(
            geometry, self.device, num_blocks=config.num_blocks, kv_cache_gib=config.kv_cache_gib
        )
        self.cache = PagedKVCache(geometry, num_blocks, self.device)
        self.limits = PlanLimits(
            num_blocks=num_blocks,
            block_size=config.block_size,
            context_length=self.facts.context_length,
            vocab_size=self.facts.vocab_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
        )
        self.sequences: dict[int, SequenceState] = {}
        # CUDA only (None on CPU): decode steps replay CUDA graphs, sampling never syncs.
        self.cuda_steps = make_cuda_steps(
            self.model, self.cache, max_num_seqs=config.max_num_seqs, context_length=self.facts.context_length
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %s)",
            num_blocks, config.block_size, self.cache.nbytes / 2**30, dtype_name(self.dtype),
        )

    def ready_message(self) -> engine_pb2.Ready:
        """The handshake: model facts and cache geometry."""
        return engine_pb2.Ready(
            protocol_version=engine_pb2.PROTOCOL_VERSION_1,
            model_name=self.facts.name,
            vocab_size=self.facts.vocab_size,
            context_length=self.facts.context_length,
            eos_token_ids=list(self.facts.eos_token_ids),
            num_blocks=self.limits.num_blocks,
            block_size=self.limits.block_size,
            dtype=dtype_name(self.dtype),
            device=str(self.device),
            worker_pid=os.getpid(),
        )

    @torch.inference_mode()
    def execute(self, plan: engine_pb2.StepPlan) -> engine_pb2.StepResult:
        """Run one step. Raises ``PlanError`` (state untouched) on a bad plan."""
        started = time.perf_counter()
        validate_plan(plan, self.sequences, self.limits)
        apply_plan_diffs(plan, self.sequences)
        result = engine_pb2.StepResult(step_id=plan.step_id)
        if plan.chunks and self.cuda_steps is not None:
            self.cuda_steps.execute(self._prepare(list(plan.chunks)), self.sequences, result)
        elif plan.chunks:
            batch = self._prepare(list(plan.chunks))
            model_started = time.perf_counter()
            hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.cache)
            if batch.sampling is not None:
                logits = self.model.compute_logits(hidden, batch.sample_indices)
            result.model_seconds = time.perf_counter() - model_started
            if batch.sampling is not None:
                tokens, logprobs = sample(logits, batch.sampling)
                sampled_tokens = tokens.tolist()
                for seq_id, token in zip(batch.sampled_seq_ids, sampled_tokens):
                    self.sequences[seq_id].last_sampled = token
                result.seq_ids.extend(batch.sampled_seq_ids)
                result.token_ids.extend(sampled_tokens)
                result.logprobs.extend(logprobs.tolist())
        result.forward_seconds = time.perf_counter() - started
        return result

    def _prepare(self, chunks: list[engine_pb2.ScheduledChunk]) -> StepBatch:
        # Decodes (one-token chunks) first: the attention backend batches them.
        tokens = [chunk_tokens(c, self.sequences[c.seq_id]) for c in chunks]
        # Decodes first, shortest context first: the attention backend batches
        # them in runs of similar length.
        order = sorted(range(len(chunks)),
                       key=lambda i: (len(tokens[i]) != 1, chunks[i].start_position))
        input_ids: list[int] = []
        positions: list[int] = []
        last_token: dict[int, int] = {}  # plan index -> flat row of its last token
        for i in order:
            start = chunks[i].start_position
            input_ids.extend(tokens[i])
            positions.extend(range(start, start + len(tokens[i])))
            last_token[i] = len(input_ids) - 1
        meta = AttentionMetadata.build(
            query_lens=[len(tokens[i]) for i in order],
            seq_lens=[chunks[i].start_position + len(tokens[i]) for i in order],
            block_tables=[self.sequences[chunks[i].seq_id].block_table for i in order],
            block_size=self.limits.block_size,
            device=self.device,
        )
        sampled = [i for i in range(len(chunks)) if chunks[i].sample]
        return StepBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            meta=meta,
            sample_indices=torch.tensor([last_token[i] for i in sampled], dtype=torch.int64, device=self.device),
            sampled_seq_ids=[chunks[i].seq_id for i in sampled],
            sampling=self._sampling([chunks[i] for i in sampled]) if sampled else None,
        )

    def _sampling(self, chunks: list[engine_pb2.ScheduledChunk]) -> SamplingBatch:
        states = [self.sequences[c.seq_id] for c in chunks]
        return SamplingBatch.from_lists(
            temperature=[s.temperature for s in states],
            top_p=[s.top_p for s in states],
            top_k=[s.top_k for s in states],
            seed=[s.seed for s in states],
            # The token sampled after a chunk lands at the position after it.
            position=[c.start_position + len(c.token_ids) + c.last_token_from_sample for c in chunks],
            device=self.device,
        )
