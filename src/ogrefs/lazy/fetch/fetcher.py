"""Fetch chunks on demand: memory → disk cache → one ranged GET per run of adjacent chunks.

The fetch path every lazy reader shares, at its priority: the vfs's reads
(``Priority.READ``), the replay of a recorded trace (``TRACE``), the hints
(``HINT``), and the streamed rest and materialization (``BACKGROUND``):

1. ``get(ref)`` answers from memory: the :class:`~ogrefs.lazy.fetch.residency.Residency`
   it was given holds the LRU of verified chunks, the chunks a replay holds for
   the materializer (``Residency.hold``) and the chunks the materializer has
   in hand; the fetcher asks it first and puts what it fetches there.
2. Otherwise the chunk gets exactly one *pending* entry, however many readers
   want it (registered in the residency: the chunk is *coming*); later callers
   wait on the same entry (single flight) and a caller with a more urgent
   priority raises the entry's priority.
3. New entries are looked up in the disk cache (:class:`ChunkCache`) in a
   worker thread, all entries of one request at once; hits are loaded and
   verified there, a few per thread call, and finish their entries.
4. A miss goes into the request queue (:mod:`ogrefs.lazy.fetch.queue`): the
   dispatcher starts store requests in priority order, a reader never waits
   behind prefetch or materialization, and a request takes every queued
   chunk near it in the same pack into one ranged GET.
5. The response is read as it arrives;  each blob is decoded and
   BLAKE3-verified in the reading worker thread as soon as its bytes are in,
   handed to its waiters, put in the memory LRU and written to the
   disk cache (also in a thread) without delaying the readers.  The worker
   threads' side (ranged reads, blob cutting, the one error classifier) is
   :mod:`ogrefs.lazy.fetch.blobio`.  A blob that fails verification is fetched
   once more on its own (a bit flipped in transit: a policy about bad bytes,
   not a retry of a failing call); if it fails again the waiters get
   :class:`ChunkCorrupt`.  The fetcher itself never retries a store call:
   the store's RetryingStore does, within the budget the mount gave its
   :class:`~ogrefs.lazy.fetch.blobio.PackReads` (``--retry-for``; a stream that
   breaks part way is resumed there too), and an unmount ends such a wait at
   once (``stop``).  What fails after that is classified once
   (:func:`~ogrefs.lazy.fetch.blobio.classify`): an unreachable store is
   :class:`StoreUnavailable`, a pack the store no longer has
   :class:`ChunkMissing`, a location the store refuses :class:`ChunkCorrupt`,
   and an exception nobody expected is logged and a plain
   :class:`FetchError`: in every case EIO for the chunks of that request
   only, never a dead nursery.  Failures are not remembered: the next read
   tries again.

Who owns what: all state of a Fetcher (its pending entries, request queue,
counters) belongs to the trio loop and is only touched by trio tasks, so it
needs no locks.  Worker threads get immutable inputs (a pack name and range; a
read-only view of downloaded bytes; a chunk id and its bytes) and return new
objects.  :meth:`Fetcher.run` owns the nursery in which the dispatcher, every
store request, cache probe and cache write run; cancelling it stops them all
and sets ``stop`` (a threading.Event the store's retry waits watch).
Where each chunk is (memory, held, in hand, coming, in the local tree) is the
:class:`~ogrefs.lazy.fetch.residency.Residency`'s, given at construction and shared
with the materializer; the fetcher only calls its mutators on the loop.  A
chunk just fetched from the store for a caller that keeps it is offered to it
(:meth:`Residency.adopt`); when the local tree takes the chunk, the chunk
cache does without it.  While a snapshot of the box runs
(:meth:`Fetcher.yield_to_snapshot`, called on the loop by the daemon's
:class:`~ogrefs.lazy.background.snapshotgate.SnapshotGate`), hint and background requests
and every write to the disk cache wait on the loop-owned ``_not_yielding``
event; reads and the trace are served as ever.
"""

from __future__ import annotations

import enum
import functools
import logging
import sqlite3
import threading
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import trio

from ogrefs.repo import codec
from ogrefs.lazy.fetch import blobio as fetchio
from ogrefs.lazy.fetch.chunkcache import ChunkCache
from ogrefs.lazy.fetch.residency import IN_MEMORY, IN_TREE, Residency
from ogrefs.lazy.fetch.queue import Priority, RequestQueue
from ogrefs.lazy.fetch.blobio import (  # noqa: F401 - re-exported: the fetcher's callers name them from here
    ChunkCorrupt, ChunkMissing, DecodeBlob, FetchError, OpenRange, ReadRange, StoreUnavailable)
