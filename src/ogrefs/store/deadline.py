"""A wall-clock deadline for every store request: a store that trickles cannot hold a call past its budget.

Why: a socket timeout (botocore's ``read_timeout``) is per ``recv``.  A server
that sends one byte every few seconds never trips it, and held a mount's
read, a mount's start, a restore and a snapshot for minutes each despite
``--retry-for 10`` (issue 46).  A thread blocked in ``recv`` cannot be
interrupted, but its socket can be shut down from another thread: the
``recv`` then returns at once, and the backend reports the broken answer as
a TransientError like any other.

How, in three parts:

* the retry layer (store/retry.py) opens a :func:`scope` around each attempt:
  the time that attempt may take (what is left of ``--retry-for``, at least
  :data:`MIN_ATTEMPT_S`; :data:`ATTEMPT_S` when the caller gave no budget);
* a backend opens a :func:`guard` around each request, from its first byte
  out to the last byte of its answer read: the connections the request
  takes from the pool (:func:`track`, called by the pool) and those it names
  (a stream's) are shut down when the scope's deadline passes, and the guard
  says so (``fired``) so the error can say why.  A request that moves many
  bytes (a pack put or read, each piece of a large object's body) is given
  at least the time they take at :data:`MIN_RATE` (``size=``,
  :meth:`Guard.allow`): a slow link is not a trickle, and a budget of 60 s
  must not fail every 32 MiB upload slower than 0.55 MB/s;
* one watchdog thread per process keeps the guards in a heap by deadline and
  shuts their sockets down then -- again every :data:`REABORT_S` until the
  guard ends, in case a connection was still being opened.

Locking: ``_Watchdog._cond`` guards the heap and every guard's ``conns`` and
``armed``; the watchdog thread shuts sockets down while holding it, so once
a guard has ended (disarmed under the lock) none of its sockets is touched
again -- a connection given back to the pool is never shut down afterwards.
The scope and the current guard are thread-local: each belongs to the one
thread making the request.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["ATTEMPT_S", "MIN_ATTEMPT_S", "MIN_RATE", "Guard", "guard", "scope", "track"]

#: An attempt without a budget (commands without ``--retry-for``) ends after this long: a 32 MiB pack
#: at 0.3 MB/s still arrives, a trickle does not hold the call for ever.
ATTEMPT_S = 120.0
#: However little of the budget is left, an attempt may take this long (``--retry-for 0`` is one attempt,
#: not none).
MIN_ATTEMPT_S = 2.0
#: The slowest transfer a request is given time for: bytes moved below this rate are a stall, not a link.
MIN_RATE = 256 * 1024  # bytes/s: a 32 MiB pack may take 128 s, a 6 KB answer has the budget alone
#: After the deadline, sockets of the guard are shut down again this often until the request ends.
REABORT_S = 0.25

_local = threading.local()


class Guard:
    """One request's connections and whether its deadline passed (see the module docstring)."""

    def __init__(self, at: float, conns: Iterable[Any] = ()) -> None:
        self.at = at
        self.conns: list[Any] = list(conns)
        self.armed = False
        self.fired = False

    def allow(self, size: int) -> None:
        """The request moves ``size`` more bytes from now: give them their time at MIN_RATE."""
        if self.armed and size > 0:
            _WATCHDOG.extend(self, time.monotonic() + size / MIN_RATE)

    def _abort(self) -> None:
        """Shut down the sockets of the request's connections (the watchdog thread, under its lock)."""
        for conn in self.conns:
            sock = getattr(conn, "sock", None)
            if isinstance(sock, socket.socket):
                try:  # the plain socket's shutdown: an SSL socket's own would also drop its state under a reader
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:
                    pass  # closed already, or never connected


class _Watchdog:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Guard]] = []
        self._armed = 0  # guards armed; the heap also holds ended ones until they come up (or a compaction)
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, g: Guard) -> None:
        with self._cond:
            g.armed = True
            self._armed += 1
            heapq.heappush(self._heap, (g.at, next(self._seq), g))
            if self._thread is None or not self._thread.is_alive():  # the first, or the first after a fork
                self._thread = threading.Thread(target=self._run, name="ogrefs-store-deadlines", daemon=True)
                self._thread.start()
            if self._heap[0][2] is g:  # only an earlier deadline than the one it waits for wakes the thread
                self._cond.notify()

    def disarm(self, g: Guard) -> None:
        with self._cond:
            if g.armed:
                g.armed = False
                self._armed -= 1
            if len(self._heap) > 1024 and len(self._heap) > 4 * self._armed:  # many fast requests: compact
                self._heap = [e for e in self._heap if e[2].armed]
                heapq.heapify(self._heap)

    def extend(self, g: Guard, at: float) -> None:
        with self._cond:
            if g.armed and not g.fired and at > g.at:
                g.at = at  # the entry in the heap, when it comes up, is pushed again at the new time

    def add(self, g: Guard, conn: Any) -> None:
        with self._cond:
            g.conns.append(conn)

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and not self._heap[0][2].armed:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                now = time.monotonic()
                at, _, g = self._heap[0]
                if at > now:
                    self._cond.wait(at - now)
                    continue
                heapq.heappop(self._heap)
                if g.at > at:  # extended since it was pushed
                    heapq.heappush(self._heap, (g.at, next(self._seq), g))
                    continue
                g.fired = True
                g._abort()
                heapq.heappush(self._heap, (now + REABORT_S, next(self._seq), g))


_WATCHDOG = _Watchdog()


@contextlib.contextmanager
def scope(seconds: float) -> Iterator[None]:
    """Requests of this thread in the block end within ``seconds`` (or an enclosing scope's deadline)."""
    outer = getattr(_local, "at", None)
    at = time.monotonic() + seconds
    _local.at = at if outer is None else min(outer, at)
    try:
        yield
    finally:
        _local.at = outer


@contextlib.contextmanager
def guard(conns: Iterable[Any] = (), size: int = 0) -> Iterator[Guard]:
    """One request: ``conns`` and the connections it takes are shut down at the scope's deadline, or once
    ``size`` bytes had time to move at MIN_RATE if that is later.

    Without a scope (a backend used without the retry layer) nothing is
    armed.  Inside another guard (a request made by a request), the outer
    one covers it.
    """
    outer: Guard | None = getattr(_local, "guard", None)
    if outer is not None:
        for conn in conns:
            _WATCHDOG.add(outer, conn)
        outer.allow(size)
        yield outer
        return
    at = getattr(_local, "at", None)
    if at is not None and size > 0:
        at = max(at, time.monotonic() + size / MIN_RATE)
    g = Guard(float("inf") if at is None else at, conns)
    if at is None:
        yield g
        return
    _local.guard = g
    _WATCHDOG.arm(g)
    try:
        yield g
    finally:
        _WATCHDOG.disarm(g)
        _local.guard = None


def track(conn: Any) -> None:
    """A connection this thread's current request took from a pool (called by the pool)."""
    g: Guard | None = getattr(_local, "guard", None)
    if g is not None and g.at != float("inf"):
        _WATCHDOG.add(g, conn)
