"""Requests on an Engine in this process (tests/scheduler/test_engine_faults.py,
tests/scheduler/test_fencing.py): a stand-in tokenizer that decodes each id to
a letter, and a request's whole stream."""

from __future__ import annotations

from typing import Any

from jitney.scheduler.core.engine import RequestHandle, StreamEvent


class LetterTokenizer:
    """Decodes id ``i`` to the letter ``chr(97 + i % 26)``; no special ids."""

    all_special_ids: list[int] = []

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


async def collect(handle: RequestHandle) -> list[StreamEvent]:
    """Every event of ``handle``'s stream, to its end."""
    return [event async for event in handle.stream()]
