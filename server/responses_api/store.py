"""Stored responses: one SQLite file (stdlib sqlite3), so a conversation chained by previous_response_id
survives a restart.

A row holds the response as answered and the items of its conversation up to it (the previous
responses' inputs and outputs, then its own input): what `input_items` lists and what a response
chained to it continues. Retention: past `max_stored` rows the oldest go, and rows older than
`max_age_s`, checked on every write. The store owns its connection; each call holds its lock for one
short statement, fast enough to run on the event loop.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,   -- the response body as answered (JSON)
    items TEXT NOT NULL       -- the conversation's items up to this response's input (JSON list)
)"""


def default_path() -> Path:
    """responses.sqlite3 in ponder's data directory: $XDG_DATA_HOME/ponder, else ~/.local/share/ponder."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "ponder" / "responses.sqlite3"


@dataclass(frozen=True)
class Stored:
    response: dict
    items: list[dict]


class ResponseStore:
    def __init__(self, path: Path, max_stored: int, max_age_s: float) -> None:
        self.path = path
        self.max_stored = max_stored
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._connection: sqlite3.Connection | None = None  # opened on first use: a server never asked writes nothing

    @property
    def _db(self) -> sqlite3.Connection:
        if self._connection is None:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(_SCHEMA)
            os.chmod(self.path, 0o600)  # conversations are the users' own
            self._connection = db
        return self._connection

    def put(self, response: dict, items: list[dict]) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                             (response["id"], time.time(), json.dumps(response), json.dumps(items)))
            self._db.execute("DELETE FROM responses WHERE created_at < ?", (time.time() - self.max_age_s,))
            self._db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses "
                             "ORDER BY created_at DESC, rowid DESC LIMIT -1 OFFSET ?)", (self.max_stored,))

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            row = self._db.execute("SELECT response, items FROM responses WHERE id = ? AND created_at >= ?",
                                   (response_id, time.time() - self.max_age_s)).fetchone()
        return None if row is None else Stored(json.loads(row[0]), json.loads(row[1]))

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None


def response_store(settings) -> ResponseStore | None:
    """The store `settings` (server.config.ResponsesSettings) ask for, or None when storing is off."""
    if not settings.store:
        return None
    path = Path(settings.path).expanduser() if settings.path else default_path()
    return ResponseStore(path, settings.max_stored, settings.max_age_days * 86400)
