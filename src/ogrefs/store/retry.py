"""Retrying wrapper: the one place in ogrefs that retries store calls.

Why one place: retries stacked at several layers multiply (6 x 6 x 6
attempts) and turn an outage into an hour-long hang.  Backends therefore
only *classify* failures (``TransientError`` or not) and this wrapper
decides how often and how long to try again.  Everything else --
NotFound, PermissionDenied, ShortRead, plain StoreError, ValueError -- is
passed through on the first occurrence, because repeating it cannot help.

How long: by default a call is tried ``attempts`` times (about 6 s of
backoff in all).  A caller that must ride through an outage says how long
each of its calls may take (restic's ``MaxElapsedTime``): ``retry_for``
seconds, given when the store is opened (``snapshot`` and ``restore`` with
``--retry-for``) or per caller with :meth:`RetryingStore.budget` (the mount's
fetcher: ``--retry-for``, and a stop event its unmount sets).  A call is then
retried, however often, until that much time has passed since it started,
and the last wait is cut so that the budget is not overrun by more than one
attempt.  A caller's stop event ends a wait at once: the call gives up with
the TransientError it had.

Streams: ``open_range`` retries the opening like any call, and a stream that
breaks part way (a TransientError from ``read``) is opened again from the
first byte not yet delivered, within the same budget counted from the last
byte that arrived (a long download that keeps making progress is never cut
off); its reader never sees the break.

Each attempt also has a wall-clock deadline (store/deadline.py): what is
left of the budget (at least ``deadline.MIN_ATTEMPT_S``), or
``deadline.ATTEMPT_S`` without one.  A backend shuts the attempt's
connection down then, so a store that trickles its answer a byte at a time
fails the attempt (a TransientError) instead of holding the call: a call
with ``retry_for`` ends within ``retry_for`` plus ``MIN_ATTEMPT_S`` (or the
time its bytes take at ``deadline.MIN_RATE``, if longer: a slow link is not
a stall), plus one connect timeout at worst, whatever the store does.

Backoff is exponential with jitter (each delay is drawn from the upper half
of the exponential step), so that many threads hitting the same outage do
not retry in lockstep.  ``sleep`` and ``rng`` are injectable so tests run
instantly and deterministically.

``list`` is special: it yields keys lazily, and a failure can come in the
middle.  A retry restarts the listing and skips keys already yielded, so a
caller never sees a key twice; the attempt counter resets whenever a retry
makes progress, since a long listing over a flaky link should finish.

Locking: ``_rng_lock`` guards ``_rng`` (random.Random is not documented as
thread-safe); the views :meth:`budget` makes share both.  Nothing else is
shared between calls; a resuming stream belongs to the one thread reading
it; the inner store does its own locking.
"""

from __future__ import annotations

import copy
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from ogrefs.store import deadline
from ogrefs.store.base import RangeReader, Store, TransientError

