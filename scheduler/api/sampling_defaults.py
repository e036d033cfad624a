"""The server's sampling defaults from the model's generation config (``--generation-config``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from jitney.scheduler.api.validation import MAX_REPETITION_PENALTY, MAX_TEMPERATURE
from jitney.v1 import generation_pb2 as pb


@dataclass(frozen=True)
class SamplingDefaults:
    """The server's defaults for sampling fields a request leaves unset, from
    the model's generation config (``--generation-config``), on both doors.

    None: the door's own default (gRPC: temperature 0, i.e. greedy; the
    OpenAI door: temperature 1; top_p 1, top_k and min_p off, no repetition
    penalty; max_tokens up to the context, 16 for an OpenAI completion).
    ``max_tokens`` (the config's ``max_new_tokens``) is capped by the room the
    prompt leaves in the context, and never below the request's min_tokens.
    As vLLM: only the keys the file sets count, and ``do_sample`` is not read.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    source: str = ""      # where they came from, for the start-up line

    @classmethod
    def from_config(cls, values: Mapping[str, Any], source: str) -> "SamplingDefaults":
        """From a generation config's values (``jitney.common.model_files.generation_config``).
        Raises ValueError naming ``source`` and the key whose value Jitney's
        request validation would refuse."""
        def number(key: str, ok: Any, rule: str) -> float | None:
            value = values.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not ok(value):
                raise ValueError(f"{source}: {key} must be {rule}, got {value!r} "
                                 "(--generation-config none ignores the file)")
            return float(value)

        def integer(key: str, low: int) -> int | None:
            value = number(key, lambda v: float(v).is_integer() and v >= low, f"an integer >= {low}")
            return None if value is None else int(value)

        top_k = integer("top_k", -1)
        return cls(
            temperature=number("temperature", lambda v: 0 <= v <= MAX_TEMPERATURE, f"in [0, {MAX_TEMPERATURE:g}]"),
            top_p=number("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
            top_k=None if top_k is None else max(top_k, 0),     # -1 is vLLM's "off", as 0 is Jitney's
            min_p=number("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
            repetition_penalty=number("repetition_penalty", lambda v: 0 < v <= MAX_REPETITION_PENALTY,
                                      f"in (0, {MAX_REPETITION_PENALTY:g}]"),
            max_tokens=integer("max_new_tokens", 1),
            source=source,
        )

    def values(self) -> dict[str, float | int]:
        """The defaults that are set, by SamplingParams field name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "source" and getattr(self, f.name) is not None}

    def describe(self) -> str:
        """One line for the start-up log: which defaults, from where."""
        names = {"max_tokens": "max_tokens (max_new_tokens)"}
        listed = ", ".join(f"{names.get(k, k)}={v:g}" for k, v in self.values().items())
        return f"sampling defaults from {self.source}: {listed}; a request's own values override them"

    def needs_fill(self, sampling: pb.SamplingParams) -> bool:
        """Whether ``fill`` would set a field of ``sampling``."""
        return any(name != "max_tokens" and not sampling.HasField(name) for name in self.values())

    def fill(self, sampling: pb.SamplingParams, vocab_size: int) -> None:
        """Set the fields of ``sampling`` that are unset and have a default here:
        all but max_tokens, which needs the prompt's length (``max_tokens_for``).
        top_k is capped at the vocabulary (the same filter: none)."""
        for name, value in self.values().items():
            if name != "max_tokens" and not sampling.HasField(name):
                setattr(sampling, name, min(int(value), vocab_size) if name == "top_k" else value)

    def max_tokens_for(self, sampling: pb.SamplingParams, resolved: int, min_tokens: int) -> int:
        """The max_tokens of a request, ``resolved`` being what validation made of
        it: the default (capped by ``resolved``, the room the context leaves, and
        at least ``min_tokens``) when the request set none."""
        if self.max_tokens is None or sampling.HasField("max_tokens"):
            return resolved
        return min(resolved, max(self.max_tokens, min_tokens))
