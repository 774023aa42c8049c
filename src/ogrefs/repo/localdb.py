"""Local SQLite state files (index cache, chunk cache, materialization state).

Each is shared by the threads of one process and by several processes (two
mounts share a chunk cache), so every connection is WAL with a generous busy
timeout, autocommit unless a transaction is begun explicitly, and
``synchronous=NORMAL``: a commit lost to a power cut only makes data be
fetched again, never wrong. Callers keep one connection per thread.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path


def _make_private(path: Path | str) -> None:
    """Create ``path`` 0600 (or make it so): SQLite gives its -wal and -shm files the database's mode.

    These files name chunks, sizes and access times: nothing for other users of the box.

    The database file is never opened here once it exists: closing any
    descriptor of a file drops every POSIX lock this process holds on it,
    SQLite's included, so another process (a second mount sharing a chunk
    cache, the materializer's tree-build child) would see no reader, take the
    file over at its close, checkpoint and delete the WAL under this
    process's connections ("disk I/O error" on their next write).
    """
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    for side in (str(path), f"{path}-wal", f"{path}-shm"):
        with contextlib.suppress(FileNotFoundError):
            if os.stat(side).st_mode & 0o077:
                os.chmod(side, 0o600)


def wal_connect(path: Path | str) -> sqlite3.Connection:
    _make_private(path)
    db = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    return db

