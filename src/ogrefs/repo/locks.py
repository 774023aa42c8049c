"""Lock objects: who is using the repository, so prune never deletes under them.

A lock is ``locks/<random id>``, an envelope of JSON (sealed with the
repository key in an encrypted repository, so nobody without the key can
plant or read one)::

    {"id": ..., "kind": "shared" | "prune", "purpose": "snapshot" | "mount" | ...,
     "host": ..., "pid": ..., "created": <unix time>, "heartbeat": <unix time>,
     "boot_id": ..., "pid_ns": ..., "pid_start": ..., "snapshot": <id or null>}

* ``snapshot`` and ``mount`` hold *shared* locks; any number may coexist.
* ``prune`` holds the *prune* lock; only one prune runs at a time (a second
  refuses), but prune never waits for shared locks: it marks unreferenced
  packs as trash and deletes them in a later run, only once no lock that is
  older than the marking is still alive (docs/format.md, "Deleting data").
* Holders refresh ``heartbeat`` every ``REFRESH_S`` seconds from a daemon
  thread. A lock whose heartbeat is older than ``STALE_S`` belongs to a
  process that died; it is ignored and ``ogrefs unlock`` removes it.
* A heartbeat more than ``CLOCK_SKEW_S`` ahead of our clock (a clock far
  ahead, or a lock planted by a bucket writer) is not believed, or the lock
  would never turn stale (``unlock`` kept it, prune deferred deletion
  forever): the store's own clock says instead when the object was last
  written (``Store.modified``: S3's LastModified, a file's mtime).  A live
  holder rewrites it every ``REFRESH_S``, so the lock is stale ``STALE_S``
  after its last write whatever its heartbeat claims.
* A lock of *this* host (same host name, boot id and pid namespace) whose
  pid is gone, or now belongs to a process that started at another time, is
  stale at once (restic's rule): its holder died, whatever its heartbeat says.
* A mount's lock names the snapshot it serves (``snapshot``): prune then
  knows the mount reads only that snapshot's packs (prune.py).

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
from dataclasses import dataclass, field, replace
from typing import Any

from ogrefs.repo import codec
from ogrefs.errors import EXIT_LOCKED, CorruptObject, OgrefsError
from ogrefs.store.base import NotFound, Store, StoreError

REFRESH_S = 300.0
#: Upper bound on a lock object's size (it is a few hundred bytes of JSON).
MAX_LOCK_BYTES = 64 * 1024
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
    boot_id: str = ""
    pid_ns: int = 0
    pid_start: int = 0
    snapshot: str | None = None
    #: when the store last wrote the lock object, by its clock (read_locks fills it for a heartbeat from the
    #: future only; not part of the object)
    stored_at: float | None = field(default=None, compare=False)

    def stale(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return now - self.believed_heartbeat(now) > STALE_S or self.holder_dead()

    def believed_heartbeat(self, now: float) -> float:
        """The heartbeat, or for one from the future the store's time of the object's last write (never
        written as far as we know: stale)."""
        if self.heartbeat <= now + CLOCK_SKEW_S:
            return self.heartbeat
        return self.stored_at if self.stored_at is not None else -math.inf

    def holder_dead(self) -> bool:
        """True when the holder ran on this very machine and its process is gone.

        Host name, boot id and pid namespace must all match ours, or a pid means
        nothing here (another box, a reboot, a container with its own pids).
        """
        if not (self.boot_id and self.pid_ns and self.host == socket.gethostname()
                and self.boot_id == boot_id() and self.pid_ns == _pid_ns()):
            return False
        start = _pid_start(self.pid)
        return start is None or (self.pid_start != 0 and start != self.pid_start)

    def describe(self) -> str:
        age = time.time() - self.created
        return f"{self.purpose} on {self.host} (pid {self.pid}), {age / 60:.0f} min old"


def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``); empty where it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _pid_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None if there is no live process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError, ValueError):
        return None
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _this_process() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "boot_id": boot_id(), "pid_ns": _pid_ns(),
            "pid_start": _pid_start(pid) or 0}


def _encode(info: LockInfo, rc: codec.RepoCodec | None = None) -> bytes:
    body = json.dumps({k: v for k, v in info.__dict__.items() if k != "stored_at"}).encode()
    if rc is not None and rc.encrypted:
        return rc.seal(f"locks/{info.id}", body, compress=False)
    return codec.wrap(body, compress=False)


_LOCK_TYPES = {"id": (str,), "kind": (str,), "purpose": (str,), "host": (str,), "pid": (int,),
               "created": (int, float), "heartbeat": (int, float)}
_OPTIONAL_TYPES = {"boot_id": (str,), "pid_ns": (int,), "pid_start": (int,), "snapshot": (str, type(None))}


def _decode(obj: bytes, key: str, rc: codec.RepoCodec | None = None) -> LockInfo | None:
    """A lock object's content, or None if it is not a well-formed lock.

    In an encrypted repository only a lock sealed with the repository key counts.
    """
    if len(obj) > MAX_LOCK_BYTES:
        return None
    try:
        plain = rc.open(key, obj, MAX_LOCK_BYTES) if rc is not None else codec.unwrap(obj, key, MAX_LOCK_BYTES)
        body = json.loads(plain)
    except (CorruptObject, ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    for name, types in _LOCK_TYPES.items():
        value = body.get(name)
        if type(value) not in types or (isinstance(value, float) and not math.isfinite(value)):
            return None
    for name, types in _OPTIONAL_TYPES.items():
        if name in body and type(body[name]) not in types:
            return None
    if key != f"locks/{body['id']}":
        return None  # the id names the object that `unlock` deletes: it must be this one
    return LockInfo(**{k: body[k] for k in (*_LOCK_TYPES, *_OPTIONAL_TYPES) if k in body})


def read_locks(store: Store, rc: codec.RepoCodec | None = None) -> list[LockInfo]:
    """Every well-formed lock object; unreadable ones are treated as absent (``unlock --all`` removes them)."""
    out = []
    for key in store.list("locks/"):
        try:
            info = _decode(store.get(key), key, rc)
            if info is not None and info.heartbeat > time.time() + CLOCK_SKEW_S:
                info = replace(info, stored_at=_stored_at(store, key))
        except NotFound:
            continue  # released while we listed
        if info is not None:
            out.append(info)
    return out


def _stored_at(store: Store, key: str) -> float | None:
    """When the store last wrote ``key`` (NotFound: released meanwhile), or None if it cannot tell."""
    try:
        return store.modified(key)
    except NotFound:
        raise
    except StoreError:
        return None


class HeldLock:
    """A lock this process holds; use as a context manager."""

    def __init__(self, store: Store, kind: str, purpose: str, refresh_s: float = REFRESH_S,
                 rc: codec.RepoCodec | None = None, snapshot: str | None = None) -> None:
        now = time.time()
        self.store = store
        self._rc = rc
        self.info = LockInfo(id=secrets.token_hex(16), kind=kind, purpose=purpose, created=now, heartbeat=now,
                             snapshot=snapshot, **_this_process())
        self.key = f"locks/{self.info.id}"
        self._refresh_s = refresh_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> "HeldLock":
        if self.info.kind == "prune":
            others = [lk for lk in read_locks(self.store, self._rc) if lk.kind == "prune" and not lk.stale()]
            if others:
                raise LockedError(f"another prune is running: {others[0].describe()} "
                                  "(if it died, `ogrefs unlock` removes stale locks)")
        try:
            self.store.put(self.key, _encode(self.info, self._rc))
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
            rivals = [lk for lk in read_locks(self.store, self._rc) if lk.kind == "prune" and not lk.stale()
                      and lk.id != self.info.id]
            if any(r.id < self.info.id for r in rivals):
                self.store.delete(self.key)
                raise LockedError("another prune started at the same time; try again later")
        self._thread = threading.Thread(target=self._refresh, name="ogrefs-lock", daemon=True)
        self._thread.start()
        return self

    def set_snapshot(self, snapshot: str) -> None:
        """Say which snapshot this lock's holder reads (a mount): prune protects only its packs then.

        Until this is written the lock protects everything, as any lock without a snapshot does.
        """
        self.info = LockInfo(**{**self.info.__dict__, "snapshot": snapshot})
        self.store.put(self.key, _encode(self.info, self._rc))

    def start_refresher(self) -> None:
        """(Re)start the heartbeat thread: after a fork only the forking thread survives.

        In a new process (the forked mount daemon) the lock is rewritten at once
        with this process's pid: the parent that took it is about to exit, and a
        lock whose pid is dead on this host counts as stale.
        """
        if self._thread is not None and self._thread.is_alive():
            return
        if self.info.pid != os.getpid():
            self.info = LockInfo(**{**self.info.__dict__, **_this_process(), "heartbeat": time.time()})
            self.store.put(self.key, _encode(self.info, self._rc))
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
                self.store.put(self.key, _encode(info, self._rc))
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


def remove_stale_locks(store: Store, everything: bool = False, rc: codec.RepoCodec | None = None) -> list[LockInfo]:
    """Delete stale locks (``everything``: every lock object, unreadable ones included); returns what went."""
    removed = []
    readable = set()
    for lk in read_locks(store, rc):
        readable.add(f"locks/{lk.id}")
        if everything or lk.stale():
            store.delete(f"locks/{lk.id}")
            removed.append(lk)
    if everything:
        for key in store.list("locks/"):
            if key not in readable:
                store.delete(key)
    return removed
