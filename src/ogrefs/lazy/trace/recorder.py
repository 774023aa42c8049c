"""Recording an access trace: what a mount reads first, to replay on the next mount.

A mount records the *first touch* of each chunk of each file, in order: the
imports, CUDA libraries and checkpoint reads of a training job's start, the
*resume*.  They are stored as ``(path, file offset)`` (:mod:`ogrefs.repo.traces`
has the format) so that a newer snapshot of the same paths can use them.

Recording ends at the first of:

* **the first quiet period of the resume**: no new first touch for
  ``quiet_s`` seconds (5), once first touches of at least ``resume_bytes``
  (64 MiB) have been recorded.  A resumed job reads its start-up back to back (the
  benchmark step's import of torch, ``torch.load`` and first batch: 972 opens
  in 1.1 s, no gap between two longer than 0.21 s on a hot cache); what comes
  after a pause is something else: a backup, rsync, tar or a virus scan that
  reads every file, a data loader's full pass.  Recorded, such a reader makes
  the trace the whole box in its order (``scripts/bench_loop``: ``restic
  backup`` of box B inside the old 300 s window gave a trace of 29,784
  entries, 6 GB of replay behind the step's own reads, and C's resume 1.66x
  its floor); it started only after a checkpoint write, a ``sync`` and B's
  10.2 s snapshot.  (The 972 opens were counted with an audit hook, on this
  project's 2-core CI box, without a mount.)  ``quiet_s``
  is the knob (``OGREFS_TRACE_QUIET``, seconds; 0 turns the rule off) for a
  start-up that pauses longer (a long compile before the first data read);
  what it cuts off still comes with the hints and on demand.  The 64 MiB
  keep a login, a shell or a unit's start before the job (a few MB of
  libraries and dotfiles, then a pause until the job starts) from ending the
  recording before the job's first read; a job whose whole start-up reads
  less is recorded for the window, as before;
* **a snapshot of the box** (``ogrefs snapshot`` or the agent, of a box that
  runs from this writable mount: it leaves ``<state>/snapshot-started``,
  :func:`ogrefs.box.records.mark_snapshot_started`), once 64 MiB are recorded
  and the box had read nothing new for ``SNAPSHOT_PAUSE_S`` (1 s) when it
  started: the job checkpointed, its resume is over.  What was first touched
  after the snapshot started is dropped: the snapshot's own environment
  probe (``pyvenv.cfg`` and ``dist-info`` metadata, read through the mount)
  and whatever follows it, such as ``restic backup`` right after it.  On a
  small box that sequence takes less than the quiet period (measured, a
  ``torch.load`` of a 64 MB checkpoint then ``ogrefs snapshot`` then
  ``restic backup``: 2.8 s from the step's last first touch to the
  snapshot's, 0.8 s more to restic's).  The pause keeps a snapshot taken
  *during* a resume (the agent's first one, at boot beside the job) from
  cutting it short;
* ``window_s`` seconds after the mount (300) or ``max_entries`` (200,000);
* :meth:`Recorder.stop` (unmount).

A recording that ended at a quiet period or at a snapshot is the whole resume: it is saved on
its own and *replaces* the trace the mount replayed, so a trace poisoned by a
bulk reader in the past heals on the next resume.  One cut short (the window,
the bound, an unmount) is followed by the replayed trace's entries it did not
touch, as before (:func:`ogrefs.repo.traces.merge_traces`).

Ownership: :class:`Recorder` belongs to the trio loop (the vfs calls
``record`` on every read, on the trio thread).  Turning its inodes into paths
(catalog queries) and storing the trace run in a worker thread
(:func:`save_trace`), which only reads the recorder: by then it has stopped.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Callable, Iterable

import trio

from ogrefs.errors import CorruptObject
from ogrefs.repo.catalog import Catalog, paths_of
from ogrefs.repo.traces import Entry, encode_trace, merge_traces, store_trace
from ogrefs.store.base import StoreError
from ogrefs.units import MiB

if TYPE_CHECKING:
    from ogrefs.repo import Repository

log = logging.getLogger(__name__)

DEFAULT_WINDOW_S = 300.0
DEFAULT_MAX_ENTRIES = 200_000
DEFAULT_QUIET_S = 5.0
DEFAULT_RESUME_BYTES = 64 * MiB
SNAPSHOT_PAUSE_S = 1.0
QUIET_ENV = "OGREFS_TRACE_QUIET"
#: Reads of a file served from a local copy carry no extent list; they are recorded per granule of
#: this size (the average chunk), which the replay maps back to the extents holding them.
LOCAL_GRANULE = MiB


def quiet_from_env(env: dict[str, str] | None = None) -> float:
    """``quiet_s`` for a mount: ``OGREFS_TRACE_QUIET`` (seconds, 0 = off) when set and valid, else 5."""
    raw = (os.environ if env is None else env).get(QUIET_ENV, "")
    try:
        value = float(raw)
    except ValueError:
        if raw:
            log.warning("%s=%r is not a number of seconds; using %g", QUIET_ENV, raw, DEFAULT_QUIET_S)
        return DEFAULT_QUIET_S
    return value if value >= 0 else DEFAULT_QUIET_S


class Recorder:
    """First-touch order of (inode, chunk offset) from the mount until the first quiet period (module docstring).

    ``record`` is called by the vfs for every chunk a read touches; it costs a
    clock read and a dict lookup, and nothing once recording has ended
    (``ended`` says why: ``quiet``, ``snapshot``, ``window``, ``full`` or ``stopped``).
    Owned by the trio loop.
    """

    def __init__(self, catalog: Catalog, *, window_s: float = DEFAULT_WINDOW_S,
                 max_entries: int = DEFAULT_MAX_ENTRIES, quiet_s: float = DEFAULT_QUIET_S,
                 resume_bytes: int = DEFAULT_RESUME_BYTES, clock: Callable[[], float] = time.monotonic) -> None:
        self.catalog = catalog
        self.window_s = window_s
        self.max_entries = max_entries
        self.quiet_s = quiet_s
        self.resume_bytes = resume_bytes
        self.bytes = 0  # of the chunks first touched so far
        self._clock = clock
        self._start = clock()
        self._last_new: float | None = None  # when the newest first touch came
        # insertion-ordered: (inode, offset) -> (when first touched, bytes recorded up to and with it)
        self._seen: dict[tuple[int, int], tuple[float, int]] = {}
        self.active = max_entries > 0 and window_s > 0
        self.ended: str | None = None if self.active else "stopped"

    def record(self, ino: int, offset: int, length: int = 0) -> None:
        """A read touched the chunk of ``ino`` at ``offset`` of ``length`` bytes (for local files, that granule)."""
        if not self.active:
            return
        now = self._clock()
        if self._over(now):
            return
        key = (ino, offset)
        if key not in self._seen:
            self.bytes += length
            self._seen[key] = (now, self.bytes)
            self._last_new = now
            if len(self._seen) >= self.max_entries:
                self._end("full")

    def expired(self) -> bool:
        """Whether recording has ended or should end now (the daemon polls this when no read comes)."""
        return not self.active or self._over(self._clock())

    def _over(self, now: float) -> bool:
        if now - self._start > self.window_s:
            self._end("window")
        elif (self.quiet_s > 0 and self._last_new is not None and self.bytes >= self.resume_bytes
              and now - self._last_new > self.quiet_s):
            self._end("quiet")
        return not self.active

    def _end(self, why: str) -> None:
        if self.active:
            self.active = False
            self.ended = why
            log.info("access trace: recording ended (%s) after %.1f s with %d entries (%.0f MiB)", why,
                     self._clock() - self._start, len(self._seen), self.bytes / MiB)

    def snapshot_started(self, at: float) -> bool:
        """A snapshot of the box started at ``at`` (this clock): end the recording there if the resume is over.

        Over: at least ``resume_bytes`` first touched before ``at`` and none new in the ``SNAPSHOT_PAUSE_S``
        before it.  Then what was first touched after ``at`` is dropped.  Returns whether it ended.
        """
        if not self.active or not self._start <= at <= self._clock():  # not this recording's (an old mark)
            return False
        before = [(key, v) for key, v in self._seen.items() if v[0] <= at]
        if not before or before[-1][1][1] < self.resume_bytes or at - before[-1][1][0] < SNAPSHOT_PAUSE_S:
            return False
        self._seen = dict(before)
        self.bytes = before[-1][1][1]
        self._end("snapshot")
        return True

    @property
    def complete(self) -> bool:
        """Whether the recording ended at a quiet period or a snapshot: it holds the whole resume, nothing to merge."""
        return self.ended in ("quiet", "snapshot")

    def stop(self) -> None:
        """End recording (unmount); a quiet period that has passed unnoticed still counts as one."""
        if not self._over(self._clock()):
            self._end("stopped")

    def __len__(self) -> int:
        return len(self._seen)

    def raw(self) -> list[tuple[int, int]]:
        """(inode, offset) in first-touch order."""
        return list(self._seen)

    def entries(self) -> list[Entry]:
        """(path, offset) in first-touch order; blocking (catalog queries): call it from a worker thread."""
        seen = list(self._seen)
        paths = paths_of(self.catalog, (ino for ino, _off in seen))
        return [(path, off) for ino, off in seen if (path := paths[ino]) is not None]

    def merged(self, previous: Iterable[Entry] | None) -> list[Entry]:
        """What to save: this run's entries, then, unless the recording is complete, ``previous`` ones it did not touch.

        Blocking (catalog queries): call it from a worker thread.
        """
        return merge_traces(self.entries(), None if self.complete else previous, limit=self.max_entries)

    def to_bytes(self, previous: Iterable[Entry] | None = None, *, snap_id: str | None = None) -> bytes:
        """The JSON body of the trace (:meth:`merged`)."""
        return encode_trace(self.merged(previous), snap_id=snap_id)


def save_trace(repo: Repository, snap_id: str, recorder: Recorder, previous: list[Entry] | None = None) -> str | None:
    """Store this mount's trace (refining ``previous``, unless complete) under ``traces/<snap_id>/``; returns its key.

    Blocking (catalog queries, a store put): call it from a worker thread.
    Nothing is written when this mount read nothing: it has nothing to add to
    the trace it replayed, which the next mount finds as this one did.
    """
    if not len(recorder):
        return None
    entries = recorder.merged(previous)
    if not entries:
        return None
    key = store_trace(repo, snap_id, entries)
    log.info("saved access trace %s: %d entries (%d from this mount)", key, len(entries), len(recorder))
    return key


async def save_when_recorded(repo: Repository, snap_id: str, recorder: Recorder,
                             previous: list[Entry] | None = None, *, poll: float = 1.0,
                             snapshot_started: Callable[[], float | None] | None = None) -> str | None:
    """Daemon task: wait until ``recorder`` has stopped recording (quiet, a snapshot, window over or full), then save.

    ``snapshot_started`` (blocking: run in a worker thread each ``poll``) says
    when the newest snapshot of the box started, or None.  Store failures are
    logged, never raised: a lost trace only costs the next mount its head
    start.  On an earlier unmount, call :func:`save_trace` in a worker thread
    instead (``recorder.stop()`` first).
    """
    seen: float | None = None
    while recorder.active:
        await trio.sleep(poll)
        if snapshot_started is not None:
            at = await trio.to_thread.run_sync(snapshot_started)
            if at is not None and at != seen:  # a new snapshot (one that came during the resume is not one again)
                seen = at
                recorder.snapshot_started(at)
        recorder.expired()  # no read came to notice the quiet period or the end of the window
    try:
        return await trio.to_thread.run_sync(save_trace, repo, snap_id, recorder, previous)
    except (StoreError, OSError, CorruptObject) as exc:
        log.warning("could not save the access trace: %s", exc)
        return None
