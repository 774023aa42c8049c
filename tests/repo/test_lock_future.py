"""A lock whose heartbeat is in the future (a clock far ahead, or a lock planted by a bucket writer): judged
by when the store last wrote it, never eternal (issue 46)."""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

import pytest

from ogrefs.maint.prune import _live_locks
from ogrefs.repo import Repository, codec
from ogrefs.repo.locks import STALE_S, HeldLock, read_locks, remove_stale_locks

pytestmark = pytest.mark.timeout(60)
YEAR = 365 * 24 * 3600.0


def _plant(tmp_path: Path, heartbeat: float, written: float) -> str:
    """A well-formed shared lock object with ``heartbeat``, which the store last wrote at ``written``."""
    lock_id = secrets.token_hex(16)
    body = {"id": lock_id, "kind": "shared", "purpose": "mount", "host": "elsewhere", "pid": 1,
            "created": heartbeat, "heartbeat": heartbeat}
    path = tmp_path / "repo" / "locks" / lock_id
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(codec.wrap(json.dumps(body).encode(), compress=False))
    os.utime(path, (written, written))  # the store's clock: a file's mtime, S3's LastModified
    return lock_id


def test_a_heartbeat_from_the_future_is_stale_once_the_object_is_old(tmp_path):
    """Heartbeat ten years ahead, object written two stale periods ago: stale, `unlock` removes it, prune
    does not wait for it.  Before the fix: never stale, kept by `unlock`, prune deferred deletion forever."""
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    now = time.time()
    old = _plant(tmp_path, heartbeat=now + 10 * YEAR, written=now - 2 * STALE_S)
    fresh = _plant(tmp_path, heartbeat=now + 10 * YEAR, written=now)  # may be a live holder's skewed clock
    assert {lk.id for lk in _live_locks(repo)} == {fresh}
    assert [lk.id for lk in remove_stale_locks(repo.store)] == [old]
    assert [lk.id for lk in read_locks(repo.store)] == [fresh]
    (later,) = read_locks(repo.store)
    assert later.stale(now + STALE_S + 60)  # the same object, unwritten for a stale period


def test_a_live_holder_whose_clock_is_ahead_stays_live(tmp_path, monkeypatch):
    """A holder an hour ahead rewrites its lock every refresh: it is never stale while it lives."""
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    held = HeldLock(repo.store, "shared", "mount").acquire()
    monkeypatch.setattr(time, "time", real)
    try:
        assert [lk.id for lk in _live_locks(repo)] == [held.info.id]
        assert remove_stale_locks(repo.store) == []
        (seen,) = read_locks(repo.store)
        assert seen.stored_at is not None and abs(seen.stored_at - real()) < 60
    finally:
        held.release()
