"""Where is chunk X now: one owner for the answer, on the trio loop.

A chunk of a mounted snapshot is, at any moment, in one of these places:

* **in memory**: the fetcher's LRU of verified chunks, the chunks a replay
  holds for the materializer (:meth:`Residency.hold_put`), a chunk adopted
  into the tree and not yet written (:meth:`Residency.adopt`), or a chunk the
  materializer's feeder requested whose ticket has arrived;
* **in the local tree**: written at every place it belongs, durable and
  recorded done in the materialization plan (:meth:`Residency.in_tree`);
* **coming**: on its way: the fetcher's single-flight entry for it is
  registered here (:meth:`Residency.start_flight`), and every later caller
  waits on that entry;
* **absent**: nothing on the loop has it; the fetcher gets it (the disk
  cache, then the store).  The disk cache stays the fetcher's: it can only
  be asked in a worker thread, so "absent" means "not on the loop".

:class:`Residency` holds all of that state (the memory LRU, held chunks,
chunks on their way, chunks claimed by the materializer and the bytes it
has in hand, its tickets, the chunks and files recorded done) and is the one place it
changes: its mutators are the only writers.  The fetcher, the vfs's read
path and the materializer's feeder and writers all ask it.  Adoption goes
through it too: the fetcher offers each chunk it got from the store for a
keeping caller (:meth:`Residency.adopt`); while a materialization pass is
open (:meth:`Residency.open_adoption`) the chunk is put in hand and queued
for the pass's adoption writer, and the chunk cache does without it.  Neither
side knows the other: both were given the same Residency at construction.

Who owns what: a Residency belongs to the trio loop.  Every method is called
from trio tasks only, never from a worker thread; threads get copies
(:meth:`Residency.held_chunks`) and results they return are applied here by
the loop (:meth:`Residency.recorded`).  It needs no locks.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Iterable, Protocol

import trio

from ogrefs.units import MiB

if TYPE_CHECKING:
    from ogrefs.repo.chunkref import ChunkRef


class Ticket(Protocol):
    """A chunk the feeder asked the fetcher for (``ogrefs.lazy.fetch.fetcher.Ticket``): its bytes once arrived."""

    def peek(self) -> bytes | None: ...


#: Where a chunk is (:meth:`Residency.where`).
IN_MEMORY, IN_TREE, COMING, ABSENT = 0, 1, 2, 3


class Residency:
    """The loop's single answer to "where is chunk X"; see the module docstring."""

    def __init__(self, memory_bytes: int = 128 * MiB) -> None:
        # memory: the LRU of verified chunks, and chunks held for the materializer until taken
        self.memory_bytes = memory_bytes
        self._mem: OrderedDict[bytes, bytes] = OrderedDict()
        self._mem_size = 0
        self.hold_bytes = 0  # bound of _held; 0: nothing is held
        self._held: dict[bytes, bytes] = {}
        self._held_size = 0
        # on its way: chunk -> the fetcher's single-flight entry (opaque here)
        self._coming: dict[bytes, Any] = {}
        # the local tree (the materializer's): recorded state, and what is on its way in
        self._done: set[bytes] = set()  # chunks written to every target, durable and recorded
        self._complete: set[int] = set()  # files whose data is all done and metadata applied
        self._claimed: set[bytes] = set()  # requested by the feeder or adopted, not yet recorded done
        self._in_hand: dict[bytes, bytes] = {}  # adopted chunks, until recorded done
        self._tickets: dict[bytes, "Ticket"] = {}  # chunks the feeder requested, until recorded done
        # adoption: chunks fetched for readers, queued for the open pass's adoption writer
        self._adopting = False
        self._adopt_limit = 0
        self._adoptions: deque[tuple["ChunkRef", bytes]] = deque()
        self._adoptions_size = 0
        self._adopt_wakeup = trio.Event()

    # -- queries --------------------------------------------------------------------------------
    def where(self, chunk: bytes) -> int:
        """``IN_MEMORY`` (cached, held, or in the materializer's hand: its bytes are here),
        ``IN_TREE`` (durable in the local tree), ``COMING`` (a fetch is on its way), or
        ``ABSENT`` (the fetcher must get it).

        Memory is answered first: a chunk the loop has costs no disk read.
        """
        if chunk in self._held or chunk in self._mem:
            return IN_MEMORY
        if chunk in self._done:
            return IN_TREE
        if (self._in_hand or self._tickets) and self.in_hand(chunk) is not None:
            return IN_MEMORY
        return COMING if chunk in self._coming else ABSENT

    def flight(self, chunk: bytes) -> Any | None:
        """The fetcher's single-flight entry for ``chunk`` if it is on its way."""
        return self._coming.get(chunk)

    @property
    def flights(self) -> int:
        """Chunks on their way."""
        return len(self._coming)

    def cached(self, chunk: bytes) -> bytes | None:
        """The chunk's bytes from the memory LRU or the held chunks (a hit in the LRU refreshes it)."""
        data = self._held.get(chunk)
        if data is not None:
            return data
        data = self._mem.get(chunk)
        if data is not None:
            self._mem.move_to_end(chunk)
        return data

    def is_cached(self, chunk: bytes) -> bool:
        return chunk in self._held or chunk in self._mem

    def in_hand(self, chunk: bytes) -> bytes | None:
        """The verified bytes of ``chunk`` if it was fetched for the tree and is not yet recorded done.

        Between its arrival and its durable write a chunk is in neither the
        tree nor any cache (the collector takes tickets in order, so one that
        arrived may wait behind others); a reader asking for it gets it here.
        """
        data = self._in_hand.get(chunk)
        if data is None and (ticket := self._tickets.get(chunk)) is not None:
            data = ticket.peek()
        return data

    def in_memory(self, chunk: bytes) -> bytes | None:
        """The chunk's bytes wherever the loop has them (cached, held, in hand), else None."""
        data = self.cached(chunk)
        if data is None and (self._in_hand or self._tickets):
            data = self.in_hand(chunk)
        return data

    def in_tree(self, chunk: bytes) -> bool:
        """Whether ``chunk`` is in the local tree at every place it belongs (durable, recorded)."""
        return chunk in self._done

    def is_complete(self, ino: int) -> bool:
        """Whether file ``ino`` is complete in the local tree (data durable, metadata applied)."""
        return ino in self._complete

    def is_local(self, chunk: bytes) -> bool:
        """In the tree or on its way into it (claimed by the materializer): never worth fetching for a reader."""
        return chunk in self._done or chunk in self._claimed

    def is_claimed(self, chunk: bytes) -> bool:
        return chunk in self._claimed

    @property
    def tree_has_chunks(self) -> bool:
        return bool(self._done)

    @property
    def files_complete(self) -> int:
        return len(self._complete)

    @property
    def memory_size(self) -> int:
        return self._mem_size

    @property
    def held_size(self) -> int:
        return self._held_size

    def held_chunks(self) -> frozenset[bytes]:
        """The chunks held now (a copy: for a worker thread)."""
        return frozenset(self._held)

    # -- flight mutators (the fetcher's) --------------------------------------------------------
    def start_flight(self, chunk: bytes, entry: Any) -> None:
        """``chunk`` is on its way; ``entry`` is what later callers wait on."""
        self._coming[chunk] = entry

    def end_flight(self, chunk: bytes) -> None:
        """``chunk`` arrived (its bytes went to memory or to its callers) or failed."""
        self._coming.pop(chunk, None)

    # -- memory mutators ------------------------------------------------------------------------
    def mem_put(self, chunk: bytes, data: bytes) -> None:
        if chunk in self._mem or len(data) > self.memory_bytes:
            return
        self._mem[chunk] = data
        self._mem_size += len(data)
        self._shrink()

    def set_memory_limit(self, limit: int) -> None:
        self.memory_bytes = limit
        self._shrink()

    def _shrink(self) -> None:
        while self._mem_size > self.memory_bytes and self._mem:
            _, old = self._mem.popitem(last=False)
            self._mem_size -= len(old)

    def hold(self, limit: int) -> None:
        """Keep chunks requested with ``hold=True`` (``Fetcher.request``) in memory, up to ``limit`` bytes, until taken.

        A trace (or the hints) replayed before the materializer's tree exists
        is held here, apart from the memory LRU: an application reading
        gigabytes meanwhile neither evicts it nor makes the LRU grow with it.
        Readers find held chunks like any in memory; the materializer takes
        them (``request(..., take=True)``), which releases them.  What does not
        fit goes to the LRU as before.  ``hold(0)`` releases everything.
        """
        self.hold_bytes = limit
        if limit <= 0:
            self._held.clear()
            self._held_size = 0

    def hold_put(self, chunk: bytes, data: bytes) -> bool:
        """Hold ``chunk`` if there is room; True if it is held now."""
        if chunk in self._held:
            return True
        if self._held_size + len(data) > self.hold_bytes:
            return False
        self._held[chunk] = data
        self._held_size += len(data)
        return True

    def take_held(self, chunk: bytes) -> bytes | None:
        """A held chunk, released (the materializer takes it)."""
        data = self._held.pop(chunk, None)
        if data is not None:
            self._held_size -= len(data)
        return data

    # -- tree mutators (the materializer's) -----------------------------------------------------
    def load_tree(self, done: Iterable[bytes], complete: Iterable[int]) -> None:
        """What the plan records (read in a worker thread, applied here on the loop)."""
        self._done = set(done)
        self._complete = set(complete)

    def claim(self, chunk: bytes, ticket: "Ticket | None" = None) -> None:
        """The feeder asked for ``chunk`` (its ticket holds the bytes once they arrive)."""
        self._claimed.add(chunk)
        if ticket is not None:
            self._tickets[chunk] = ticket

    def unclaim(self, chunk: bytes) -> None:
        """``chunk`` will not reach the tree this pass (its fetch failed, or the plan does not want it)."""
        self._claimed.discard(chunk)
        self._in_hand.pop(chunk, None)
        self._tickets.pop(chunk, None)

    def recorded(self, chunks: Iterable[bytes], files: Iterable[int]) -> None:
        """These chunks are recorded done (durable at every target) and these files complete."""
        for chunk in chunks:
            self._done.add(chunk)
            self._claimed.discard(chunk)
            self._in_hand.pop(chunk, None)
            self._tickets.pop(chunk, None)
        self._complete.update(files)

    # -- adoption ---------------------------------------------------------------------------------
    def open_adoption(self, limit: int) -> None:
        """A pass starts: chunks fetched for readers are adopted, up to ``limit`` bytes waiting."""
        self._claimed = set()
        self._in_hand, self._tickets = {}, {}
        self._adopting = True
        self._adopt_limit = limit

    def close_adoption(self) -> None:
        """The pass ends: no more adoptions; the adoption writer drains what is queued and ends."""
        self._adopting = False
        self._adopt_wakeup.set()

    def end_pass(self) -> None:
        """The pass has ended: nothing is claimed or in hand any more (a stopped pass leaves some)."""
        self._claimed = set()
        self._in_hand, self._tickets = {}, {}

    def adopt(self, ref: "ChunkRef", data: bytes) -> bool:
        """Offer a chunk the fetcher got from the store for someone else; True if the tree will have it.

        True also for a chunk already done or claimed (the feeder asked for it
        too, and writes it from its ticket): the chunk cache need not keep a
        copy.  False when no pass is open or the adoption bound is reached:
        the fetcher keeps it (chunk cache) as before.
        """
        chunk = ref.chunk
        if not self._adopting:
            return False
        if chunk in self._done or chunk in self._claimed:
            return True
        if self._adoptions_size + len(data) > self._adopt_limit:
            return False
        self._claimed.add(chunk)
        self._in_hand[chunk] = data
        self._adoptions.append((ref, data))
        self._adoptions_size += len(data)
        self._adopt_wakeup.set()
        return True

    async def next_adoptions(self, max_bytes: int, max_chunks: int) -> list[tuple["ChunkRef", bytes]] | None:
        """The next batch of adopted chunks (waits for one); None once the pass is closed and none is left.

        Their bytes stay counted against the bound until :meth:`adoptions_written`.
        """
        while not self._adoptions:
            if not self._adopting:
                return None
            self._adopt_wakeup = trio.Event()
            await self._adopt_wakeup.wait()
        take: list[tuple[ChunkRef, bytes]] = []
        size = 0
        while self._adoptions and (not take or size < max_bytes) and len(take) < max_chunks:
            ref, data = self._adoptions.popleft()
            take.append((ref, data))
            size += len(data)
        return take

    def adoptions_written(self, size: int) -> None:
        """Adopted chunks of ``size`` bytes left the queue's bound (written, or dropped)."""
        self._adoptions_size -= size
