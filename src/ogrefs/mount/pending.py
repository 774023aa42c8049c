"""What a no-FUSE mount has not put in place yet, kept by ``ogrefs run``'s supervisor: its needs, ensure, settled.

The supervisor (``ogrefs.supervise``) asks ``needs(path)`` for every path
call of the job, about 25,000 for a Python start that imports torch: a socket
round trip each would cost more than the calls.  So :class:`PendingPaths`
loads, once, the daemon's list of every name not in place yet (control's
``pending``) into a set, with a count of pending names per directory and
the names that are not regular files (a symlink of the snapshot's is
followed: a path below a pending one is pending too), and keeps it current
from the daemon's log of what it settled (``since``): after every ``ensure``
and every :data:`REFRESH_S` seconds from a thread of its own.

Why a stale answer is safe (docs/mount.md, "ogrefs run without FUSE"):
names only leave the set when the daemon said they are in place (the log,
or an ``ensure`` answered ``ok``), and the daemon never takes a file back.
The set loaded is taken with the log's position under the engine's lock,
so every name settled after it is in the log after that position: the set
is always a superset of what is still to come.  A stale True costs one
``ensure`` answered ``ok`` at once; a False is never stale.

Who owns what: the refreshing side (the refresher thread, and waiter
threads after an ``ensure``) changes the sets under ``_lock``, one at a
time; ``needs`` reads them without the lock from any thread (single set and
dict lookups, atomic in CPython: a name read while another is removed is
seen either way, both true answers).
"""

from __future__ import annotations

import logging
import os
import posixpath
import threading
from pathlib import Path

from ogrefs.mount import control
from ogrefs.mount.control import NeedFailed, Updates

log = logging.getLogger(__name__)

#: How often the set is brought up to date with the daemon's log while the job runs (a stale True in between
#: costs one ``ensure`` answered at once, so this only saves round trips).
REFRESH_S = 1.0
#: The longest a load or a refresh may take (a pod's millions of names: tens of MB on a local socket).
LOAD_TIMEOUT_S = 120.0


class PendingPaths:
    """See the module docstring; :meth:`load` it, use it as a context manager around the supervised job."""

    def __init__(self, mountpoint: Path, updates: Updates) -> None:
        self.mountpoint = mountpoint
        self._names: set[str] = set()
        self._others: set[str] = set()  # pending names that are not regular files: maybe a symlink on the way
        self._dirs: dict[str, int] = {}  # directory -> pending names directly in it
        self._seq = updates.seq
        self._complete = updates.complete
        self._lock = threading.Lock()
        self._stop = threading.Event()
        for name, regular in updates.names:
            path = os.fsdecode(name)
            if path in self._names:
                continue
            self._names.add(path)
            if not regular:
                self._others.add(path)
            parent = posixpath.dirname(path)
            self._dirs[parent] = self._dirs.get(parent, 0) + 1

    @classmethod
    def load(cls, mountpoint: Path) -> "PendingPaths":
        """The daemon's pending names now; raises NeedFailed (one line) where it cannot be asked."""
        return cls(mountpoint, control.pending(mountpoint, LOAD_TIMEOUT_S))

    def __len__(self) -> int:
        return len(self._names)

    # -- the supervisor's three calls ------------------------------------------------------------------
    def needs(self, path: str) -> bool:
        """Whether ``path`` (absolute, lexical) may not be in place yet: a pending name, a directory with one,
        or a path below a pending non-regular entry (the snapshot's symlink, which the box has not yet)."""
        if self._complete:
            return False
        if path in self._names or path in self._dirs:
            return True
        if self._others:
            i = path.find("/", 1)
            while i > 0:
                if path[:i] in self._others:
                    return True
                i = path.find("/", i + 1)
        return False

    def ensure(self, path: str, whole: bool) -> None:
        """Block until the daemon says ``path`` is in place (``whole``: a directory's every entry too);
        OSError with the daemon's reason where it cannot be (the job's call then fails with EIO)."""
        try:
            answer = control.ask(self.mountpoint, os.fsencode(path), whole=whole)
        except NeedFailed as exc:  # the daemon went away while it was asked (a kill -9)
            answer = (f"failed the no-FUSE copy's daemon of {self.mountpoint} is gone ({exc.strerror}); the same "
                      "`ogrefs mount` resumes it")
        if answer.startswith("failed "):
            raise OSError(answer.removeprefix("failed "))
        if answer not in ("ok", "absent", "host"):
            raise OSError(f"the daemon of {self.mountpoint} answered {answer!r}")
        self.refresh()

    def settled(self) -> bool:
        return self._complete

    # -- keeping it current ---------------------------------------------------------------------------
    def refresh(self) -> None:
        """Drop what the daemon put in place since the last refresh; a daemon that cannot be asked leaves
        the set as it is (its waits then fail through ``ensure``)."""
        with self._lock:
            if self._complete:
                return
            try:
                updates = control.since(self.mountpoint, self._seq, LOAD_TIMEOUT_S)
            except NeedFailed as exc:
                log.debug("not refreshed: %s", exc)
                return
            for name, _regular in updates.names:
                self._drop(os.fsdecode(name))
            self._seq = updates.seq
            if updates.complete:
                self._complete = True

    def _drop(self, path: str) -> None:
        if path not in self._names:
            return
        self._names.discard(path)
        self._others.discard(path)
        parent = posixpath.dirname(path)
        left = self._dirs.get(parent, 1) - 1
        if left > 0:
            self._dirs[parent] = left
        else:
            self._dirs.pop(parent, None)

    def _refresher(self) -> None:
        while not self._stop.wait(REFRESH_S) and not self._complete:
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a bug here costs round trips (each ensure refreshes), never the job
                log.exception("the pending paths of %s were not refreshed", self.mountpoint)

    def __enter__(self) -> "PendingPaths":
        threading.Thread(target=self._refresher, name="ogrefs-pending", daemon=True).start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
