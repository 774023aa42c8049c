"""The mount daemon's prefetch task: the access trace, then catalog hints, then everything (materialization).

One task in the daemon's nursery, started once the mount is ready::

    pf = Prefetch(catalog, fetcher, trace_entries=entries, materializer=m)   # m = None: --no-materialize
    await nursery.start(pf.run)
    ... pf.stats()  # for the status file

With a :class:`~ogrefs.lazy.background.materialize.materializer.Materializer`, everything goes to the local
tree in three classes (trace at ``Priority.TRACE``, hints at
``Priority.HINT``, the rest at ``Priority.BACKGROUND``).  Without one (or when
it refuses to start for lack of disk space), only the trace and then the hints
are fetched, into the bounded chunk cache, at most half of the cache's bound
(more would only evict itself).  Readers (``Priority.READ``) always go first:
the fetcher keeps request slots for them.

Before the materializer's tree exists, the trace (or the hints) and then up
to ``REST_HOLD_BYTES`` (``rest_hold_bytes``) of the rest stream into memory, held by the fetcher
for the materializer (:meth:`Prefetch._stream_first`); the materializer
starts once the application settles or reads past its trace
(:meth:`Prefetch._settle`).

Owned by the trio loop, like the fetcher: the replays, the settle wait and
the status counters are touched by trio tasks only; worker threads get the
catalog and immutable inputs (a frozenset of held chunks, a byte bound).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Any, Awaitable, Callable

import trio

from ogrefs.errors import CorruptObject
from ogrefs.repo.catalog import Catalog
from ogrefs.lazy.background.boxcpu import SpareCpu
from ogrefs.lazy.fetch.fetcher import Fetcher, Keep, Priority
from ogrefs.repo.chunkref import ChunkRef
from ogrefs.lazy.background.materialize.materializer import Materializer
from ogrefs.box.copyplan import CLASSES
from ogrefs.units import GiB, MiB, human_bytes
from ogrefs.lazy.trace.replay import Replayer
from ogrefs.lazy.fetch.threadnice import to_background_thread
from ogrefs.repo.traces import Entry

log = logging.getLogger(__name__)

#: The materializer starts once the mount has had no request for this long ...
SETTLE_QUIET_S = 1.0
#: ... or this long after it could have started (see Prefetch._settle) ...
SETTLE_MAX_S = 20.0
#: ... or once the application, its trace replayed, has read this much that the trace did not hold.
SETTLE_PAST_TRACE_BYTES = 64 * MiB

#: After the trace (or the hints), this much of the rest streams into memory until the tree exists
#: (about 4 s of a 1 Gbit/s link: the start of a training step that computes, see Prefetch._stream_first).
REST_HOLD_BYTES = 512 * MiB

_STREAMING = {"trace": "replaying trace", "hint": "replaying hints", "background": "streaming the rest"}


def _memory_for_trace() -> int:
    """How much memory a replayed trace may hold: a quarter of what is available, at most 4 GiB."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return min(4 * GiB, int(line.split()[1]) * 1024 // 4)
    except (OSError, ValueError, IndexError):
        pass
    return 512 * MiB


def hint_refs(catalog: Catalog, max_bytes: int | None = None) -> list[ChunkRef]:
    """The chunks of the catalog's hints in rank order (directories: every file below), each once.

    Blocking (catalog queries): run it in a worker thread.  Stops at ``max_bytes``.
    """
    out: list[ChunkRef] = []
    seen: set[bytes] = set()
    total = 0
    for _klass, ino, _rank in catalog.hints():
        node = catalog.get(ino)
        if node is None:
            continue
        files = [node] if node.is_reg else [n for _p, n in catalog.walk(ino) if n.is_reg] if node.is_dir else []
        for f in files:
            if not f.size:
                continue
            try:
                extents = catalog.extents(f.ino)
            except CorruptObject:  # a malformed row: that file fails when it is read; the others are prefetched
                continue
            for ext in extents:
                if ext.chunk in seen:
                    continue
                if max_bytes is not None and total + ext.length > max_bytes:
                    return out
                seen.add(ext.chunk)
                out.append(ChunkRef.from_extent(ext))
                total += ext.length
    return out


