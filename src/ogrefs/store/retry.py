"""Retrying wrapper: the one place in ogrefs that retries store calls.

Why one place: retries stacked at several layers multiply (6 x 6 x 6
attempts) and turn an outage into an hour-long hang.  Backends therefore
only *classify* failures (``TransientError`` or not) and this wrapper
decides how often and how long to try again.  Everything else --
NotFound, PermissionDenied, ShortRead, plain StoreError, ValueError -- is
passed through on the first occurrence, because repeating it cannot help.

Backoff is exponential with jitter (each delay is drawn from the upper half
of the exponential step), so that many threads hitting the same outage do
not retry in lockstep.  ``sleep`` and ``rng`` are injectable so tests run
instantly and deterministically.

``list`` is special: it yields keys lazily, and a failure can come in the
middle.  A retry restarts the listing and skips keys already yielded, so a
caller never sees a key twice; the attempt counter resets whenever a retry
makes progress, since a long listing over a flaky link should finish.

Locking: ``_rng_lock`` guards ``_rng`` (random.Random is not documented as
thread-safe).  Nothing else is shared between calls; the inner store does
its own locking.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from .base import RangeReader, Store, TransientError

__all__ = ["RetryingStore"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class RetryingStore(Store):
    """Retry ``inner``'s TransientErrors with capped exponential backoff and jitter."""

    def __init__(self, inner: Store, attempts: int = 6, base_delay: float = 0.2, max_delay: float = 10.0,
                 *, sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None) -> None:
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.inner = inner
        self.url = inner.url
        self.attempts = attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._sleep = sleep
        self._rng = rng if rng is not None else random.Random()
        self._rng_lock = threading.Lock()

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        step = min(self.max_delay, self.base_delay * (2 ** (retry - 1)))
        with self._rng_lock:
            jitter = self._rng.random()
        return step / 2 + jitter * step / 2

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except TransientError as exc:
                if attempt == self.attempts:
                    raise TransientError(f"{exc} (gave up after {attempt} attempts)") from exc
                wait = self.delay(attempt)
                log.info("%s failed (%s); retry %d/%d in %.2fs", what, exc, attempt, self.attempts - 1, wait)
                self._sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover

    def get(self, key: str) -> bytes:
        return self._call(f"get {key}", lambda: self.inner.get(key))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self._call(f"get_range {key}", lambda: self.inner.get_range(key, offset, length))

    def open_range(self, key: str, offset: int, length: int) -> RangeReader:
        # Only the opening is retried: a stream that breaks later is the reader's to restart
        # (the fetcher asks again for the chunks it has not received).
        return self._call(f"open_range {key}", lambda: self.inner.open_range(key, offset, length))

    def put(self, key: str, data: bytes) -> None:
        # Safe to repeat: a put that failed after the store committed it
        # just writes the same bytes again.
        self._call(f"put {key}", lambda: self.inner.put(key, data))

    def exists(self, key: str) -> bool:
        return self._call(f"exists {key}", lambda: self.inner.exists(key))

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
        while True:
            progressed = False
            try:
                for key in it:
                    if key not in seen:
                        seen.add(key)
                        progressed = True
                        yield key
                return
            except TransientError as exc:
                failures = 1 if progressed else failures + 1
                if failures >= self.attempts:
                    raise TransientError(f"{exc} (gave up after {failures} attempts)") from exc
                wait = self.delay(failures)
                log.info("list %s failed (%s); restarting in %.2fs", prefix, exc, wait)
                self._sleep(wait)
            it = self._call(f"list {prefix}", lambda: self.inner.list(prefix))

    def close(self) -> None:
        self.inner.close()
