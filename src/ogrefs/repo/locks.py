"""Lock objects: who is using the repository, so prune never deletes under them.

A lock is ``locks/<random id>``, an envelope of JSON::

    {"id": ..., "kind": "shared" | "prune", "purpose": "snapshot" | "mount" | ...,
     "host": ..., "pid": ..., "created": <unix time>, "heartbeat": <unix time>}

* ``snapshot`` and ``mount`` hold *shared* locks; any number may coexist.
* ``prune`` holds the *prune* lock; only one prune runs at a time (a second
  refuses), but prune never waits for shared locks: it marks unreferenced
  packs as trash and deletes them in a later run, only once no lock that is
  older than the marking is still alive (docs/format.md, "Deleting data").
* Holders refresh ``heartbeat`` every ``REFRESH_S`` seconds from a daemon
  thread. A lock whose heartbeat is older than ``STALE_S`` belongs to a
  process that died; it is ignored and ``ogrefs unlock`` removes it.

Threading: a HeldLock owns one refresher thread; ``_stop`` (an Event) is set
by ``release``; the store is thread-safe.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from .. import codec
from ..errors import EXIT_LOCKED, CorruptObject, OgrefsError
from ..store.base import NotFound, Store, StoreError

REFRESH_S = 300.0
STALE_S = 1800.0
#: Allowed disagreement between the clocks of two boxes.
CLOCK_SKEW_S = 120.0


class LockedError(OgrefsError):
    """Another process holds a lock that excludes this operation."""

    exit_code = EXIT_LOCKED


@dataclass(frozen=True)
class LockInfo:
    id: str
    kind: str
    purpose: str
    host: str
    pid: int
    created: float
    heartbeat: float

    def stale(self, now: float | None = None) -> bool:
        return (now or time.time()) - self.heartbeat > STALE_S

    def describe(self) -> str:
        age = time.time() - self.created
        return f"{self.purpose} on {self.host} (pid {self.pid}), {age / 60:.0f} min old"


def _encode(info: LockInfo) -> bytes:
    return codec.wrap(json.dumps(info.__dict__).encode(), compress=False)


_LOCK_TYPES = {"id": (str,), "kind": (str,), "purpose": (str,), "host": (str,), "pid": (int,),
               "created": (int, float), "heartbeat": (int, float)}


def _decode(obj: bytes, key: str) -> LockInfo | None:
    """A lock object's content, or None if it is not a well-formed lock."""
    try:
        body = json.loads(codec.unwrap(obj, key))
    except (CorruptObject, ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    for name, types in _LOCK_TYPES.items():
        value = body.get(name)
        if type(value) not in types or (isinstance(value, float) and not math.isfinite(value)):
            return None
    if key != f"locks/{body['id']}":
        return None  # the id names the object that `unlock` deletes: it must be this one
    return LockInfo(**{k: body[k] for k in _LOCK_TYPES})


def read_locks(store: Store) -> list[LockInfo]:
    """Every well-formed lock object; unreadable ones are treated as absent (``unlock --all`` removes them)."""
    out = []
    for key in store.list("locks/"):
        try:
            info = _decode(store.get(key), key)
        except NotFound:
            continue  # released while we listed
        if info is not None:
            out.append(info)
    return out


class HeldLock:
    """A lock this process holds; use as a context manager."""

    def __init__(self, store: Store, kind: str, purpose: str, refresh_s: float = REFRESH_S) -> None:
        now = time.time()
        self.store = store
        self.info = LockInfo(secrets.token_hex(16), kind, purpose, socket.gethostname(), os.getpid(), now, now)
        self.key = f"locks/{self.info.id}"
        self._refresh_s = refresh_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> "HeldLock":
        if self.info.kind == "prune":
            others = [lk for lk in read_locks(self.store) if lk.kind == "prune" and not lk.stale()]
            if others:
                raise LockedError(f"another prune is running: {others[0].describe()} "
                                  "(if it died, `ogrefs unlock` removes stale locks)")
        try:
            self.store.put(self.key, _encode(self.info))
        except StoreError:
            # The put may have reached the store anyway (a lost acknowledgement): remove what
            # may be there, or prune would treat it as a live lock until it turns stale.
            try:
                self.store.delete(self.key)
            except StoreError:
                pass
            raise
        if self.info.kind == "prune":
            # Two prunes that started at the same moment: the lower id wins.
            rivals = [lk for lk in read_locks(self.store) if lk.kind == "prune" and not lk.stale()
                      and lk.id != self.info.id]
            if any(r.id < self.info.id for r in rivals):
                self.store.delete(self.key)
                raise LockedError("another prune started at the same time; try again later")
        self._thread = threading.Thread(target=self._refresh, name="ogrefs-lock", daemon=True)
        self._thread.start()
        return self

    def start_refresher(self) -> None:
        """(Re)start the heartbeat thread: after a fork only the forking thread survives."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="ogrefs-lock", daemon=True)
        self._thread.start()

    def hand_over(self) -> None:
        """Stop refreshing here without deleting the lock: another process (the daemon) owns it now."""
        self._stop.set()
        self._thread = None

    def _refresh(self) -> None:
        while not self._stop.wait(self._refresh_s):
            info = LockInfo(**{**self.info.__dict__, "heartbeat": time.time()})
            try:
                self.store.put(self.key, _encode(info))
                self.info = info
            except StoreError:
                continue  # try again next period; stale only after STALE_S without success

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.store.delete(self.key)
        except StoreError:
            pass

    def __enter__(self) -> "HeldLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def remove_stale_locks(store: Store, everything: bool = False) -> list[LockInfo]:
    removed = []
    for lk in read_locks(store):
        if everything or lk.stale():
            store.delete(f"locks/{lk.id}")
            removed.append(lk)
    return removed