def rest_refs(catalog: Catalog, skip: frozenset[bytes], max_bytes: int) -> list[ChunkRef]:
    """The snapshot's other chunks in pack order (the materializer's background order), about ``max_bytes``.

    The last chunk may go past ``max_bytes`` (a first chunk larger than the
    bound is still taken).

    Blocking (catalog queries): run it in a worker thread.
    """
    out: list[ChunkRef] = []
    total = 0
    for chunk, pack, offset, stored_len, raw_len in catalog.all_blobs(skip_malformed=True):
        if chunk in skip:
            continue
        if total >= max_bytes:
            break
        out.append(ChunkRef(chunk, pack, offset, stored_len, raw_len))
        total += raw_len
    return out


class Prefetch:
    """Trace → hints → background materialization (or trace → hints into the chunk cache)."""

    def __init__(self, catalog: Catalog, fetcher: Fetcher, *, trace_entries: list[Entry] | None = None,
                 materializer: Materializer | None = None, cache_budget: int | None = None,
                 window_bytes: int = 64 * MiB, idle_for: Callable[[], float] | None = None,
                 settle_quiet: float = SETTLE_QUIET_S, settle_max: float = SETTLE_MAX_S,
                 settle_past_trace_bytes: int = SETTLE_PAST_TRACE_BYTES, rest_hold_bytes: int = REST_HOLD_BYTES,
                 spare_cpu: Callable[[], Callable[[], Awaitable[None]]] | None = None) -> None:
        self.catalog = catalog
        self.fetcher = fetcher
        self.trace_entries = trace_entries or []
        self.materializer = materializer
        if cache_budget is None:
            bound = fetcher.cache.max_bytes if fetcher.cache is not None else fetcher.residency.memory_bytes
            cache_budget = bound // 2
        self.cache_budget = cache_budget
        self.window_bytes = window_bytes
        self.idle_for = idle_for  # seconds since the application's last request to the mount
        self.settle_quiet = settle_quiet
        self.settle_max = settle_max
        self.settle_past_trace_bytes = settle_past_trace_bytes
        self.rest_hold_bytes = rest_hold_bytes
        #: makes the pace of the streamed rest: by default the box's idle CPU (SpareCpu), which
        #: depends on everything else running; a test of what streams, not of pacing, passes its own
        self.spare_cpu = spare_cpu or (lambda: SpareCpu().wait)
        self.settling = False
        self.mode = "materialize" if materializer is not None else "cache"
        self.state = "idle"
        self.reason: str | None = None
        self._replays: dict[str, Replayer] = {}
        self._missed_at_trace_end: int | None = None  # the fetcher's read_missed_bytes when the trace was replayed
        self._samples: deque[tuple[float, int]] = deque()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run to the end (or until cancelled); never raises for fetch failures or a full disk."""
        task_status.started()
        self.state = "running"
        m = self.materializer
        if m is not None and m.state != "not materializing":
            replay = trio.CancelScope()
            async with trio.open_nursery() as nursery:
                if not await trio.to_thread.run_sync(m.is_built):
                    # (once the tree exists, the materializer's own classes go first instead)
                    nursery.start_soon(self._stream_first, m, replay)
                # the trace streams meanwhile; once the tree exists the materializer's own trace class
                # takes over (taking what is in memory), so the replay held in memory is bounded by
                # the application's start-up and the tree build, whatever the size of the trace
                await self._settle()
                await m.run(self.trace_entries, on_prepared=replay.cancel)
            self.fetcher.residency.hold(0)  # (what the materializer did not take: it stopped, or the disk is full)
            if m.state != "not materializing":
                self.state, self.reason = m.state, m.reason
                return
        if m is not None:
            self.mode, self.reason = "cache", m.reason  # no room for a local copy: warm the cache instead
        await self._warm_cache()
        self.state = "done"

    async def _settle(self) -> None:
        """Let the application's start-up burst pass before the materializer starts.

        Building the local tree takes seconds of CPU, and writing chunks to it
        more; on a small box that is CPU the starting application (imports,
        loading a checkpoint) needs, and both share the GIL with the requests
        the mount serves it.  So the materializer waits until the mount has had
        no request for ``settle_quiet`` seconds, at most ``settle_max``
        seconds (a training loop that keeps reading never looks quiet).  With
        no application, it starts after ``settle_quiet``, while a replayed
        trace is still streaming.

        A trace says where the start-up ends: once the trace is replayed and
        the application has read ``settle_past_trace_bytes`` that were not in
        memory (the trace did not hold them), it is past the start-up the
        trace recorded (a training loop reading its data, a crawl), and the
        materializer starts at once: what the application reads from then on
        is adopted into the tree, instead of going through the chunk cache
        to be copied later.
        """
        if self.idle_for is None:
            return
        self.settling = True
        try:
            start = trio.current_time()
            deadline = start + self.settle_max
            poll = 0.1 if self.trace_entries else math.inf  # (a trace: watch for reads past it)
            while (now := trio.current_time()) < deadline:
                idle = min(self.idle_for(), now - start)  # an application about to start gets its chance
                if idle >= self.settle_quiet:
                    return
                past_trace = self._missed_at_trace_end
                if (past_trace is not None
                        and self.fetcher.stats.read_missed_bytes - past_trace >= self.settle_past_trace_bytes):
                    log.info("materialization starts: the application reads past its trace")
                    return
                await trio.sleep(min(self.settle_quiet - idle, deadline - now, poll))
            log.info("materialization starts while the application is still busy (%.0f s)", self.settle_max)
        finally:
            self.settling = False

    async def _stream_first(self, m: Materializer, scope: trio.CancelScope) -> None:
        """Replay the trace (or, with none, the hints) into memory before the materializer builds its tree.

        The tree (every directory and file of the snapshot, and the plan of
        what goes where) takes seconds of CPU to build; the trace is what the
        application reads first, so it streams at once, at ``Priority.TRACE``,
        into memory, held there for the materializer (``Residency.hold``: it
        writes these chunks to the tree from memory moments later, and the
        disk cache would be a third copy).  It stops when the tree exists: the
        materializer's trace class goes on from there, taking the held chunks
        (which releases them).  The memory LRU keeps its size: an application
        that reads gigabytes meanwhile neither evicts the held chunks nor makes
        the daemon hold gigabytes.

        Without a trace the catalog's hints stream the same way, at
        ``Priority.HINT``: the link is busy from the first second (the
        materializer's hint class starts with the same chunks), and an
        application that starts without a trace finds its environment
        arriving meanwhile.  Either takes at most the room
        :func:`_memory_for_trace` allows.

        Then the rest of the snapshot, in the materializer's background order
        (pack order), at ``Priority.BACKGROUND``, up to ``rest_hold_bytes``:
        an application whose start-up is replayed spends the next seconds
        computing (a training step), and without this the link would idle
        until the materializer's tree exists; a training run that goes on to
        read all its data would then finish later than after a full restore.
        The bound keeps what this costs the computing application small (on
        two cores shared with the store, a step took 1.8 s longer with 512 MiB
        streamed, 3.5 s longer with 4 GiB).
        """
        with scope:
            room = self._hold_room()
            if self.trace_entries:
                await self._replay_trace_in_memory(Keep.MEMORY)
            else:
                await self._replay_hints_in_memory(room)
            room = min(self.fetcher.residency.hold_bytes - self.fetcher.residency.held_size, self.rest_hold_bytes)
            if room > 0:
                refs = await to_background_thread(rest_refs, self.catalog, self.fetcher.residency.held_chunks(), room)
                rest = Replayer.from_refs(self.catalog, self.fetcher, refs, priority=Priority.BACKGROUND,
                                          window_bytes=self.window_bytes, keep=Keep.MEMORY, bridge=True, hold=True,
                                          pace=self.spare_cpu())
                self._replays["background"] = rest
                await rest.run()
        for name in ("trace", "hint", "background"):
            r = self._replays.get(name)  # (also when the scope cut the replay short)
            if r is not None:
                log.info("%s replayed into memory: %s in %d chunks (%d failed)%s", name,
                         human_bytes(r.stats.bytes_done), r.stats.chunks_done, r.stats.failed,
                         "; the materializer goes on with the rest" if scope.cancelled_caught else "")

    def _hold_room(self) -> int:
        """Let the fetcher hold a replay in memory; returns the bytes a replay may take."""
        room = _memory_for_trace()
        self.fetcher.residency.hold(room)
        return room

    async def _replay_hints_in_memory(self, room: int) -> Replayer:
        refs = await to_background_thread(hint_refs, self.catalog, room)
        hints = Replayer.from_refs(self.catalog, self.fetcher, refs, priority=Priority.HINT,
                                   window_bytes=self.window_bytes, keep=Keep.MEMORY, bridge=True, hold=True)
        self._replays["hint"] = hints
        await hints.run()
        return hints

    async def _replay_trace_in_memory(self, keep: Keep, max_bytes: int | None = None) -> Replayer:
        """Hold the trace in memory, replayed at ``Priority.TRACE``; the caller releases it (``hold(0)``)."""
        room = self.fetcher.residency.hold_bytes or self._hold_room()
        trace = Replayer(self.catalog, self.fetcher, self.trace_entries, priority=Priority.TRACE,
                         window_bytes=self.window_bytes, max_bytes=room if max_bytes is None else min(max_bytes, room),
                         keep=keep, bridge=True, hold=True)
        self._replays["trace"] = trace
        await trace.run()
        self._missed_at_trace_end = self.fetcher.stats.read_missed_bytes
        return trace

    async def _warm_cache(self) -> None:
        """Without a local copy: the trace (held in memory and the disk cache), then hints."""
        budget = self.cache_budget
        if self.trace_entries:
            # the application's start-up reads the trace from memory, not through disk-cache loads
            trace = await self._replay_trace_in_memory(Keep.ALL, budget)
            budget -= trace.stats.bytes_done
            await self._settle()  # then the start-up is over: the disk cache serves the trace from now on
            self.fetcher.residency.hold(0)
        if budget > 0:
            refs = await to_background_thread(hint_refs, self.catalog, budget)
            hints = Replayer.from_refs(self.catalog, self.fetcher, refs, priority=Priority.HINT,
                                       window_bytes=self.window_bytes, bridge=True)
            self._replays["hint"] = hints
            await hints.run()
        log.info("prefetch into the chunk cache done: %s", {k: r.stats.bytes_done for k, r in self._replays.items()})

    def replay_finished(self, name: str) -> bool:
        """On the loop: whether the replay of class ``name`` (trace, hint, background) has run to its end."""
        r = self._replays.get(name)
        return r is not None and r.stats.finished

    def stats(self) -> dict[str, Any]:
        """For the status file: mode, state, reason, per class bytes done/total, rate, ETA."""
        if self.mode == "materialize" and self.materializer is not None:
            out = self.materializer.stats()
            out["mode"] = "materialize"
            out["trace_entries"] = len(self.trace_entries)
            idle = out["state"] == "idle"
            doing = []
            for name in ("trace", "hint", "background"):
                r = self._replays.get(name)
                if r is not None and out["state"] in ("idle", "preparing"):
                    # it streams into memory before the tree exists: show it as its class
                    out["classes"][name] = {"bytes_done": r.stats.bytes_done, "bytes_total": r.stats.bytes_total}
                    if not r.stats.finished:
                        doing.append(_STREAMING[name])
            if self.settling:
                doing.append("waiting for the application to settle")
            if idle and doing:
                out["state"] = ", ".join(doing)
            return out
        classes = {name: {"bytes_done": 0, "bytes_total": 0} for name in CLASSES}
        for name, r in self._replays.items():
            classes[name] = {"bytes_done": r.stats.bytes_done, "bytes_total": r.stats.bytes_total}
        done = sum(c["bytes_done"] for c in classes.values())
        total = sum(c["bytes_total"] for c in classes.values())
        now = time.monotonic()
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[1][0] > 10.0:
            self._samples.popleft()
        t0, b0 = self._samples[0]
        rate = (done - b0) / (now - t0) if now - t0 > 0.05 else 0.0
        trace = self._replays.get("trace")
        return {"mode": "cache", "state": self.state, "reason": self.reason, "complete": False, "classes": classes,
                "bytes_done": done, "bytes_total": total, "rate_bps": round(rate),
                "eta_s": round((total - done) / rate, 1) if rate > 0 and self.state == "running" else None,
                "trace_entries": len(self.trace_entries), "trace_dropped": trace.stats.dropped if trace else 0,
                "failed_chunks": sum(r.stats.failed for r in self._replays.values())}
