"""A scripted worker that spells a target text under the grammar's masks.

In a masked chunk it picks, among the tokens the mask allows, the one whose text is
the longest prefix of what is left of ``target`` (llguidance allows only canonical
tokens where the grammar forces text, so a fixed token script would drift); when the
target is spelled or refused, EOS if allowed, else closing characters. ``rng`` set: a random allowed token instead
(biased towards JSON's closing characters so random walks end), for property tests.
Unmasked chunks spell ``plain`` as ScriptedWorker does.
"""

from __future__ import annotations

import random
from typing import Any

from jitney.engine.v1 import engine_pb2
from tests.support.scripted_worker import EOS, READY, VOCAB, ScriptedWorker, allowed


class TextWorker(ScriptedWorker):
    def __init__(self, tokenizer: Any, ready: engine_pb2.Ready = READY) -> None:
        super().__init__(tokenizer, ready)
        self.texts = [tokenizer.decode([t]) for t in range(VOCAB)]
        self.target = ""
        self.rng: random.Random | None = None
        self.spelled: dict[int, str] = {}
        self.spelled_end: dict[int, int] = {}   # seq_id -> the position after its last spelled token

    def _run_chunk(self, chunk: engine_pb2.ScheduledChunk) -> int | None:
        if not chunk.masked:
            return super()._run_chunk(chunk)
        if super(ScriptedWorker, self)._run_chunk(chunk) is None:
            return None
        sid = chunk.seq_id
        # Output tokens the chunk carries as input (a grammar's forced run, engine.py's jump-forward)
        # are spelled as if sampled.
        end = self.spelled_end.get(sid)
        for i, t in enumerate(chunk.token_ids):
            if end is not None and chunk.start_position + i >= end:
                self.spelled[sid] = self.spelled.get(sid, "") + self.texts[t]
                end = chunk.start_position + i + 1
        mask = self.masks[sid]
        ok = [t for t in range(VOCAB) if allowed(mask, t)]
        token = pick(ok, self.texts, self.target[len(self.spelled.get(sid, "")):], self.rng)
        self.spelled[sid] = self.spelled.get(sid, "") + (self.texts[token] if token != EOS else "")
        self.spelled_end[sid] = chunk.start_position + len(chunk.token_ids) + chunk.last_token_from_sample + 1
        self.masked_samples += 1
        self.seqs[chunk.seq_id].last_sampled = token
        return token


def pick(ok: list[int], texts: list[str], rest: str, rng: random.Random | None) -> int:
    """The next token among ``ok``: spelling ``rest``, or random with ``rng``."""
    if rng is not None:
        if EOS in ok and rng.random() < 0.5:
            return EOS
        closing = [t for t in ok if t != EOS and any(c in texts[t] for c in '"}]')]
        if closing and rng.random() < 0.6:
            return rng.choice(closing)
        return rng.choice(ok)
    best = max((t for t in ok if t != EOS and texts[t] and rest.startswith(texts[t])),
               key=lambda t: len(texts[t]), default=None)
    if best is not None:
        return best
    if EOS in ok:
        return EOS
    # Off the target (the grammar refused it): head for the end of the output.
    closing = [t for t in ok if texts[t] and texts[t][0] in '"}]\n<']
    return min(closing, key=lambda t: len(texts[t])) if closing else ok[0]


def walk_step(matcher: Any, mask: Any, texts: list[str], lead: str, output: str,
              rng: random.Random) -> int:
    """One token of a random walk under ``matcher``'s grammar, fed to it: what
    spells the rest of ``lead`` while ``output`` is a prefix of it, else random.
    ``mask``: one bitmask row (``allocate_bitmask(1, VOCAB)[0]``), reused."""
    matcher.fill_bitmask(mask)
    ok = [t for t in range(VOCAB) if allowed(mask.tobytes(), t)]
    rest = lead[len(output):] if lead.startswith(output) else ""
    token = pick(ok, texts, rest, None) if rest else pick(ok, texts, "", rng)
    assert matcher.accept_token(token), matcher.error()
    return token