__all__ = ["RetryingStore", "RetryNote"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RetryNote:
    """One retry, as :attr:`RetryingStore.on_retry` hears of it: the call, its error, the attempt that failed,
    the wait before the next, and what is left (seconds of ``retry_for``, or attempts)."""

    what: str
    error: Exception
    attempt: int
    wait: float
    seconds_left: float | None
    attempts_left: int | None


class RetryingStore(Store):
    """Retry ``inner``'s TransientErrors with capped exponential backoff and jitter."""

    def __init__(self, inner: Store, attempts: int = 6, base_delay: float = 0.2, max_delay: float = 10.0,
                 *, retry_for: float | None = None, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None,
                 on_retry: "Callable[[RetryNote], None] | None" = None) -> None:
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        if retry_for is not None and not retry_for >= 0:
            raise ValueError("retry_for must be a number of seconds >= 0")
        self.retry_for = retry_for
        self._clock = clock
        self.inner = inner
        self.url = inner.url
        self.attempts = attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._sleep = sleep
        self._rng = rng if rng is not None else random.Random()
        self._rng_lock = threading.Lock()
        self._stop: threading.Event | None = None
        #: Retries made so far (by this view of the store: see budget()); read without the lock.
        self.retries = 0
        #: Told of every retry before its wait (the CLI prints a line, as restic does); runs in the caller's thread.
        self.on_retry = on_retry

    def budget(self, retry_for: float | None, stop: threading.Event | None = None) -> "RetryingStore":
        """This store, for one caller: each of its calls retries for ``retry_for`` seconds (None: ``attempts``
        tries), and a wait ends at once when ``stop`` is set (the call then gives up)."""
        if retry_for is not None and not retry_for >= 0:
            raise ValueError("retry_for must be a number of seconds >= 0")
        view = copy.copy(self)  # shares the inner store, the clock, the sleep and the (locked) rng
        view.retry_for, view._stop, view.retries = retry_for, stop, 0
        return view

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        step = min(self.max_delay, self.base_delay * (2 ** (retry - 1)))
        with self._rng_lock:
            jitter = self._rng.random()
        return step / 2 + jitter * step / 2

    def _wait_or_give_up(self, what: str, exc: TransientError, attempt: int, started: float) -> None:
        """Sleep before retry ``attempt + 1``, or raise when the attempts or the time budget are spent."""
        wait, left = self.delay(attempt), None
        if self.retry_for is None:
            if attempt >= self.attempts:
                raise TransientError(f"{exc} (gave up after {attempt} attempts)") from exc
        else:
            left = started + self.retry_for - self._clock()
            if left <= 0:
                raise TransientError(f"{exc} (gave up after {self.retry_for:.0f} s, {attempt} attempts)") from exc
            wait = min(wait, left)
        if self._stop is not None and self._stop.is_set():
            raise TransientError(f"{exc} (gave up: stopping)") from exc
        log.info("%s failed (%s); retry %d in %.2fs", what, exc, attempt, wait)
        if self.on_retry is not None:
            self.on_retry(RetryNote(what, exc, attempt, wait, left,
                                    None if self.retry_for is not None else self.attempts - attempt))
        with self._rng_lock:
            self.retries += 1
        if self._stop is None:
            self._sleep(wait)
        elif self._stop.wait(wait):
            raise TransientError(f"{exc} (gave up: stopping)") from exc

    def attempt_s(self, started: float) -> float:
        """Seconds the next attempt of a call that started at ``started`` may take (its deadline)."""
        if self.retry_for is None:
            return deadline.ATTEMPT_S
        return max(deadline.MIN_ATTEMPT_S, started + self.retry_for - self._clock())

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        started = self._clock()
        attempt = 0
        while True:
            attempt += 1
            try:
                with deadline.scope(self.attempt_s(started)):
                    return fn()
            except TransientError as exc:
                self._wait_or_give_up(what, exc, attempt, started)

    def get(self, key: str) -> bytes:
        return self._call(f"get {key}", lambda: self.inner.get(key))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self._call(f"get_range {key}", lambda: self.inner.get_range(key, offset, length))

    def open_range(self, key: str, offset: int, length: int) -> RangeReader:
        # the opening raises what the store says at once (NotFound, ShortRead, a refused key) ...
        first = self._call(f"open_range {key}", lambda: self.inner.open_range(key, offset, length))
        return _ResumingRange(self, key, offset, length, first)  # ... a break later is resumed

    def put(self, key: str, data: bytes) -> None:
        # Safe to repeat: a put that failed after the store committed it
        # just writes the same bytes again.
        self._call(f"put {key}", lambda: self.inner.put(key, data))

    def modified(self, key: str) -> float:
        return self._call(f"modified {key}", lambda: self.inner.modified(key))

    def exists(self, key: str) -> bool:
        return self._call(f"exists {key}", lambda: self.inner.exists(key))

    def remove_stale_temporaries(self, older_than_s: float, dry_run: bool = False) -> tuple[int, int]:
        return self._call("remove stale temporaries", lambda: self.inner.remove_stale_temporaries(older_than_s, dry_run))

    def delete(self, key: str) -> None:
        self._call(f"delete {key}", lambda: self.inner.delete(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        # Validate eagerly (the inner call does) so a bad prefix raises here,
        # not on the first next().
        first = self._call(f"list {prefix}", lambda: self.inner.list(prefix))
        return self._list(prefix, first)

    def _list(self, prefix: str, it: Iterator[str]) -> Iterator[str]:
        seen: set[str] = set()
        failures = 0
        started = self._clock()
        while True:
            progressed = False
            try:
                while True:
                    # each page in time (a budget from the last key), not the caller's time between keys
                    with deadline.scope(self.attempt_s(self._clock())):
                        key = next(it, None)
                    if key is None:
                        return
                    if key not in seen:
                        seen.add(key)
                        progressed = True
                        yield key
            except TransientError as exc:
                if progressed:
                    failures, started = 0, self._clock()
                failures += 1
                self._wait_or_give_up(f"list {prefix}", exc, failures, started)
            it = self._call(f"list {prefix}", lambda: self.inner.list(prefix))

    def close(self) -> None:
        self.inner.close()


class _ResumingRange(RangeReader):
    """A range whose stream, when it breaks, is opened again from the first byte not yet delivered.

    Owned by the one thread that reads it.  The budget of each resumption is
    counted from the last byte that arrived (see the module docstring).
    """

    def __init__(self, store: RetryingStore, key: str, offset: int, length: int, body: RangeReader) -> None:
        self._store = store
        self._key = key
        self._end = offset + length
        self._pos = offset
        self._body: RangeReader | None = body

    def read(self, n: int) -> bytes:
        failures = 0
        started = self._store._clock()
        while True:
            if self._pos >= self._end:
                return b""
            try:
                with deadline.scope(self._store.attempt_s(started)):
                    if self._body is None:
                        self._body = self._store.inner.open_range(self._key, self._pos, self._end - self._pos)
                    piece = self._body.read(n)
            except TransientError as exc:
                self._drop_body()
                failures += 1
                self._store._wait_or_give_up(f"open_range {self._key} at {self._pos}", exc, failures, started)
                continue
            self._pos += len(piece)
            return piece

    def _drop_body(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            try:
                body.close()
            except Exception:  # noqa: BLE001 - a broken stream may fail to close too; it is dropped either way
                pass

    def close(self) -> None:
        self._drop_body()
