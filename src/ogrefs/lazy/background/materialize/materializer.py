"""The materializer: the facade the mount, the prefetcher and the vfs use; lifecycle and progress.

Construct it before the mount serves (it loads which files are already
complete, so the vfs can serve them locally at once), hand it to
``SnapshotFS(..., local=materializer)``, and start :meth:`Materializer.run`
in the daemon's nursery after the mount is ready.  A run prepares the tree
and the plan (:mod:`.build`, one worker thread), then runs passes
(:mod:`.pipeline`) until every chunk is done, pausing while the store is
unavailable, then gives directories their metadata (:mod:`.writer`).

Who owns what: a Materializer, its counters and its state belong to the
trio loop.  Worker threads (the preparation, the writers, the plan queries)
get immutable inputs and return new objects, which the loop assigns
(:class:`~.build.Prepared`, the inodes a batch completed); they never assign
an attribute of a Materializer.  Where each chunk is (memory, in hand, in
the tree) is the :class:`~ogrefs.lazy.fetch.residency.Residency`'s, also the
loop's.  :meth:`Materializer.local_paths` is the one method meant for other
threads (the vfs's page-cache push): it reads recorded state only.

Seams: the two worker-thread stages are passed in, with the real ones as
defaults: ``preparer`` (:func:`~.build.prepare`) and ``make_writer``
(:class:`~.writer.TreeWriter`, whose :class:`~.writer.Disk` does the durable
I/O); and the argv of the tree build's child process, ``build_command``
(:data:`~.buildproc.COMMAND`).  Tests wrap them (to see when the tree is built, to hold a batch back,
to tear a write) instead of patching the materializer's methods; like every
worker-thread callable they get immutable inputs and assign nothing of the
loop's.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Sequence

import trio

from ogrefs.errors import OgrefsError
from ogrefs.lazy.fetch.fetcher import Fetcher
from ogrefs.lazy.background.materialize import buildproc, space
from ogrefs.lazy.background.materialize.build import Prepared, Preparer, prepare
from ogrefs.lazy.background.materialize.pacing import BuildGate, Pacer
from ogrefs.lazy.background.materialize.pipeline import Batch, Pass, PassSettings
from ogrefs.box.copyplan import CLASSES, Plan
from ogrefs.lazy.background.materialize.writer import TreeWriter, WriterFactory
from ogrefs.lazy.fetch.residency import Residency
from ogrefs.lazy.fetch.threadnice import to_background_thread
from ogrefs.repo.traces import Entry
from ogrefs.repo.catalog import Catalog
from ogrefs.units import MiB, human_bytes as human

log = logging.getLogger(__name__)


class Materializer:
    """Copies a snapshot into ``state_dir/tree`` in the background; see the package docstring.

    The vfs also reads chunks already done from the tree's files before those
    files are complete (the residency says which: ``Residency.where``; the file
    is :meth:`tree_path`), so nothing written is fetched again.
    """

    def __init__(self, catalog: Catalog, fetcher: Fetcher, state_dir: Path, *, window_bytes: int = 96 * MiB,
                 group_bytes: int = 16 * MiB, batch_bytes: int = 16 * MiB, batch_chunks: int = 1024,
                 reserve_bytes: int | None = None, flush_after: float = 0.2, retry_delay: float = 10.0,
                 adopt_bytes: int = 64 * MiB, residency: Residency | None = None,
                 free_bytes: space.FreeBytes = space.free_bytes, preparer: Preparer = prepare,
                 make_writer: WriterFactory = TreeWriter, idle_for: Callable[[], float] | None = None,
                 cpu_busy: Callable[[], Callable[[], bool]] | None = None,
                 build_command: Sequence[str] = buildproc.COMMAND) -> None:
        self.catalog = catalog
        self.fetcher = fetcher
        # where each chunk is: the fetcher's residency (so what readers fetch is adopted into the tree)
        self.residency = residency if residency is not None else fetcher.residency
        self.state_dir = Path(state_dir)
        self.tree = self.state_dir / "tree"
        self.reserve_bytes = reserve_bytes
        self.retry_delay = retry_delay
        self._free_bytes = free_bytes
        self._preparer = preparer  # (worker-thread stages: see the module docstring's seams)
        self._make_writer = make_writer
        # seconds since the application's last request to the mount (the vfs's): passes yield to it (pacing.py)
        # (both also wait while a snapshot of the box runs: the fetcher's flag, lazy/background/snapshotgate.py)
        # ``cpu_busy`` makes a new "the box's other processes leave us less than a core" (boxcpu.OthersCpu's
        # busy, in the daemon): an application computing on every core is active too (pacing.py)
        self.pacer = Pacer(idle_for, hold=lambda: fetcher.yielding, busy=cpu_busy() if cpu_busy else None)
        # ... and so does the tree build (pacing.py), but not to the CPU: its child process runs at the
        # scheduler's idle priority (buildproc.py), and its CPU would count as the others'
        self.gate = BuildGate(idle_for, hold=lambda: fetcher.yielding)
        self._build_command = tuple(build_command)
        self._build_yielded_s = 0.0
        self._settings = dict(window_bytes=window_bytes, group_bytes=group_bytes, batch_bytes=batch_bytes,
                              batch_chunks=batch_chunks, flush_after=flush_after, adopt_bytes=adopt_bytes)
        self.adopted_chunks = 0
        self.state = "idle"
        self.reason: str | None = None
        self.complete = False
        self.files_total = 0
        self.failed_chunks = 0
        self._tree_b = os.fsencode(self.tree)
        self._plan = Plan(self.state_dir / "materialize.sqlite")
        self._class_total = [0, 0, 0]
        self._class_done = [0, 0, 0]
        self._samples: deque[tuple[float, int]] = deque()
        self._failed: set[int] = set()  # chunk rows that failed for good in this run
        self._fresh = False  # the tree was built by this run: nothing was on disk before it started
        self._writer: TreeWriter | None = None  # set on the loop from the preparation's result
        self._snap_id = catalog.meta("snapshot_id") or Path(catalog.path).stem
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            owner = self._plan.open(self._snap_id)
            if owner != self._snap_id:
                self.state = "not materializing"
                self.reason = (f"not materializing: {self.state_dir} holds the materialization of snapshot "
                               f"{owner[:12]}, not {self._snap_id[:12]}")
                return
            self.residency.load_tree(self._plan.done_chunks(), self._plan.complete_inos())
            self.complete = self._plan.meta("finished") == "1"
        except (OSError, sqlite3.Error, OgrefsError) as exc:  # a full or read-only disk: the mount works without a local copy
            self.state = "not materializing"
            self.reason = f"not materializing: the state in {self.state_dir} cannot be opened ({exc})"

    def is_built(self) -> bool:
        """Blocking: whether the local tree exists already (an earlier run of this state directory)."""
        if self.state == "not materializing":
            return False
        return self._plan.meta("built") == "1"

    # -- the vfs side ---------------------------------------------------------------------------
    def local_path(self, ino: int) -> bytes | None:
        """The local copy of regular file ``ino`` if it is complete (data durable, metadata applied), else None."""
        return self._tree_file(ino) if self.residency.is_complete(ino) else None

    def local_paths(self, inos: list[int]) -> dict[int, bytes]:
        """Blocking (a worker thread; its own SQLite connection): the complete local copies among ``inos``.

        Reads the recorded state (a file is recorded complete once its data is
        durable and its metadata applied), so it needs nothing of the loop's.
        """
        if self.state == "not materializing":
            return {}
        return {ino: self._tree_b + path for ino, path in self._plan.complete_paths(inos).items()}

    def written_identity(self, ino: int) -> str | None:
        """Blocking, thread-safe (a point query of the plan on the caller's own connection): the identity complete
        file ``ino`` had when this tree's writer recorded it complete (:func:`ogrefs.localtree.copy_identity`), or
        None."""
        if self.state == "not materializing":
            return None
        return self._plan.written(ino)

    def tree_path(self, ino: int) -> bytes | None:
        """The tree's file for regular file ``ino``, complete or not (its done chunks are in place)."""
        return self._tree_file(ino) if self.residency.tree_has_chunks else None

    def _tree_file(self, ino: int) -> bytes | None:
        path = self._plan.file_path(ino)
        return self._tree_b + path if path is not None else None

    # -- progress ---------------------------------------------------------------------------
    def _sample(self) -> None:
        now = time.monotonic()
        self._samples.append((now, sum(self._class_done)))
        while len(self._samples) > 2 and now - self._samples[1][0] > 10.0:
            self._samples.popleft()

    def rate(self) -> float:
        """Bytes per second written over the last ~10 s."""
        if not self._samples:
            return 0.0
        t0, b0 = self._samples[0]
        now, done = time.monotonic(), sum(self._class_done)
        return (done - b0) / (now - t0) if now - t0 > 0.05 else 0.0

    def stats(self) -> dict[str, Any]:
        total, done = sum(self._class_total), sum(self._class_done)
        rate = self.rate()
        eta = (total - done) / rate if rate > 0 and self.state == "running" else None
        return {
            "state": self.state, "reason": self.reason, "complete": self.complete, "tree": str(self.tree),
            "classes": {name: {"bytes_done": self._class_done[i], "bytes_total": self._class_total[i]}
                        for i, name in enumerate(CLASSES)},
            "bytes_done": done, "bytes_total": total, "rate_bps": round(rate), "eta_s": None if eta is None else round(eta, 1),
            "files_complete": self.residency.files_complete, "files_total": self.files_total,
            "failed_chunks": self.failed_chunks, "adopted_chunks": self.adopted_chunks,
            # paused for an active application (pacing.py): the passes and the tree build
            "yielded_s": round(self.pacer.paused_s + self._build_yielded_s, 1),
        }

    # -- running --------------------------------------------------------------------------------
    async def run(self, trace: list[Entry] | None = None, *, on_prepared: Callable[[], None] | None = None,
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Materialize until everything is local, the disk is full, or cancelled; never raises for those.

        ``trace``: (path, offset) entries of the access trace to fetch first.
        ``on_prepared``: called once the tree and the plan exist (or materialization was refused).
        """
        task_status.started()
        if self.state == "not materializing":
            log.info("%s", self.reason)
            return
        self.state = "preparing"
        try:
            try:
                prepared = await self._prepare_gated(trace or [])
            finally:
                if on_prepared is not None:
                    on_prepared()
            if isinstance(prepared, str):
                self.state, self.reason = "not materializing", prepared
                log.warning("%s", self.reason)
                return
            self._adopt_prepared(prepared)
            self.state = "running"
            self._sample()
            await self._passes()
            assert self._writer is not None
            self.complete = await to_background_thread(self._finish, self._writer)
        except space.Stop as exc:
            self.state = "stopped"
            self.reason = space.stop_reason(exc.cause, exc.what, self.state_dir, sum(self._class_done),
                                            sum(self._class_total))
            log.error("%s", self.reason)
            return
        if self.complete:
            self.state, self.reason = "done", None
            log.info("materialization complete: %s in %s", human(sum(self._class_done)), self.tree)
        else:
            self.state = "incomplete"
            self.reason = f"{self.failed_chunks} chunk(s) could not be fetched; their files are served lazily"
            log.error("materialization incomplete: %s", self.reason)

    async def _prepare_gated(self, trace: list[Entry]) -> Prepared | str:
        """The preparation in a worker thread while the loop keeps its build gate up to date."""
        result: list[Prepared | str] = []
        failure: list[Exception] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.gate.watch)
            try:
                result.append(await to_background_thread(self._prepare, trace))
            except Exception as exc:  # raised below, outside the nursery (which would wrap it in a group)
                failure.append(exc)
            nursery.cancel_scope.cancel()
        if failure:
            raise failure[0]
        return result[0]

    def _prepare(self, trace: list[Entry]) -> Prepared | str:
        """Worker thread: the tree and the plan (:func:`~.build.prepare`); assigns nothing."""
        refusal = lambda needed: space.refusal(needed, self.state_dir, self.reserve_bytes,  # noqa: E731
                                               self._free_bytes)
        return self._preparer(self._plan, self.catalog, self._tree_b, trace, refusal, self._make_writer, self.gate,
                              self._build_command)

    def _adopt_prepared(self, p: Prepared) -> None:
        """On the loop: take over what the preparation found."""
        self._writer = p.writer
        self._fresh = p.fresh
        self._build_yielded_s = p.yielded_s
        self._class_total = list(p.class_total)
        self._class_done = list(p.class_done)
        self.files_total = p.files_total
        self.residency.load_tree(p.done, p.complete)

    async def _passes(self) -> None:
        """Passes over what is not done until none is left to retry; pauses while the store is unavailable.

        The pause is a policy, not a retry of a failed store call: every call
        of a pass already had the mount's ``--retry-for`` budget in the
        store's RetryingStore (the one place that retries).  A chunk that still
        failed with StoreUnavailable is background work, so instead of failing
        its file the materializer waits (``retry_delay``, doubling to 5 min)
        and passes again over what is not done.
        """
        delay = self.retry_delay
        assert self._writer is not None
        while True:
            one = Pass(self._plan, self.fetcher, self.residency, PassSettings(bridge=self._fresh, **self._settings),
                       write_batch=self._writer.write_batch, on_written=self._written, failed=self._failed,
                       pacer=self.pacer)
            try:
                await one.run()
            finally:
                self.failed_chunks += one.failed_chunks
                self.adopted_chunks += one.adopted_chunks
            if one.stopped is not None:
                raise space.Stop(one.stopped, "writing the local tree")
            if not one.retry:
                return
            self.state = "waiting"
            self.reason = f"the store is unavailable; trying again in {delay:.0f} s"
            log.warning("materialization: %s", self.reason)
            await trio.sleep(delay)
            delay = min(delay * 2, 300.0)
            self.state, self.reason = "running", None

    def _written(self, batch: Batch, newly: list[int]) -> None:
        """On the loop, after a batch is recorded: progress."""
        for item, _data in batch:
            self._class_done[item.cls] += item.ref.raw_len
        self._sample()

    def _finish(self, writer: TreeWriter) -> bool:
        """Worker thread: directories get their metadata once every file is complete; True if all is local."""
        if self._plan.meta("finished") == "1":
            return True
        if self._plan.files_left():
            return False
        try:
            writer.finish(self._tree_b)
        except (OSError, sqlite3.Error) as exc:
            raise space.Stop(exc, "applying directory metadata") from None
        return True
