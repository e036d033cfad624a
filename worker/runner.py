"""The model runner: the only code that touches the device.

It executes step plans exactly as given: checks the plan, applies its diffs
to the per-sequence state and the persistent batch (``input_batch.py``),
stages the step's inputs in one host-to-device copy, runs one forward over
the flattened tokens of all chunks (a captured CUDA graph for decode-only
steps on CUDA), and samples where the plan asks. The step's one host sync
is the copy of the sampled ids and logprobs.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from jitney.engine.v1 import engine_pb2
from jitney.worker.attention import AttentionMetadata
from jitney.worker.backends import make_attention_backend, prefill_block_q
from jitney.worker.config import WorkerConfig
from jitney.worker.cuda_graphs import DecodeGraphs, capture_sizes, mixed_buckets
from jitney.worker.device import dtype_name, resolve_batch_invariant, resolve_device, resolve_dtype, step_defaults
from jitney.worker.input_batch import InputBatch, StagedStep, StepChunk
from jitney.worker.kv_cache import CacheGeometry, PagedKVCache, size_cache
from jitney.worker.loader import load_model
from jitney.worker.plan import PlanLimits, SequenceState, apply_plan_diffs, chunk_tokens, validate_plan
from jitney.worker.sampler import pack_results, sample
from jitney.worker.warmup import profile_activations, warm_up

logger = logging.getLogger("jitney.worker")


class ModelRunner:
    """Owns the model, the paged KV cache and the persistent batch.

    ``capture_graphs``: None = on CUDA with a graph-safe backend; False runs
    every step eagerly; a ``DecodeGraphs`` may also be set afterwards
    (tests emulate graphs on the CPU that way).
    """

    def __init__(self, config: WorkerConfig, *, capture_graphs: bool | None = None) -> None:
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.config = config
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config)
        self.batch_invariant = resolve_batch_invariant(config, self.device, self.dtype)
        self.model, self.facts = load_model(config.model, self.dtype, self.device, config.max_model_len,
                                            batch_invariant=self.batch_invariant)
        loaded = time.perf_counter()
        self.model.use_backend(make_attention_backend(config.attention_backend, self.device,
                                                      batch_invariant=self.batch_invariant),
                               self.facts.context_length)
        max_tokens, max_seqs = step_defaults(config, self.device)
        cfg = self.model.config
        geometry = CacheGeometry(cfg.num_layers, config.block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        reserve = profile_activations(self.model, geometry, self.device, max_tokens, max_seqs,
                                      self.facts.context_length)
        num_blocks = size_cache(geometry, self.device, num_blocks=config.num_blocks,
                                kv_cache_gib=config.kv_cache_gib, reserve_bytes=reserve.graphs)
        self.cache = PagedKVCache(geometry, num_blocks, self.device)
        self.limits = PlanLimits(num_blocks=num_blocks, block_size=config.block_size,
                                 context_length=self.facts.context_length, vocab_size=self.facts.vocab_size,
                                 max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs)
        self.sequences: dict[int, SequenceState] = {}
        graph_safe = self.model.backend.graph_safe
        self.batch = InputBatch(max_num_seqs=max_seqs, max_num_tokens=max_tokens,
                                max_blocks_per_seq=-(-self.facts.context_length // config.block_size),
                                block_size=config.block_size, device=self.device,
                                tile_block_q=prefill_block_q(cfg.num_heads, cfg.num_kv_heads) if graph_safe else 0)
        if capture_graphs is None:
            capture_graphs = self.device.type == "cuda" and graph_safe
        self.graphs = (DecodeGraphs(self.model, self.cache, self.batch, capture_sizes(max_seqs),
                                    mixed_tokens=mixed_buckets(max_tokens))
                       if capture_graphs else None)
        warm_up(self)
        self.warmup_seconds = time.perf_counter() - loaded
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %s); step budget %d tokens, %d seats; "
            "activations %.2f GiB, CUDA graphs %.2f GiB reserved (%.2f GiB captured); warm-up %.1f s",
            num_blocks, config.block_size, self.cache.nbytes / 2**30, dtype_name(self.dtype), max_tokens, max_seqs,
            reserve.activations / 2**30, reserve.graphs / 2**30,
            (self.graphs.pool_bytes if self.graphs else 0) / 2**30, self.warmup_seconds,
        )

    def ready_message(self) -> engine_pb2.Ready:
        """The handshake: model facts, cache geometry and the step limits."""
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
            max_num_seqs=self.limits.max_num_seqs,
            max_num_batched_tokens=self.limits.max_num_batched_tokens,
            warmup_seconds=self.warmup_seconds,
            batch_invariant=self.batch_invariant,
        )

    @torch.inference_mode()
    def execute(self, plan: engine_pb2.StepPlan) -> engine_pb2.StepResult:
        """Run one step. Raises ``PlanError`` (state untouched) on a bad plan."""
        validate_plan(plan, self.sequences, self.limits)
        self._apply(plan)
        result = engine_pb2.StepResult(step_id=plan.step_id)
        if plan.chunks:
            self._run(self._chunks(plan), result)
        return result

    def _apply(self, plan: engine_pb2.StepPlan) -> None:
        """The plan's diffs, to the sequence states and to the persistent batch's rows."""
        apply_plan_diffs(plan, self.sequences)
        for sid in plan.freed_seq_ids:
            self.batch.remove(sid)
        for new in plan.new_sequences:
            s = self.sequences[new.seq_id]
            self.batch.add(new.seq_id, s.temperature, s.top_p, s.top_k, s.seed)
        for chunk in plan.chunks:
            self.batch.extend_blocks(chunk.seq_id, list(chunk.new_block_ids))

    def _chunks(self, plan: engine_pb2.StepPlan) -> list[StepChunk]:
        """The plan's chunks, decodes first and shortest context first (the CPU
        attention backend batches decodes in runs of similar length)."""
        seqs = self.sequences
        chunks = [StepChunk(c.seq_id, c.start_position, chunk_tokens(c, seqs[c.seq_id]), c.sample, i)
                  for i, c in enumerate(plan.chunks)]
        chunks.sort(key=_decodes_first)
        return chunks

    def _run(self, chunks: list[StepChunk], result: engine_pb2.StepResult) -> None:
        graphs = self.graphs
        size = graphs.size_for(chunks) if graphs is not None else None
        bucket = graphs.mixed_bucket(sum(len(c.tokens) for c in chunks)) if graphs is not None and size is None else None
        if bucket is not None:
            step = self.batch.stage(chunks, pad_seqs_to=self.batch.max_num_seqs, pad_tokens_to=bucket)
        else:
            step = self.batch.stage(chunks, pad_seqs_to=size or 0)
        # Attention metadata (and the CPU backend's plan) before the model's clock starts.
        meta = self.model.backend.prepare(self.batch.step_metadata(step)) if size is None and bucket is None else None
        timer = _ModelTimer(self.device)
        if graphs is not None and size is not None and step.num_plain == step.num_filtered == 0:
            _, greedy = graphs.logits(size)   # every row greedy: the graph's own choice is the result
            timer.stop()
            sampled = self.batch.region("sample_tokens", step.num_sampled)
            tokens, logprobs = _unpack(greedy.index_select(1, sampled).cpu())
        else:
            logits = self._logits(step, size, bucket, meta)
            timer.stop()
            if logits is None:   # nothing samples: no other sync
                timer.sync()
                result.model_seconds = timer.seconds()
                return
            tokens, logprobs = self._sample(step, logits)
        result.model_seconds = timer.seconds()
        self._record(step.sampled_seq_ids, tokens, logprobs, result)

    def _logits(self, step: StagedStep, size: int | None, bucket: int | None,
                meta: AttentionMetadata | None) -> torch.Tensor | None:
        """Forward (a decode graph, a mixed graph, or eagerly) -> float32 logits of the sampled rows."""
        sampled = self.batch.region("sample_tokens", step.num_sampled) if step.num_sampled else None
        if size is not None:
            assert self.graphs is not None
            logits, _ = self.graphs.logits(size)
            return logits.index_select(0, sampled) if sampled is not None else None
        if bucket is not None:
            assert self.graphs is not None
            hidden = self.graphs.mixed_hidden(bucket)
        else:
            assert meta is not None
            hidden = self.model(self.batch.region("input_ids", step.num_tokens),
                                self.batch.region("positions", step.num_tokens), meta, self.cache)
        return self.model.compute_logits(hidden, sampled) if sampled is not None else None

    def _sample(self, step: StagedStep, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        _, params, groups = self.batch.sampling(step)
        return _unpack(pack_results(*sample(logits, params, groups)).cpu())

    def _record(self, seq_ids: list[int], tokens: list[int], logprobs: list[float],
                result: engine_pb2.StepResult) -> None:
        for seq_id, token in zip(seq_ids, tokens):
            self.sequences[seq_id].last_sampled = token
        result.seq_ids.extend(seq_ids)
        result.token_ids.extend(tokens)
        result.logprobs.extend(logprobs)


def _decodes_first(chunk: StepChunk) -> tuple[bool, int]:
    return len(chunk.tokens) != 1, chunk.start


class _ModelTimer:
    """Time of forward + logits: host time on the CPU, GPU time between two events on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.started = time.perf_counter()
        self.elapsed = 0.0
        if self.cuda:
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.end_event = torch.cuda.Event(enable_timing=True)
            self.start_event.record()

    def stop(self) -> None:
        if self.cuda:
            self.end_event.record()
        else:
            self.elapsed = time.perf_counter() - self.started

    def sync(self) -> None:
        """Wait for the device (a step that samples nothing has no other sync)."""
        if self.cuda:
            self.end_event.synchronize()

    def seconds(self) -> float:
        """Call after the device passed ``stop`` (the results' copy, or ``sync``)."""
        if self.cuda:
            return self.start_event.elapsed_time(self.end_event) / 1000
        return self.elapsed


def _unpack(packed: torch.Tensor) -> tuple[list[int], list[float]]:
    """``pack_results``' (2, S) float64, copied to the host -> token ids, logprobs."""
    return [int(t) for t in packed[0].tolist()], packed[1].tolist()
