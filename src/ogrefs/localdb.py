"""Local SQLite state files (index cache, chunk cache, materialization state).

Each is shared by the threads of one process and by several processes (two
mounts share a chunk cache), so every connection is WAL with a generous busy
timeout, autocommit unless a transaction is begun explicitly, and
``synchronous=NORMAL``: a commit lost to a power cut only makes data be
fetched again, never wrong. Callers keep one connection per thread.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path


def wal_connect(path: Path | str) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    return db

