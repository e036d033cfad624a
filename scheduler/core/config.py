"""Scheduler configuration: one frozen object per process, built once.

``num_blocks`` and ``block_size`` come from the worker's Ready handshake; the
rest from flags. Derived values are computed by whoever needs them, never
written back here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from jitney.scheduler.core.fairness import FAIRNESS_MODES, FairnessMode, check_weights
from jitney.scheduler.core.speculative import SPECULATIVE_METHODS, SpeculativeMethod

SchedulingPolicy = Literal["continuous", "static", "sequential"]
POLICIES: tuple[str, ...] = get_args(SchedulingPolicy)
MAX_SPECULATIVE_TOKENS = 64


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler may do in one step, and with how much KV cache.

    Raises ``ValueError`` on construction if a field is out of range.
    """

    block_size: int
    """Tokens per KV-cache block (worker handshake)."""

    num_blocks: int
    """Blocks in the worker's KV cache (worker handshake)."""

    max_model_len: int
    """Context length: a request stops (CONTEXT_LENGTH) once prompt + output
    reaches it. The cache must hold one such sequence, so pass
    ``min(context_length, num_blocks * block_size)`` on a small cache."""

    max_num_seqs: int = 64
    """Seats: the most requests running (holding blocks) at once."""

    max_num_batched_tokens: int = 512
    """Token budget of one step: prefill chunks plus decode tokens. Must be at
    least ``max_num_seqs`` so that every seat can decode in one step."""

    policy: SchedulingPolicy = "continuous"
    """``continuous``: waiting requests board at every step while seats,
    budget and blocks last. ``static``: when nobody rides, the head of
    the queue forms a batch of up to ``max_num_seqs`` requests; members whose
    prompts miss the first step's token budget board in later steps, and
    nobody else boards until the whole batch has left, so a finished
    request's seat stays empty meanwhile.
    ``sequential``: one request at a time."""

    sliding_window: int = 0
    """Every layer of the model attends at most this many keys back (its
    layers' largest window; worker handshake): blocks wholly before a
    request's window go back to the pool as it grows, and the last block is
    the null block the released table entries point at. 0: some layer reads
    the whole sequence, every block is kept."""

    enable_prefix_caching: bool = True
    """Share the KV blocks of common prompt prefixes between requests and keep
    finished requests' full blocks cached until their space is needed
    (``--no-prefix-cache`` turns it off). See ``block_manager.py``."""

    speculative: SpeculativeMethod = "off"
    """Speculative decoding (``--speculative``): ``off``, ``ngram`` (prompt
    lookup in the sequence's own tokens) or ``suffix`` (also in the recent
    finished sequences of its cache_salt; ``speculative.py``). Drafts are
    verified inside the step; the output is the same as ``off``."""

    num_speculative_tokens: int = 4
    """The most drafts one sequence verifies in a step
    (``--num-speculative-tokens``, 1..64); the load-adaptive rule drafts fewer,
    or none."""

    max_step_ms: float = 0.0
    """``--max-step-ms``: while decodes ride a step, its prefill chunks are
    sized so the step-cost model (``step_cost.py``) predicts the model's time
    of the step at most this many milliseconds (or 1.25x the decodes' own
    time, where that is more: ``scheduler.PREFILL_SHARE``); the first prefill
    chunk of a step still gets ``min_prefill_chunk`` tokens, so no prompt
    starves. Steps without decodes fill the token budget. 0: off (chunks
    fill the budget)."""
    fairness: FairnessMode = "off"
    """``--fairness``: ``off`` boards by priority then arrival; ``tenant``
    shares the server between tenants by their weighted service (the
    Virtual Token Counter, ``fairness.py``), priority ordering within one."""

    jump_forward: bool = True
    """Grammar jump-forward (``--no-jump-forward`` turns it off): where a
    constrained sequence's grammar allows exactly one token at each of its
    next positions, those tokens ride its next chunk as known input instead of
    being sampled one step each (``engine.py``). The same tokens as without it
    (each was the only one its mask allowed); only for requests that do not
    read per-token logprobs and use no sampling state that counts tokens
    (penalties, min_tokens)."""

    tenant_weights: tuple[tuple[str, float], ...] = ()
    """(tenant, weight) of ``--fairness tenant``: a tenant's service counts
    divided by its weight (default 1), so weight 2 gets twice the share.
    From ``NAME:KEY:WEIGHT`` key-file lines and ``--tenant-weight``."""

    max_loras: int = 0
    """LoRA adapter slots of the worker (Ready.max_loras; 0: LoRA off): the
    most adapters resident at once (``lora.py``)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(f"max_loras must be an int >= 0, got {self.max_loras!r}")
        for name in ("block_size", "num_blocks", "max_model_len",
                     "max_num_seqs", "max_num_batched_tokens"):
            _require_positive_int(name, getattr(self, name))
        if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) \
                or self.sliding_window < 0:
            raise ValueError(f"sliding_window must be an int >= 0, got {self.sliding_window!r}")
        if self.policy not in POLICIES:
            raise ValueError(
                f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.speculative!r}")
        if self.fairness not in FAIRNESS_MODES:
            raise ValueError(f"fairness must be one of {', '.join(FAIRNESS_MODES)}, got {self.fairness!r}")
        check_weights(self.tenant_weights)
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS or (
                self.speculative != "off" and k >= self.max_num_batched_tokens):
            raise ValueError(f"num_speculative_tokens must be an int in 1..{MAX_SPECULATIVE_TOKENS} and "
                             f"below max_num_batched_tokens ({self.max_num_batched_tokens}), got {k!r}")
        ms = self.max_step_ms
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
            raise ValueError(f"max_step_ms must be a finite number >= 0 (0 = off), got {ms!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_num_seqs ({self.max_num_seqs}) so every seat can decode")
        needed = blocks_per_sequence(self.max_model_len, self.block_size, self.sliding_window,
                                     self.max_num_batched_tokens)
        if self.pool_blocks < needed:
            raise ValueError(
                f"the KV cache holds {self.pool_blocks * self.block_size} tokens ({self.pool_blocks} "
                f"blocks of {self.block_size}), fewer than one sequence of max_model_len "
                f"({self.max_model_len}) may hold ({needed} blocks, sliding window "
                f"{self.sliding_window}); lower max_model_len")

    @property
    def min_prefill_chunk(self) -> int:
        """Under ``max_step_ms``, the tokens the first prefill chunk of a step
        always gets (or what its prompt has left): one KV block."""
        return self.block_size

    @property
    def pool_blocks(self) -> int:
        """Blocks requests can hold: all but the null block of a windowed model."""
        return self.num_blocks - (self.sliding_window > 0)


def blocks_per_sequence(num_tokens: int, block_size: int, window: int = 0, chunk: int = 0) -> int:
    """The most blocks one sequence of ``num_tokens`` holds at once, computed in
    chunks of at most ``chunk`` tokens: all of them, or with a ``window`` the
    blocks from its window's first up to its chunk's last."""
    whole = -(-num_tokens // block_size)
    if not window:
        return whole
    return min(whole, -(-(window + chunk) // block_size) + 1)


def max_model_len_for(context_length: int, num_blocks: int, block_size: int, window: int = 0,
                      chunk: int = 0) -> int:
    """The context length a cache of ``num_blocks`` serves: the model's, or (a
    cache too small for one whole sequence) what the cache holds."""
    pool = num_blocks - (window > 0)
    if blocks_per_sequence(context_length, block_size, window, chunk) <= pool:
        return context_length
    return max(1, min(context_length, pool * block_size))


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