from ogrefs.repo.chunkref import ChunkRef
from ogrefs.errors import CorruptObject
from ogrefs.inspect.machine import usable_cpus
from ogrefs.store.base import BytesRange
from ogrefs.units import MiB

log = logging.getLogger(__name__)


#: A failing cache never fails a read: it only costs a fetch.
_CACHE_ERRORS = (OSError, sqlite3.Error)
#: Cached chunks loaded and verified by one worker-thread call.
_PROBE_BATCH = 4
class Keep(enum.IntEnum):
    """Where a fetched chunk is kept besides the callers waiting for it."""

    NONE = 0  # nowhere (materialization writes it to its file)
    MEMORY = 1  # the memory LRU
    LOCAL = 2  # the memory LRU, and the local tree if it takes it, never the disk cache (a large file streamed)
    ALL = 3  # the memory LRU, and the local tree if it takes it, else the disk cache


@dataclass
class FetchStats:
    hits_memory: int = 0  # chunk requests answered from the memory LRU
    hits_disk: int = 0  # ... from the disk cache
    misses: int = 0  # chunks that needed a store request
    requests: int = 0  # ranged GETs that returned data
    bytes_fetched: int = 0  # bytes those GETs returned
    bytes_bridged: int = 0  # of those, bytes of gaps read across and dropped (bridged requests)
    chunks_fetched: int = 0  # chunks decoded and verified from the store
    read_missed_bytes: int = 0  # plaintext bytes of chunks an application read that were not in memory
    retries: int = 0  # store calls the store repeated after a transient failure (``retries`` given)
    corrupt: int = 0  # blobs that failed verification
    errors: int = 0  # chunk deliveries that failed
    cache_write_errors: int = 0


class _Pending:
    """One chunk on its way; the single flight every reader of the chunk waits on."""

    __slots__ = ("ref", "priority", "seq", "state", "done", "data", "error", "keep", "bridge", "hold")

    def __init__(self, ref: ChunkRef, priority: Priority, keep: int = Keep.ALL) -> None:
        self.ref = ref
        self.priority = priority
        self.keep = keep  # Keep level: where the chunk goes once fetched (the most any caller asked for)
        self.bridge = False  # its GET may read across gaps of unwanted blobs (see Fetcher.request)
        self.hold = False  # held in memory until taken (a replay for the materializer; see Residency.hold)
        self.seq = 0
        self.state = "probe"  # probe -> queued -> fetching -> (removed)
        self.done = trio.Event()
        self.data: bytes | None = None
        self.error: FetchError | None = None


class Ticket:
    """One chunk asked for with :meth:`Fetcher.request`; it holds the result until it is awaited."""

    __slots__ = ("ref", "_pending", "_data")

    def __init__(self, ref: ChunkRef, pending: _Pending | None, data: bytes | None) -> None:
        self.ref = ref
        self._pending = pending
        self._data = data

    @property
    def ready(self) -> bool:
        """Whether the chunk came from memory at once (nothing to wait for, nothing on its way)."""
        return self._data is not None

    def peek(self) -> bytes | None:
        """The chunk's verified plaintext if it has arrived, else None (never waits, never raises)."""
        if self._data is not None:
            return self._data
        p = self._pending
        return p.data if p is not None and p.error is None else None

    async def result(self) -> bytes:
        """The chunk's verified plaintext; raises :class:`FetchError`."""
        if self._data is not None:
            return self._data
        p = self._pending
        assert p is not None
        await p.done.wait()
        if p.error is not None:
            raise type(p.error)(p.error.ref, p.error.reason)
        assert p.data is not None
        return p.data


