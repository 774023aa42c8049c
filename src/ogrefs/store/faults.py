"""FaultyStore: a wrapper that misbehaves on purpose, for fault-injection tests.

Real stores fail in a handful of ways, and each layer above must survive
them.  This wrapper reproduces them on demand, on top of any store:

* ``error_rate``      -- each call raises TransientError with this probability
  (before reaching the inner store: nothing happens).
* ``lost_ack_rate``   -- a put reaches the inner store, then raises
  TransientError anyway (the S3 "timeout after commit" case: the caller
  cannot tell whether the write happened).
* ``latency``         -- seconds added to every call (a number, or a
  ``(low, high)`` range drawn uniformly).
* ``streak_limit``    -- the two rates above hit one key at most this many
  calls in a row (a real store's transient faults end): a test whose
  caller retries more often than that cannot lose by a run of bad draws,
  whatever order the threads draw in.
* ``truncate_rate``   -- a get/get_range returns fewer bytes than it should,
  *silently*.  Real backends never do this (they raise ShortRead); a
  buggy proxy or disk might, and the layers above must notice by length
  and hash.
* ``corrupt_rate``    -- a get/get_range returns the right length with one
  bit flipped.
* ``fail_next(n, exc)`` -- the next ``n`` calls (optionally only of some
  operations) raise ``exc`` -- "fail twice, then succeed".
* ``fail_puts={3, 5}`` -- the 3rd and 5th put (1-based, counted over the
  store's life) raise TransientError without writing.
* ``fail_put_where=pred`` -- the first put whose key ``pred`` accepts raises
  TransientError without writing; ``pred`` sees every put's key, in the
  order the puts reach the store (under the wrapper's lock), so it can
  name an object by what came before it where threads put side by side
  and a position would not say which object it is.
* ``break_next_list(after=n)`` -- the next listing raises TransientError
  after yielding ``n`` keys (a connection dying between pages); a listing
  with ``n`` keys or fewer completes normally.
* ``break_next_range(after=n)`` -- the next ``open_range`` stream raises
  TransientError after delivering ``n`` bytes (a connection reset mid-body).
* ``down = True``     -- every call raises TransientError until set back,
  like a store that went away.

``ops`` limits the probabilistic faults to some operations (e.g.
``{"get_range"}``).  ``calls`` and ``injected`` count, per operation, what
happened, so tests can assert that a fault was actually exercised.

Determinism: all randomness comes from one ``random.Random(seed)``.  With a
single calling thread the same seed gives the same faults; with many
threads the interleaving (and therefore which call gets which draw) is up
to the scheduler.

Locking: ``_lock`` guards ``_rng``, ``_script``, ``_list_breaks``, ``_range_breaks``, ``_puts``, ``_streaks``
and the ``calls``/``injected`` counters.  It is never held while sleeping or while
calling the inner store.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator

from ogrefs.store.base import BytesRange, RangeReader, Store, StoreError, TransientError

__all__ = ["FaultyStore", "ALL_OPS"]

ALL_OPS = frozenset({"get", "get_range", "put", "exists", "list", "delete"})


class FaultyStore(Store):
    """Wrap ``inner`` and inject failures; see the module docstring for the knobs."""

    def __init__(self, inner: Store, *, seed: int = 0, error_rate: float = 0.0, lost_ack_rate: float = 0.0,
                 latency: float | tuple[float, float] = 0.0, truncate_rate: float = 0.0,
                 corrupt_rate: float = 0.0, fail_puts: Collection[int] = (), streak_limit: int | None = None,
                 ops: Collection[str] = ALL_OPS, sleep: Callable[[float], None] = time.sleep,
                 fail_put_where: Callable[[str], bool] | None = None) -> None:
        unknown = set(ops) - ALL_OPS
        if unknown:
            raise ValueError(f"unknown store operations: {sorted(unknown)}")
        self.inner = inner
        self.url = inner.url
        self.error_rate = error_rate
        self.lost_ack_rate = lost_ack_rate
        self.latency = latency
        self.truncate_rate = truncate_rate
        self.corrupt_rate = corrupt_rate
        self.fail_puts = frozenset(fail_puts)
        self._fail_put_where = fail_put_where  # None once it has failed a put
        self.streak_limit = streak_limit
        self._streaks: Counter[str] = Counter()  # key -> calls failed in a row by the rates
        self.ops = frozenset(ops)
        self.down = False
        self.calls: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self._sleep = sleep
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._script: list[tuple[frozenset[str], Callable[[str], StoreError]]] = []
        self._list_breaks: list[int] = []
        self._range_breaks: list[int] = []
        self._puts = 0

    # -- configuration ----------------------------------------------------

    def fail_next(self, n: int = 1, exc: type[StoreError] | StoreError = TransientError,
                  ops: Collection[str] = ALL_OPS) -> None:
        """Make the next ``n`` calls of ``ops`` raise ``exc`` (a class or an instance)."""
        which = frozenset(ops)

        def make(op: str) -> StoreError:
            if isinstance(exc, StoreError):
                return exc
            return exc(f"{self.url}: injected {exc.__name__} in {op}")

        with self._lock:
            self._script.extend([(which, make)] * n)

    def break_next_range(self, after: int) -> None:
        """Make the next ``open_range`` stream raise TransientError after delivering ``after`` bytes."""
        with self._lock:
            self._range_breaks.append(after)

    def break_next_list(self, after: int) -> None:
        """Make the next listing raise TransientError after yielding ``after`` keys."""
        with self._lock:
            self._list_breaks.append(after)

    def reset(self) -> None:
        """Forget scripted failures and counters; keep the rates."""
        with self._lock:
            self._script.clear()
            self._list_breaks.clear()
            self._range_breaks.clear()
            self.calls.clear()
            self.injected.clear()
            self.down = False

    # -- machinery --------------------------------------------------------

    def _chance(self, rate: float) -> bool:
        # caller holds _lock
        return rate > 0 and self._rng.random() < rate

    def _rate_fault(self, rate: float, key: str | None) -> bool:
        """A fault by ``rate`` for a call on ``key``, within the streak limit (caller holds _lock).

        A call on a key that failed ``streak_limit`` calls in a row gets none: the streak
        counts calls failed by the rates, and ends with a call that passes (:meth:`_passed`)."""
        if key is not None and self.streak_limit is not None and self._streaks[key] >= self.streak_limit:
            return False
        hit = self._chance(rate)
        if hit and key is not None:
            self._streaks[key] += 1
        return hit

    def _passed(self, key: str | None) -> None:
        """A call on ``key`` got through without a fault of the rates (caller holds _lock)."""
        if key is not None:
            self._streaks.pop(key, None)

    def _before(self, op: str, key: str | None = None) -> None:
        """Count the call, add latency, and raise whatever is due before the inner call."""
        error: StoreError | None = None
        with self._lock:
            self.calls[op] += 1
            if isinstance(self.latency, tuple):
                wait = self._rng.uniform(*self.latency)
            else:
                wait = float(self.latency)
            if op == "put":
                self._puts += 1
            for i, (which, make) in enumerate(self._script):
                if op in which:
                    del self._script[i]
                    error = make(op)
                    break
            if error is None and self.down:
                error = TransientError(f"{self.url}: store is down (injected) in {op}")
            if error is None and op == "put" and self._puts in self.fail_puts:
                error = TransientError(f"{self.url}: injected failure of put #{self._puts}")
            if error is None and op == "put" and self._fail_put_where is not None and self._fail_put_where(key or ""):
                self._fail_put_where = None
                error = TransientError(f"{self.url}: injected failure of put #{self._puts} ({key})")
            if error is None and op in self.ops and self._rate_fault(self.error_rate, key):
                error = TransientError(f"{self.url}: injected transient error in {op}")
            if error is not None:
                self.injected[op] += 1
            elif op != "put":  # (a put may still lose its acknowledgement)
                self._passed(key)
        if wait > 0:
            self._sleep(wait)
        if error is not None:
            raise error

    def _mangle(self, op: str, data: bytes) -> bytes:
        """Maybe truncate or bit-flip a read result."""
        if op not in self.ops or not data:
            return data
        with self._lock:
            if self._chance(self.truncate_rate):
                self.injected["truncate"] += 1
                return data[:self._rng.randrange(len(data))]
            if self._chance(self.corrupt_rate):
                self.injected["corrupt"] += 1
                pos = self._rng.randrange(len(data))
                bit = 1 << self._rng.randrange(8)
                flipped = bytearray(data)
                flipped[pos] ^= bit
                return bytes(flipped)
        return data

    # -- the interface ----------------------------------------------------

    def get(self, key: str) -> bytes:
        self._before("get", key)
        return self._mangle("get", self.inner.get(key))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        self._before("get_range", key)
        return self._mangle("get_range", self.inner.get_range(key, offset, length))

    def open_range(self, key: str, offset: int, length: int) -> RangeReader:
        data = self.get_range(key, offset, length)  # counted, failed and mangled as a get_range
        with self._lock:
            after = self._range_breaks.pop(0) if self._range_breaks else None
        return BytesRange(data) if after is None else _BrokenRange(data, after, self)

    def put(self, key: str, data: bytes) -> None:
        self._before("put", key)
        self.inner.put(key, data)
        with self._lock:
            lost = "put" in self.ops and self._rate_fault(self.lost_ack_rate, key)
            if lost:
                self.injected["lost_ack"] += 1
            else:
                self._passed(key)
        if lost:
            raise TransientError(f"{self.url}: injected lost acknowledgement of put {key}")

    def modified(self, key: str) -> float:
        self._before("modified", key)
        return self.inner.modified(key)

    def exists(self, key: str) -> bool:
        self._before("exists", key)
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        self._before("list")
        keys = self.inner.list(prefix)
        with self._lock:
            after = self._list_breaks.pop(0) if self._list_breaks else None
        return keys if after is None else self._broken_list(keys, after)

    def _broken_list(self, keys: Iterator[str], after: int) -> Iterator[str]:
        for i, key in enumerate(keys):
            if i == after:
                with self._lock:
                    self.injected["list_break"] += 1
                raise TransientError(f"{self.url}: injected failure after {after} listed keys")
            yield key

    def remove_stale_temporaries(self, older_than_s: float, dry_run: bool = False) -> tuple[int, int]:
        return self.inner.remove_stale_temporaries(older_than_s, dry_run)

    def delete(self, key: str) -> None:
        self._before("delete", key)
        self.inner.delete(key)

    def close(self) -> None:
        self.inner.close()


class _BrokenRange(RangeReader):
    """A stream whose connection "resets" after ``after`` bytes (see FaultyStore.break_next_range)."""

    def __init__(self, data: bytes, after: int, store: FaultyStore) -> None:
        self._data, self._after, self._store, self._pos = data, after, store, 0

    def read(self, n: int) -> bytes:
        if self._pos >= self._after:
            with self._store._lock:
                self._store.injected["range_break"] += 1
            raise TransientError(f"{self._store.url}: injected break after {self._after} bytes of a range")
        out = self._data[self._pos:min(self._pos + n, self._after)]
        self._pos += len(out)
        return out
