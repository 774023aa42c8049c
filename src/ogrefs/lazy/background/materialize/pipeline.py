"""One materialization pass on the trio loop: feeder -> collector -> writer, plus the adoption writer.

Order.  The feeder reads the plan a page at a time (in a worker thread) and
requests chunks in pack-ordered groups of one class (16 MiB), through the
windowed request engine the trace replay uses too (:mod:`ogrefs.lazy.trace.window`),
each class at
its own fetcher priority (a reader, ``Priority.READ``, always goes first: the
fetcher keeps request slots for it), while less than ``window_bytes`` are
requested and not yet written.  Chunks already in memory (a trace or the
hints, streamed before the tree existed and held for the materializer, which
takes them) do not count against the window: they take no link time, and
counting them would leave the link idle while the writer works through them.

The collector takes the tickets in order and cuts them into batches
(``batch_bytes`` / ``batch_chunks``, or whatever has arrived when the next
chunk is slow to come: ``flush_after``); the writer writes each batch
durably in a worker thread (:class:`~ogrefs.lazy.background.materialize.writer.TreeWriter`)
and only then tells the residency the chunks are in the tree.  The adoption
writer does the same for chunks the fetcher got for readers and the
residency adopted; the two writers take turns under one lock.

Who owns what: a :class:`Pass`, its budget and its channels belong to the
trio loop; every method runs in a trio task.  Worker threads get immutable
inputs (a page key; a tuple of refs; a list of (item, bytes)) and return new
objects; the loop applies their results (to the residency, to the
materializer's progress through ``on_written``).
"""

from __future__ import annotations

import logging
import math
import os
import sqlite3
from dataclasses import dataclass
from typing import Callable

import trio

from ogrefs.errors import OgrefsError
from ogrefs.lazy.fetch.fetcher import ChunkMissing, FetchError, Fetcher, Priority, StoreUnavailable, Ticket
from ogrefs.lazy.background.materialize.pacing import Pacer
from ogrefs.box.copyplan import BACKGROUND, HINT, TRACE, Item, Plan
from ogrefs.lazy.fetch.residency import Residency
from ogrefs.lazy.fetch.threadnice import to_background_thread
from ogrefs.lazy.trace.window import RequestWindow, groups

log = logging.getLogger(__name__)

_PRIORITY = {TRACE: Priority.TRACE, HINT: Priority.HINT, BACKGROUND: Priority.BACKGROUND}
#: No class goes to the caches: the tree is the copy, and the vfs reads chunks already written from it
#: (also of files not yet complete).
_KEEP = {TRACE: False, HINT: False, BACKGROUND: False}
#: Plan rows read per page.
_PAGE = 512

Batch = list[tuple[Item, bytes]]


@dataclass(frozen=True)
class PassSettings:
    window_bytes: int
    group_bytes: int
    batch_bytes: int
    batch_chunks: int
    flush_after: float
    adopt_bytes: int
    bridge: bool  # the tree is this run's: GETs may read across small gaps (nothing in them is on disk yet)


