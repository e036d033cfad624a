"""Request state: plain data, no policy.

A request's progress is one counter, ``num_computed_tokens``, catching up to
``num_tokens`` (prompt + output so far). Prefill, chunked prefill, prefix-cache
hits and recompute after preemption are all that counter moving.

    [0, num_computed_tokens)            -> K/V in the cache (block_ids)
    [num_computed_tokens, num_tokens)   -> still to compute
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # queued, or preempted and waiting to resume
    RUNNING = "running"      # holds blocks and a seat
    FINISHED = "finished"    # left the scheduler; blocks freed


class FinishReason(enum.Enum):
    LENGTH = "length"                    # max_tokens generated
    END_OF_SEQUENCE = "end_of_sequence"  # EOS or a stop token id
    STOP_SEQUENCE = "stop_sequence"      # a stop string matched (scheduler side)
    CONTEXT_LENGTH = "context_length"    # reached the model's context length
    CANCELLED = "cancelled"              # the client went away
    ABORTED = "aborted"                  # deadline, worker fault, shutdown


@dataclass(frozen=True)
class SamplingOptions:
    """Validated sampling parameters of one request (see validation.py)."""

    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0                # (0, 1]
    top_k: int = 0                    # 0 = off
    seed: int = 0                     # always set: the server draws one if absent
    max_tokens: int = 16              # >= 1
    stop: tuple[str, ...] = ()        # stop strings, matched on the scheduler side
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_p: float = 0.0                # [0, 1], 0 = off
    repetition_penalty: float = 1.0   # (0, 10], 1 = off; prompt + output
    presence_penalty: float = 0.0     # [-2, 2]; output only
    frequency_penalty: float = 0.0    # [-2, 2]; output only
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias), sorted by id
    min_tokens: int = 0               # EOS / stop ids / stop strings held off until then
    top_logprobs: int = 0             # 0..20 alternatives per sampled token
    prompt_logprobs: int | None = None   # None = off; else 0..20 alternatives
    n: int = 1                        # samples of the prompt (1..16)


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler sees it."""

    seq_id: int                        # internal id, unique per process
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    arrival_time: float                # time.monotonic() at admission
    priority: int = 0                  # higher boards first, is preempted last
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)   # the block table
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Tokens sampled by steps still running on the worker (the scheduler plans
    # step N+1 while step N runs): position num_tokens + i holds the i-th.
    num_pending_samples: int = 0
    num_cached_tokens: int = 0         # prompt tokens served by the prefix cache
                                       # at the first boarding (usage)
    cache_salt: str = ""               # prefix-cache namespace ("" = shared)
    tenant: str = ""                   # whose share it uses (fairness.py; "" = shared)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of
                                       # the first full blocks (block_manager.py)
    # n > 1: samples 1.. of a request wait (held) until sample 0, their
    # parent, has computed the prompt; they then share its full prompt blocks.
    parent: Request | None = None
    sample_index: int = 0
    # prompt_logprobs were asked for and are all in: later passes (after a
    # preemption) neither compute them again nor skip the prefix cache.
    prompt_logprobs_done: bool = False
    # Speculative decoding: whether drafts may be verified for it (not under a
    # grammar), the drafts of its chunk still out on the worker, and how many
    # tokens the latest applied step gave it (1, or 1 + drafts accepted).
    may_draft: bool = True
    num_draft_tokens: int = 0
    last_step_tokens: int = 0
    # LoRA (lora.py): the adapter's registration id (0: the base model), its
    # name and folder (a load needs them after an unload too), and the worker
    # slot it holds while on the worker (0: none or the base).
    lora_id: int = 0
    lora_name: str = ""
    lora_path: str = ""
    lora_slot: int = 0
    # Grammar jump-forward (config.jump_forward): whether it may skip sampling
    # forced tokens, and the forced run found when step ``forced_step``'s mask
    # was sent: forced_token_ids[0] is the token that step samples (at position
    # num_tokens, the only one its mask allows), the rest follow it. They are
    # planned as known tokens and join the output with that step's result.
    may_jump: bool = False
    forced_token_ids: list[int] = field(default_factory=list)
    forced_step: int = 0

    @property
    def penalised(self) -> bool:
        """Penalties that count the tokens so far (the worker keeps the counts)."""
        s = self.sampling
        return s.repetition_penalty != 1.0 or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are still to be computed (so no cached prefix is read)."""
        return self.sampling.prompt_logprobs is not None and not self.prompt_logprobs_done

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


class InvalidRequestError(ValueError):
    """A request field breaks a rule; ``field`` is its proto path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ValidatedRequest:
    """A generation request that passed every rule."""

    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    request_id: str
    priority: int = 0
    cache_salt: str = ""              # prefix-cache namespace; "" = shared
    tenant: str = ""                  # key name, else user / tenant field; "" = shared
    grammar: Any = None               # a grammar.CompiledGrammar: constrained output
    # special token ids the output text keeps (a tool format's markers, which the parser reads)
    keep_special: frozenset[int] = frozenset()
    lora: Any = None                  # a lora.Adapter: the request runs with it; None: the base model
    # The client reads each sampled token's logprob (gRPC always returns them; the
    # OpenAI doors only with logprobs=true): grammar jump-forward skips such requests.
    token_logprobs: bool = True
