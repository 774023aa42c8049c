"""The fetcher's request queue: which chunks wait for a store request, and which request starts next.

A chunk that neither memory nor the disk cache had waits here, in priority
order (:class:`Priority`), until the fetcher's dispatcher may start a store
request for it.  At most ``max_requests`` are in flight, of which
``reserved_for_read`` only an application's read may use: a reader never
waits behind prefetch or materialization.  Prefetch also yields the link to
readers (:meth:`RequestQueue.may_start`).  A request takes every queued chunk
near the first in the same pack into one ranged GET
(:meth:`RequestQueue.take_run`): packs keep the files of a directory
together, so read-ahead and prefetch cost few requests.  While a snapshot of
the box runs (:attr:`RequestQueue.yielding`, set by the daemon's
:class:`~ogrefs.lazy.background.snapshotgate.SnapshotGate`), hints and background
requests do not start at all; reads and the trace go on.

Who owns what: a RequestQueue belongs to its Fetcher and so to the trio loop;
only trio tasks call it, so it needs no locks.  It holds the fetcher's
pending entries while they are queued (their ``state`` is "queued" here and
becomes "fetching" when a request takes them) and the link's counters (requests
in flight, bytes a reader still waits for, the time of the last read that had
to wait).  :meth:`RequestQueue.wait_for_change` is the dispatcher's only wait.
"""

from __future__ import annotations

import enum
import heapq
import math
from bisect import bisect_left, insort
from typing import Protocol

import trio

from ogrefs.repo.chunkref import ChunkRef

#: After an application's last store read, hints and background wait this long before taking the link back.
READ_QUIET_S = 0.05
#: Readers with this many bytes on their way keep the link full by themselves: prefetch pauses.
READ_FILLS_LINK = 4 * 1024 * 1024
#: While an application reads from the store, a prefetch request covers at most this much.
PREFETCH_RANGE_WHILE_READING = 4 * 1024 * 1024


class Priority(enum.IntEnum):
    """Why a chunk is wanted; lower is more urgent."""

    READ = 0  # an application is waiting (and read-ahead of a sequential reader)
    TRACE = 1  # replay of a recorded access trace
    HINT = 2  # catalog hints: python, cuda, checkpoints
    BACKGROUND = 3  # materialization of everything else


class Queued(Protocol):
    """What the queue needs of a fetcher's pending entry."""

    ref: ChunkRef
    priority: Priority
    bridge: bool  # its GET may read across gaps of blobs nobody asked for
    state: str
    seq: int