class Pass:
    """Fetch and write every chunk not done yet, once; see the module docstring.

    ``write_batch``: the worker-thread write (durable, then recorded);
    ``on_written``: on the loop, after each batch written (progress).
    ``failed``: plan rows that failed for good in this run (the
    materializer's; skipped here, added to on a corrupt or missing chunk).
    After :meth:`run`: ``retry`` chunks failed because the store was
    unavailable (the caller pauses and runs another pass); ``stopped`` is the
    exception that ended the pass, if a write failed.
    """

    def __init__(self, plan: Plan, fetcher: Fetcher, residency: Residency, settings: PassSettings, *,
                 write_batch: Callable[[Batch], list[int]], on_written: Callable[[Batch, list[int]], None],
                 failed: set[int], pacer: Pacer | None = None) -> None:
        self.plan = plan
        self.pacer = pacer if pacer is not None else Pacer(None)
        self.fetcher = fetcher
        self.residency = residency
        self.settings = settings
        self._write_batch = write_batch
        self._on_written = on_written
        self.failed = failed
        self.failed_chunks = 0
        self.adopted_chunks = 0
        self.retry = 0
        self.stopped: BaseException | None = None
        self._abort = False
        self._write_lock = trio.Lock()
        self._scope: trio.CancelScope | None = None

    async def run(self) -> None:
        res = self.residency
        budget = RequestWindow(self.settings.window_bytes)
        items_send, items_recv = trio.open_memory_channel[tuple[Item, Ticket, bool]](math.inf)
        batch_send, batch_recv = trio.open_memory_channel[tuple[Batch, int]](1)
        res.open_adoption(self.settings.adopt_bytes)
        try:
            async with trio.open_nursery() as outer:
                self._scope = outer.cancel_scope
                outer.start_soon(self._write_adopted)
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._feed, budget, items_send)
                        nursery.start_soon(self._collect, budget, items_recv, batch_send)
                        nursery.start_soon(self._write, budget, batch_recv)
                finally:
                    res.close_adoption()  # no more; the adoption writer drains what it has and ends
        finally:
            res.end_pass()  # (nothing is left unless the pass stopped: a write failed, or cancelled)

    # -- the feeder ---------------------------------------------------------------------------------
    async def _feed(self, budget: RequestWindow, send: trio.MemorySendChannel) -> None:
        """Request chunks in pack-ordered groups of one class while the window has room."""
        async with send:
            after = None
            while not self._abort:
                page, after = await to_background_thread(self.plan.page, after, _PAGE)
                if not page:
                    return
                for group in self._groups(page):
                    if not await self._request(group, budget, send):
                        return

    def _groups(self, page: list[Item]) -> list[list[Item]]:
        """The page's items still wanted, in pack-ordered groups of one class of at most ``group_bytes``."""
        res = self.residency  # (a chunk may have been adopted, or written, since the page was read)
        wanted = (i for i in page if i.id not in self.failed and not res.is_local(i.ref.chunk))
        return list(groups(wanted, self.settings.group_bytes, size=lambda i: i.ref.raw_len, key=lambda i: i.cls))

    async def _request(self, group: list[Item], budget: RequestWindow, send: trio.MemorySendChannel) -> bool:
        """Ask the fetcher for one group once the window has room; False when the pass is aborted."""
        res = self.residency
        # the window counts what must come over the link: chunks in memory are ready
        size = sum(i.ref.raw_len for i in group if not res.is_cached(i.ref.chunk))
        await budget.acquire(size)
        if self._abort:
            budget.release(size)
            return False
        group = [i for i in group if not res.is_local(i.ref.chunk)]  # adopted (perhaps written) while waiting
        if not group:
            budget.release(size)
            return True
        # A fresh tree's GETs may bridge small gaps (what is in them was fetched by this run, e.g. the
        # trace chunks among a venv's files); after a restart they never do, so no chunk already on disk
        # is fetched again.
        tickets = self.fetcher.request([i.ref for i in group], _PRIORITY[group[0].cls], keep=_KEEP[group[0].cls],
                                       bridge=self.settings.bridge, take=True)
        # (a chunk evicted from memory since the check above is fetched after all: charge it)
        ready = sum(i.ref.raw_len for i, t in zip(group, tickets) if t.ready)
        budget.settle(charged=sum(i.ref.raw_len for i in group) - ready, ready=ready, acquired=size)
        for i, t in zip(group, tickets):
            res.claim(i.ref.chunk, t)
            send.send_nowait((i, t, not t.ready))
        return True

    # -- the collector ------------------------------------------------------------------------------
    async def _collect(self, budget: RequestWindow, recv: trio.MemoryReceiveChannel, send: trio.MemorySendChannel) -> None:
        """Tickets in order -> batches; a batch goes to the writer when full or when the next chunk is slow."""
        batch: Batch = []
        size = 0
        charged = 0  # of the batch's bytes, those counted against the window
        flush_after = self.settings.flush_after

        async def flush() -> None:
            nonlocal batch, size, charged
            if batch:
                await send.send((batch, charged))
                batch, size, charged = [], 0, 0

        async with send, recv:
            current: tuple[Item, Ticket, bool] | None = None
            while True:
                if current is None:
                    if batch:
                        with trio.move_on_after(flush_after):
                            try:
                                current = await recv.receive()
                            except trio.EndOfChannel:
                                break
                        if current is None:
                            await flush()  # the next chunk is slow to come: write what we have meanwhile
                            continue
                    else:
                        try:
                            current = await recv.receive()
                        except trio.EndOfChannel:
                            break
                item, ticket, is_charged = current
                try:
                    if batch:
                        data = None
                        with trio.move_on_after(flush_after):
                            data = await ticket.result()
                        if data is None:
                            await flush()
                            continue
                    else:
                        data = await ticket.result()
                except FetchError as exc:
                    current = None
                    if is_charged:
                        budget.release(item.ref.raw_len)
                    self.residency.unclaim(item.ref.chunk)
                    self._fetch_failed(item, exc)
                    continue
                current = None
                batch.append((item, data))
                size += len(data)
                if is_charged:
                    charged += item.ref.raw_len
                if size >= self.settings.batch_bytes or len(batch) >= self.settings.batch_chunks:
                    await flush()
            await flush()

    def _fetch_failed(self, item: Item, exc: FetchError) -> None:
        if isinstance(exc, StoreUnavailable):
            self.retry += 1
            self._abort = True  # stop asking for more; what is requested drains, then the run pauses
            return
        self.failed.add(item.id)
        self.failed_chunks += 1
        kind = "missing from the store" if isinstance(exc, ChunkMissing) else "corrupt"
        paths = b", ".join(t[2] for t in item.targets[:3])
        log.error("materialization: chunk of %s is %s: %s", os.fsdecode(paths), kind, exc.reason)

    # -- the writers ----------------------------------------------------------------------------------
    async def _write(self, budget: RequestWindow, recv: trio.MemoryReceiveChannel) -> None:
        """Write the feeder's batches; after each, the pacer's pause while the application is active.

        (The adoption writer is not paced: what it writes an application fetched anyway, and its queue is bounded.)
        """
        async with recv:
            async for batch, charged in recv:
                started = trio.current_time()
                if not await self._write_locked(batch):
                    return
                budget.finished(charged, sum(item.ref.raw_len for item, _ in batch) - charged)
                await self.pacer.after(trio.current_time() - started)

    async def _write_locked(self, batch: Batch) -> bool:
        """Write one batch (taking turns with the other writer) and record it; False if the pass stops."""
        try:
            async with self._write_lock:
                newly = await to_background_thread(self._write_batch, batch)
        except (OSError, sqlite3.Error, OgrefsError) as exc:
            self.stopped = exc
            assert self._scope is not None
            self._scope.cancel()
            return False
        self.residency.recorded((item.ref.chunk for item, _ in batch), newly)
        self._on_written(batch, newly)
        return True

    async def _write_adopted(self) -> None:
        """Write adopted chunks into the tree in batches until the pass ends and nothing is left."""
        res, s = self.residency, self.settings
        while (take := await res.next_adoptions(s.batch_bytes, s.batch_chunks)) is not None:
            items = await to_background_thread(self.plan.items_for, tuple(r for r, _ in take))
            batch: Batch = []
            for (ref, data), item in zip(take, items):
                if item is None:
                    res.unclaim(ref.chunk)
                else:
                    batch.append((item, data))
            ok = not batch or await self._write_locked(batch)
            res.adoptions_written(sum(len(d) for _, d in take))
            self.adopted_chunks += len(batch)
            if not ok:
                return
