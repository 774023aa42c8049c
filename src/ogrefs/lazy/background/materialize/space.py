"""Disk-space policy of materialization: does the copy fit, and is an error a full disk.

Before anything is written, the bytes still needed plus a margin are compared
with the free space of the state directory (:func:`refusal`); a full disk
later (ENOSPC, EDQUOT, SQLITE_FULL: :func:`disk_full`) stops materialization
the same way, with a reason that says so (:func:`stop_reason`).  Pure
functions of their inputs; called in worker threads (statvfs) and on the
loop (the reasons).
"""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path
from typing import Callable

from ogrefs.units import GiB, MiB, human_bytes as human

#: (path) -> (bytes free for an unprivileged user, size of the file system): ``statvfs`` unless a test injects one.
FreeBytes = Callable[[Path], tuple[int, int]]


class Stop(Exception):
    """Materialization cannot go on (disk full, a write error); the loop turns it into a reason."""

    def __init__(self, cause: BaseException, what: str) -> None:
        super().__init__(f"{what}: {cause}")
        self.cause = cause
        self.what = what


def free_bytes(path: Path) -> tuple[int, int]:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def refusal(needed: int, state_dir: Path, reserve_bytes: int | None, free: FreeBytes = free_bytes) -> str | None:
    """Why ``needed`` bytes (plus a margin) do not fit in ``state_dir``; None when they do."""
    avail, size = free(state_dir)
    margin = reserve_bytes if reserve_bytes is not None else max(64 * MiB, min(GiB, size // 50))
    if needed and needed + margin > avail:
        return (f"not materializing: needs {human(needed + margin)} ({human(needed)} of data + "
                f"{human(margin)} margin), {human(avail)} free in {state_dir}")
    return None


def disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(exc, sqlite3.Error):
        return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "full" in str(exc).lower()
    return False


def stop_reason(exc: BaseException, what: str, state_dir: Path, done: int, total: int) -> str:
    """The user's one line for a stop: a full disk says so; anything else names the failure."""
    d, t = human(done), human(total)
    if disk_full(exc):
        return f"stopped: the disk of {state_dir} is full ({what}; {d} of {t} local); serving the rest lazily"
    return f"stopped: {what} failed ({exc}); {d} of {t} local, serving the rest lazily"