class Fetcher:
    """Delivers verified chunk plaintext to trio tasks; see the module docstring."""

    def __init__(self, read_range: ReadRange, cache: ChunkCache | None = None, *, max_requests: int = 8,
                 reserved_for_read: int = 2, max_range: int = 16 * MiB, max_gap: int = 256 * 1024,
                 memory_bytes: int = 128 * MiB, decode_threads: int | None = None,
                 decode: DecodeBlob = codec.decode_blob, open_range: OpenRange | None = None,
                 stop: threading.Event | None = None, retries: Callable[[], int] | None = None,
                 residency: Residency | None = None) -> None:
        """``read_range``/``open_range``: the packs (a :class:`~ogrefs.lazy.fetch.blobio.PackReads`' methods
        carry the caller's retry budget); ``stop``: set when :meth:`run` ends, so that a store call waiting
        out an outage in a worker thread gives up at once; ``retries``: how many store calls were retried
        (the PackReads' count, for :attr:`stats`); ``residency``: where chunks are (memory, the local tree),
        shared with the materializer; a fresh one whose memory LRU holds ``memory_bytes`` when not given."""
        self._queue = RequestQueue(max_requests, reserved_for_read, max_range, max_gap)
        self._read_range = read_range
        self._stop = stop
        self._retries = retries
        self._open_range: OpenRange = open_range or (lambda pack, off, n: BytesRange(read_range(pack, off, n)))
        self._decode_blob = decode
        self.cache = cache
        # memory, held and in-hand chunks, the local tree: one owner, shared with the materializer
        # (``memory_bytes`` sizes the LRU of a residency of its own; a residency given is sized by its maker)
        self.residency = residency if residency is not None else Residency(memory_bytes)
        self.stats = FetchStats()
        self._fetching = 0  # chunks inside requests in flight
        self._nursery: trio.Nursery | None = None
        self._net_limiter = trio.CapacityLimiter(max_requests)
        self._cpu_limiter = trio.CapacityLimiter(decode_threads or max(2, usable_cpus()))
        self._cache_limiter = trio.CapacityLimiter(4)  # cache loads: a reader may be waiting
        self._cache_write_limiter = trio.CapacityLimiter(2)  # writes with fsync, bookkeeping: nobody waits
        self._not_yielding = trio.Event()  # set unless a snapshot of the box runs (yield_to_snapshot)
        self._not_yielding.set()
        self._stopping = False  # run() is being cancelled: nothing waits for a snapshot's end any more

    # -- lifetime ------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; start with ``await nursery.start(fetcher.run)``."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._dispatch)
                nursery.start_soon(self._flush_ticker)
                nursery.start_soon(self._stop_when_cancelled)
                task_status.started()
        finally:
            self._nursery = None
            if self.cache is not None:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self.cache.flush)

    async def _stop_when_cancelled(self) -> None:
        """Sets ``stop`` as soon as the nursery is cancelled: store calls in threads stop waiting to retry,
        so the nursery, which waits for its threads, ends at once even during an outage."""
        try:
            await trio.sleep_forever()
        finally:
            self._stopping = True  # cache writes waiting out a snapshot of the box go ahead (_store) ...
            self._not_yielding.set()  # ... at once
            if self._stop is not None:
                self._stop.set()

    # -- the public API --------------------------------------------------------------------
    async def get(self, ref: ChunkRef, priority: Priority = Priority.READ, keep: Keep = Keep.ALL) -> bytes:
        """The chunk's verified plaintext; raises :class:`FetchError`.  ``keep``: as for :meth:`request`."""
        data = self.residency.in_memory(ref.chunk)
        if data is not None:
            self.stats.hits_memory += 1
            return data
        p = self._want([ref], priority, keep)[0]
        await p.done.wait()
        if p.error is not None:
            raise type(p.error)(p.error.ref, p.error.reason)  # one instance per waiter: tracebacks stay apart
        assert p.data is not None
        return p.data

    def prefetch(self, refs: Iterable[ChunkRef], priority: Priority, keep: Keep = Keep.ALL) -> int:
        """Schedule chunks without waiting for them; returns how many were not already on their way.

        Chunks scheduled by one call are probed in the disk cache together and
        queued together, so the misses among them that are neighbours in a
        pack share one ranged GET.
        """
        res = self.residency  # (nothing the loop has or the local tree holds is fetched for it; a chunk
        # on its way is asked for again: its priority may rise)
        before = res.flights
        self._want([r for r in refs if res.where(r.chunk) not in (IN_MEMORY, IN_TREE)], priority, keep)
        return res.flights - before

    def request(self, refs: Iterable[ChunkRef], priority: Priority, *, keep: "Keep | bool" = True,
                bridge: bool = False, hold: bool = False, take: bool = False) -> list[Ticket]:
        """Schedule chunks like :meth:`prefetch` and return one :class:`Ticket` per ref, in order.

        A ticket holds its chunk until awaited, so nothing is fetched twice however
        long the caller takes.  ``keep`` says where the chunks go besides the
        tickets: ``True``/``Keep.ALL`` the memory LRU and the disk cache (or
        the local tree, when it adopts the chunk), ``Keep.LOCAL`` the same
        but never the disk cache (a large file read front to back: the
        kernel's page cache keeps it for the mount, and writing it costs a
        core-second per GB and evicts the small files a remount needs;
        docs/benchmarks.md, issue 49), ``Keep.MEMORY`` the memory LRU only (a trace replayed for the
        materializer, which writes them to disk itself), ``False``/``Keep.NONE``
        neither (materialization: every chunk goes to its own file), unless
        another caller wants the same chunk kept.  ``bridge=True``: the GETs of
        these chunks may read across gaps of up to ``max_gap`` bytes of blobs
        nobody asked for, which are dropped; only for callers who know none of
        those blobs is already on local disk (a trace replayed before anything
        is materialized), since it fetches bytes again.  ``hold=True``: the
        chunks are held in memory (``Residency.hold``) until a caller with
        ``take=True`` gets them, which releases them.
        """
        out: list[Ticket] = []
        missing: list[ChunkRef] = []
        res = self.residency
        for ref in refs:
            data = res.take_held(ref.chunk) if take else None
            if data is None:
                data = res.cached(ref.chunk)
                if data is not None and hold:
                    res.hold_put(ref.chunk, data)  # (the LRU may drop it before the materializer takes it)
            if data is not None:
                self.stats.hits_memory += 1
            else:
                missing.append(ref)
            out.append(Ticket(ref, None, data))
        pending = iter(self._want(missing, priority, Keep.ALL if keep is True else Keep(int(keep)), bridge, hold))
        for t in out:
            if t._data is None:
                t._pending = next(pending)
        return out

    @property
    def in_flight(self) -> int:
        """Chunks inside store requests that have not answered yet."""
        return self._fetching

    @property
    def queued(self) -> int:
        """Chunks waiting for a free store request slot."""
        return self._queue.queued

    def yield_to_snapshot(self, on: bool) -> None:
        """On the loop: while ``on`` (a snapshot of the box runs), hint and background requests wait, and so do
        writes to the disk cache (a hint replay leaves thousands queued, seconds of CPU and disk)."""
        if on == self._queue.yielding:
            return
        self._queue.yield_to_snapshot(on)
        if on and not self._stopping:  # (a fetcher that stops waits for nothing)
            self._not_yielding = trio.Event()
        else:
            self._not_yielding.set()

    async def until_not_yielding(self) -> None:
        """On the loop: return once no snapshot of the box runs (at once when none does)."""
        await self._not_yielding.wait()

    @property
    def yielding(self) -> bool:
        """Whether hint and background requests wait for a snapshot of the box (read anywhere: a bool)."""
        return self._queue.yielding

    def snapshot_stats(self) -> dict[str, int]:
        if self._retries is not None:
            self.stats.retries = self._retries()
        out = asdict(self.stats)
        out.update(in_flight=self._fetching, queued=self._queue.queued, active_requests=self._queue.active,
                   pending=self.residency.flights, memory_bytes=self.residency.memory_size,
                   held_bytes=self.residency.held_size)
        return out

    # -- single flight -------------------------------------------------------------------------
    def _want(self, refs: list[ChunkRef], priority: Priority, keep: int = Keep.ALL, bridge: bool = False,
              hold: bool = False) -> list[_Pending]:
        out, new = [], []
        res = self.residency
        for ref in refs:
            p = res.flight(ref.chunk)
            if p is not None:
                p.keep = max(p.keep, keep)
                p.hold = p.hold or hold
                if priority < p.priority:
                    p.priority = priority
                    self._queue.raised(p)
            else:
                p = _Pending(ref, priority, keep)
                res.start_flight(ref.chunk, p)
                p.bridge = bridge
                p.hold = hold
                new.append(p)
            out.append(p)
        if priority == Priority.READ and new:
            self._queue.read_wanted()
            self.stats.read_missed_bytes += sum(p.ref.raw_len for p in new)
        if new:
            if self._nursery is None:
                for p in new:
                    res.end_flight(p.ref.chunk)
                raise RuntimeError("Fetcher.run() is not running")
            self._nursery.start_soon(self._probe, new)
        return out

    async def _probe(self, batch: list[_Pending]) -> None:
        """Sort new entries into disk-cache hits and misses (one stat each, one thread hop).

        The misses are queued together, so neighbours among them share a GET;
        the hits are loaded and verified in small batches in parallel, so the
        first ones are served before the last are read.
        """
        present = [False] * len(batch)
        if self.cache is not None:
            try:
                present = await trio.to_thread.run_sync(fetchio.cached, self.cache, [p.ref.chunk for p in batch],
                                                        limiter=self._cache_limiter)
            except _CACHE_ERRORS as exc:
                log.warning("chunk cache unreadable (%s); fetching from the store", exc)
        self._enqueue([p for p, hit in zip(batch, present) if not hit])
        hits = [p for p, hit in zip(batch, present) if hit]
        assert self._nursery is not None
        for i in range(0, len(hits), _PROBE_BATCH):
            self._nursery.start_soon(self._load, hits[i:i + _PROBE_BATCH])

    async def _load(self, batch: list[_Pending]) -> None:
        found: list[bytes | None] = [None] * len(batch)
        try:
            found = await trio.to_thread.run_sync(fetchio.load_cached, self.cache,
                                                  [(p.ref.chunk, p.ref.raw_len) for p in batch],
                                                  limiter=self._cache_limiter)
        except _CACHE_ERRORS as exc:
            log.warning("chunk cache unreadable (%s); fetching from the store", exc)
        for p, data in zip(batch, found):
            if data is not None:
                self.stats.hits_disk += 1
                self._finish(p, data)
            else:  # evicted or damaged since the stat: fetch it
                self._enqueue([p])

    def _enqueue(self, batch: list[_Pending]) -> None:
        for p in batch:
            self.stats.misses += 1
            self._queue.add(p)

    def _finish(self, p: _Pending, data: bytes) -> None:
        p.data = data
        res = self.residency
        res.end_flight(p.ref.chunk)
        if not (p.hold and res.hold_put(p.ref.chunk, data)) and p.keep >= Keep.MEMORY:
            res.mem_put(p.ref.chunk, data)
        p.done.set()

    def _keep_local(self, p: _Pending, data: bytes) -> None:
        """A chunk fetched from the store for a keeping caller goes to the local tree (materialization), else
        to the disk cache unless its callers stream (``Keep.LOCAL``)."""
        if p.keep >= Keep.LOCAL and not self.residency.adopt(p.ref, data) and p.keep >= Keep.ALL \
                and self.cache is not None:
            assert self._nursery is not None
            self._nursery.start_soon(self._store, p.ref.chunk, data)

    def _fail(self, p: _Pending, error: FetchError) -> None:
        p.error = error
        self.stats.errors += 1
        self.residency.end_flight(p.ref.chunk)
        p.done.set()

    # -- the queue -------------------------------------------------------------------------------
    async def _dispatch(self) -> None:
        """Start store requests from the queue as the link allows (see :mod:`ogrefs.lazy.fetch.queue`)."""
        assert self._nursery is not None
        while True:
            p = self._queue.peek()
            if p is None or not self._queue.may_start(p.priority):
                await self._queue.wait_for_change(p)
                continue
            run: list[_Pending] = self._queue.take_run(p)  # type: ignore[assignment] # the entries it was given
            self._fetching += len(run)
            is_read = p.priority == Priority.READ
            self._queue.started(run, is_read)
            self._nursery.start_soon(self._fetch_run, run, is_read)

    # -- store requests ----------------------------------------------------------------------------
    async def _fetch_run(self, run: list[_Pending], is_read: bool = False) -> None:
        """One ranged GET for a run of neighbouring chunks, handed out one by one as they arrive.

        The response is read in a worker thread (:func:`fetchio.stream_blobs`)
        that decodes and verifies each blob as soon as its bytes are in and
        hands finished blobs to the trio loop in small batches: a reader
        waiting for the first chunk of a long run never waits for the last.
        Whatever fails (after the store's own retries) fails the chunks not yet
        delivered, classified once (:func:`fetchio.classify`).
        """
        delivered = [False] * len(run)
        first, last = run[0].ref, run[-1].ref
        blobs = tuple((i, p.ref.offset - first.offset, p.ref.stored_len, p.ref.raw_len, p.ref.chunk)
                      for i, p in enumerate(run))
        deliver = functools.partial(trio.from_thread.run_sync, self._deliver, run, delivered, is_read)
        failure: FetchError | None = None
        try:
            await trio.to_thread.run_sync(fetchio.stream_blobs, self._open_range, self._decode_blob, first.pack,
                                          first.offset, last.offset + last.stored_len - first.offset, blobs,
                                          deliver, limiter=self._net_limiter)
            self.stats.requests += 1
        except Exception as exc:  # noqa: BLE001 - every failure is EIO for these chunks, never a dead nursery
            failure = fetchio.classify(exc, first)
        finally:
            self._queue.finished(sum(p.ref.stored_len for p, d in zip(run, delivered) if not d), is_read)
        left = [p for p, d in zip(run, delivered) if not d]
        if failure is None and left:  # a store that answered less than asked without saying so
            failure = ChunkCorrupt(left[0].ref, "the store's answer ended early")
        if failure is not None:
            log.error("fetch of %d chunk(s) from pack %s failed: %s", len(left), first.pack, failure.reason)
            for p in left:
                self._fetching -= 1
                self._fail(p, type(failure)(p.ref, failure.reason))

    def _deliver(self, run: list[_Pending], delivered: list[bool], is_read: bool, batch: fetchio.Delivery) -> None:
        """On the trio thread: blobs of a request in flight that arrived, decoded and verified (or not)."""
        for i, result in batch:
            if i < 0:  # bytes of a gap, read and dropped
                assert isinstance(result, int)
                self.stats.bytes_fetched += result
                self.stats.bytes_bridged += result
                continue
            delivered[i] = True
            p = run[i]
            if is_read:
                self._queue.read_delivered(p.ref.stored_len)
            self.stats.bytes_fetched += p.ref.stored_len
            if isinstance(result, CorruptObject):
                self.stats.corrupt += 1
                assert self._nursery is not None
                self._nursery.start_soon(self._retry_corrupt, p, str(result))
                continue
            assert isinstance(result, bytes)
            self._fetching -= 1
            self.stats.chunks_fetched += 1
            self._finish(p, result)
            self._keep_local(p, result)

    async def _retry_corrupt(self, p: _Pending, reason: str) -> None:
        """A blob that failed verification, fetched once more on its own (a flipped bit in transit)."""
        log.warning("chunk %s failed verification (%s); fetching it again", p.ref.chunk.hex()[:16], reason)
        try:
            data = await self._refetch(p.ref)
        except FetchError as exc:
            log.error("%s", exc)
            self._fail(p, exc)
        else:
            self.stats.chunks_fetched += 1
            self._finish(p, data)
            self._keep_local(p, data)
        finally:
            self._fetching -= 1

    async def _refetch(self, ref: ChunkRef) -> bytes:
        """One blob on its own: read, then decoded and verified in a worker thread; raises FetchError only."""
        try:
            body = await trio.to_thread.run_sync(fetchio.read_blob, self._read_range, ref, limiter=self._net_limiter)
            self.stats.requests += 1
            self.stats.bytes_fetched += len(body)
            return await trio.to_thread.run_sync(self._decode_blob, memoryview(body), ref.raw_len, ref.chunk,
                                                 limiter=self._cpu_limiter)
        except Exception as exc:  # noqa: BLE001 - as in _fetch_run: EIO for this chunk, the nursery lives
            failure = fetchio.classify(exc, ref)
        if isinstance(failure, ChunkCorrupt):
            self.stats.corrupt += 1
        raise failure

    # -- caches -------------------------------------------------------------------------------------
    async def _store(self, chunk: bytes, data: bytes) -> None:
        assert self.cache is not None
        try:
            # shielded: an unmount waits for chunks already fetched to reach the cache, so a remount reuses them
            with trio.CancelScope(shield=True):
                async with self._cache_write_limiter:
                    # a write's turn comes while a snapshot of the box runs: it waits for the end (or the unmount)
                    while self._queue.yielding and not self._stopping:
                        await self._not_yielding.wait()
                    await trio.to_thread.run_sync(self.cache.store, chunk, data)
        except _CACHE_ERRORS as exc:
            self.stats.cache_write_errors += 1
            log.warning("chunk cache write failed (%s); serving without caching", exc)

    async def _flush_ticker(self) -> None:
        while True:
            await trio.sleep(1.0)
            if self.cache is not None:
                try:
                    await trio.to_thread.run_sync(self.cache.flush, limiter=self._cache_write_limiter)
                except _CACHE_ERRORS as exc:
                    log.warning("chunk cache bookkeeping failed: %s", exc)