class RequestQueue:
    """Queued chunks by priority and by pack position, and the use of the link; see the module docstring."""

    def __init__(self, max_requests: int, reserved_for_read: int, max_range: int, max_gap: int) -> None:
        if not 0 <= reserved_for_read < max_requests:
            raise ValueError("reserved_for_read must be below max_requests")
        self.max_requests = max_requests
        self.reserved_for_read = reserved_for_read
        self.max_range = max_range
        self.max_gap = max_gap
        self._heap: list[tuple[int, int, Queued]] = []
        self._by_start: dict[tuple[str, int], Queued] = {}  # queued, by (pack, blob offset)
        self._offsets: dict[str, list[int]] = {}  # queued blob offsets per pack, sorted
        self._seq = 0
        self.queued = 0  # chunks waiting for a request
        self.active = 0  # store requests in flight
        self._reads_active = 0  # of which started for an application's read
        self._read_bytes = 0  # bytes those read requests have still to deliver
        self._last_read_want = -math.inf  # trio time of the last chunk an application had to wait for
        self.yielding = False  # a snapshot of the box runs: hints and background wait (yield_to_snapshot)
        self._changed = trio.Event()

    # -- the queue -----------------------------------------------------------------------------------
    def add(self, p: Queued) -> None:
        """Queue ``p`` (it missed memory and the disk cache)."""
        p.state = "queued"
        self.queued += 1
        self._by_start[(p.ref.pack, p.ref.offset)] = p
        insort(self._offsets.setdefault(p.ref.pack, []), p.ref.offset)
        self._push(p)

    def raised(self, p: Queued) -> None:
        """``p``'s priority was raised: if it is queued, it moves up."""
        if p.state == "queued":
            self._push(p)

    def _push(self, p: Queued) -> None:
        self._seq += 1
        p.seq = self._seq
        heapq.heappush(self._heap, (int(p.priority), p.seq, p))
        self._changed.set()

    def peek(self) -> Queued | None:
        """The most urgent queued chunk, or None."""
        while self._heap:
            prio, seq, p = self._heap[0]
            if p.state == "queued" and p.seq == seq:
                return p
            heapq.heappop(self._heap)  # superseded by a priority raise, or already taken by a neighbour
        return None

    def _unqueue(self, p: Queued) -> None:
        p.state = "fetching"
        self.queued -= 1
        del self._by_start[(p.ref.pack, p.ref.offset)]
        offsets = self._offsets[p.ref.pack]
        del offsets[bisect_left(offsets, p.ref.offset)]
        if not offsets:
            del self._offsets[p.ref.pack]

    def take_run(self, p: Queued) -> list[Queued]:
        """``p`` (what :meth:`peek` returned) plus the queued chunks near it in its pack, up to ``max_range`` bytes.

        Chunks requested with ``bridge`` take neighbours across gaps of up to
        ``max_gap`` bytes (blobs no one asked for, read and dropped): a few KiB
        more on the wire is far cheaper than another request, and the small
        files an import touches sit between ones it does not.  Others take
        only exact neighbours.
        """
        heapq.heappop(self._heap)
        pack = p.ref.pack
        self._unqueue(p)
        gap = self.max_gap if p.bridge else 0
        # while an application reads, prefetch requests stay short: one that starts just before the
        # reader's read-ahead fills the link gives the link back within ~35 ms, not ~270 ms
        limit = self.max_range if p.priority == Priority.READ or not self.reads_hot() else \
            min(self.max_range, PREFETCH_RANGE_WHILE_READING)
        run = [p]
        start, end = p.ref.offset, p.ref.offset + p.ref.stored_len
        offsets = self._offsets.get(pack, [])
        while offsets:
            i = bisect_left(offsets, end)
            if i == len(offsets) or offsets[i] - end > (gap if self._by_start[(pack, offsets[i])].bridge else 0):
                break
            q = self._by_start[(pack, offsets[i])]
            if q.ref.offset + q.ref.stored_len - start > limit:
                break
            self._unqueue(q)
            run.append(q)
            end = q.ref.offset + q.ref.stored_len
        while offsets:
            i = bisect_left(offsets, start) - 1
            if i < 0:
                break
            q = self._by_start[(pack, offsets[i])]
            q_end = q.ref.offset + q.ref.stored_len
            if start - q_end > (gap if q.bridge else 0) or end - q.ref.offset > limit:
                break
            self._unqueue(q)
            run.insert(0, q)
            start = q.ref.offset
        return run

    # -- the link --------------------------------------------------------------------------------------
    def read_wanted(self) -> None:
        """An application is waiting for a chunk that memory did not have."""
        self._last_read_want = trio.current_time()

    def reads_hot(self) -> bool:
        """An application is reading from the store right now (or was, a moment ago)."""
        return self._reads_active > 0 or trio.current_time() - self._last_read_want < READ_QUIET_S

    def yield_to_snapshot(self, on: bool) -> None:
        """A snapshot of the box started (``on``) or ended: hints and background wait until it ends."""
        if on != self.yielding:
            self.yielding = on
            self._changed.set()

    def may_start(self, priority: Priority) -> bool:
        """Whether a request of ``priority`` may start now."""
        if priority == Priority.READ:
            return self.active < self.max_requests
        if self.yielding and priority >= Priority.HINT:
            return False
        if self.active >= self.max_requests - self.reserved_for_read:
            return False
        # Prefetch yields the link to readers.  While an application's requests have enough bytes
        # outstanding to fill the link (a big file read sequentially), nothing else starts, not even
        # the trace.  Otherwise a recorded trace keeps going (it is what the reader needs next), and
        # hints and materialization keep at most one request in flight while an application waits on
        # the store: enough to keep the link busy when it reads many small files one by one.
        if not self.reads_hot():
            return True
        if self._read_bytes >= READ_FILLS_LINK:
            return False
        return priority == Priority.TRACE or self.active - self._reads_active < 1

    def started(self, run: list[Queued], is_read: bool) -> None:
        """A request for ``run`` starts (``is_read``: for an application's read)."""
        self.active += 1
        if is_read:
            self._reads_active += 1
            self._read_bytes += sum(q.ref.stored_len for q in run)

    def read_delivered(self, stored_len: int) -> None:
        """A chunk of a read request arrived."""
        self._read_bytes -= stored_len

    def finished(self, undelivered: int, is_read: bool) -> None:
        """A request ended, ``undelivered`` stored bytes of it never arrived."""
        self.active -= 1
        if is_read:
            self._reads_active -= 1
            self._read_bytes -= undelivered
            self._last_read_want = trio.current_time()
        self._changed.set()

    async def wait_for_change(self, held_back: Queued | None) -> None:
        """Until the queue or the link changes; if ``held_back`` waits only for readers, until they go quiet."""
        changed = self._changed
        with trio.move_on_after(READ_QUIET_S if held_back is not None and self.reads_hot() else math.inf):
            await changed.wait()
        if self._changed is changed and changed.is_set():
            self._changed = trio.Event()
