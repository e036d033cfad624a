"""The Responses API's store: stored responses in SQLite, bounded and persistent.

One file, ``DIR/responses.sqlite3`` (WAL mode), one table: a response's id,
when it was stored, its size, the Response object and its conversation (the
items a later ``previous_response_id`` continues: the earlier turns, this
request's input, this response's output) as JSON. Each row holds its whole
conversation, so evicting an older response never breaks a later one's
chain (the price: turns shared by a chain are stored once per response).
Nothing of it stays in process memory: every call reads or writes the file.

Bounds, applied after each write (oldest evicted first):
  * age: a response older than ``max_age_s`` is deleted;
  * size: while the stored rows' bytes exceed ``max_bytes``, the oldest go
    (the file's freed pages return to the OS: incremental auto-vacuum).
    A single response larger than the cap is not stored.

All SQLite work runs on one thread of its own (the event loop never waits
on the disk; one writer, so no lock contention); callers await it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")
FILE_NAME = "responses.sqlite3"
DEFAULT_MAX_MB = 512.0
DEFAULT_MAX_AGE_S = 30 * 24 * 3600.0          # OpenAI keeps stored responses 30 days

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,   -- store order: the oldest first
    id TEXT NOT NULL UNIQUE,
    stored_at REAL NOT NULL,
    size INTEGER NOT NULL,
    response TEXT NOT NULL,
    items TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_stored_at ON responses(stored_at);
"""


class StoreError(Exception):
    """The store's folder or file cannot be used (at start)."""


def default_store_dir() -> Path:
    """``$JITNEY_STATE_DIR/responses``, else ``$XDG_STATE_HOME/jitney/responses``,
    else ``~/.local/state/jitney/responses``."""
    if root := os.environ.get("JITNEY_STATE_DIR"):
        return Path(root) / "responses"
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "jitney" / "responses"


@dataclass(frozen=True)
class StoreConfig:
    """Where and how much: ``directory`` None = no store (--no-responses-store)."""

    directory: Path | None
    max_bytes: int = int(DEFAULT_MAX_MB * 1024 * 1024)
    max_age_s: float = DEFAULT_MAX_AGE_S


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    items: list[dict[str, Any]]


class ResponseStore:
    """The SQLite store of ``config`` (its directory must be set). Raises StoreError."""

    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.time) -> None:
        assert config.directory is not None
        self.config, self.clock = config, clock
        self.path = config.directory / FILE_NAME
        self._total = 0         # the stored rows' bytes; read and written on the store's thread only
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="responses-store")
        try:
            self._db = self._thread.submit(self._open).result()
        except (OSError, sqlite3.Error) as exc:
            self._thread.shutdown()
            raise StoreError(f"the responses store {self.path}: {exc}") from None

    def _open(self) -> sqlite3.Connection:
        assert self.config.directory is not None
        self.config.directory.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None)   # autocommit; explicit transactions
        db.execute("PRAGMA auto_vacuum = INCREMENTAL")          # takes effect on a new file only
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")               # WAL: durable up to the last checkpoint
        db.executescript(_SCHEMA)
        self._total = int(db.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()[0])
        return db

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    # -- the API
    async def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> bool:
        """Store ``response`` (replacing one of its id) with its conversation;
        False when it alone exceeds the size cap (then it is not stored)."""
        text, items_text = json.dumps(response), json.dumps(items)
        return await self._run(lambda: self._put(response["id"], text, items_text))

    async def get(self, response_id: str) -> Stored | None:
        """The stored response and its conversation, or None (unknown, or aged out)."""
        row = await self._run(lambda: self._get(response_id))
        if row is None:
            return None
        return Stored(json.loads(row[0]), json.loads(row[1]))

    async def delete(self, response_id: str) -> bool:
        return await self._run(lambda: self._delete(response_id))

    async def stats(self) -> tuple[int, int]:
        """Rows stored and their bytes."""
        return await self._run(self._stats)

    def close(self) -> None:
        def shut() -> None:
            self._db.close()
        self._thread.submit(shut).result()
        self._thread.shutdown()

    # -- on the store's thread
    def _put(self, response_id: str, text: str, items_text: str) -> bool:
        size = len(text.encode()) + len(items_text.encode())
        if size > self.config.max_bytes:
            return False
        now = self.clock()
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._delete(response_id)
            self._db.execute("INSERT INTO responses (id, stored_at, size, response, items) "
                             "VALUES (?, ?, ?, ?, ?)", (response_id, now, size, text, items_text))
            self._total += size
            self._evict(now)
        self._db.execute("PRAGMA incremental_vacuum")
        return True

    def _evict(self, now: float) -> None:
        """Delete what is past the age cap, then the oldest while over the size cap.
        ``_total`` (the rows' bytes) is kept here, so no write sums the table."""
        cutoff = (now - self.config.max_age_s,)
        aged = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM responses WHERE stored_at < ?",
                                cutoff).fetchone()[0]
        if aged:
            self._db.execute("DELETE FROM responses WHERE stored_at < ?", cutoff)
            self._total -= int(aged)
        while self._total > self.config.max_bytes:
            cut = None
            for seq, size in self._db.execute("SELECT seq, size FROM responses ORDER BY seq LIMIT 64"):
                self._total -= size
                cut = seq
                if self._total <= self.config.max_bytes:
                    break
            if cut is None:
                break
            self._db.execute("DELETE FROM responses WHERE seq <= ?", (cut,))

    def _delete(self, response_id: str) -> bool:
        row = self._db.execute("DELETE FROM responses WHERE id = ? RETURNING size", (response_id,)).fetchall()
        if not row:
            return False
        self._total -= int(row[0][0])
        return True

    def _get(self, response_id: str) -> tuple[str, str] | None:
        row = self._db.execute("SELECT response, items, stored_at FROM responses WHERE id = ?",
                               (response_id,)).fetchone()
        if row is None or row[2] < self.clock() - self.config.max_age_s:
            return None
        return row[0], row[1]

    def _stats(self) -> tuple[int, int]:
        count, size = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
        return int(count), int(size)
