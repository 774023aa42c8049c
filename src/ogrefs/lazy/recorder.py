"""Recording an access trace: what a mount reads first, to replay on the next mount.

A mount records the *first touch* of each chunk of each file, in order, during
its first ``window_s`` seconds (300) and up to ``max_entries`` (200,000)
entries: the imports, CUDA libraries and checkpoint reads of a training job's
start.  They are stored as ``(path, file offset)`` (:mod:`ogrefs.repo.traces`
has the format) so that a newer snapshot of the same paths can use them.

Ownership: :class:`Recorder` belongs to the trio loop (the vfs calls
``record`` on every read, on the trio thread).  Turning its inodes into paths
(catalog queries) and storing the trace run in a worker thread
(:func:`save_trace`), which only reads the recorder: by then it has stopped.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Iterable

import trio

from ogrefs.errors import CorruptObject
from ogrefs.repo.catalog import Catalog, paths_of
from ogrefs.repo.traces import Entry, encode_trace, merge_traces, store_trace
from ogrefs.store.base import StoreError

if TYPE_CHECKING:
    from ogrefs.repo import Repository

log = logging.getLogger(__name__)

MiB = 1024 * 1024
DEFAULT_WINDOW_S = 300.0
DEFAULT_MAX_ENTRIES = 200_000
#: Reads of a file served from a local copy carry no extent list; they are recorded per granule of
#: this size (the average chunk), which the replay maps back to the extents holding them.
LOCAL_GRANULE = MiB


class Recorder:
    """First-touch order of (inode, chunk offset) during the first ``window_s`` seconds of a mount.

    ``record`` is called by the vfs for every chunk a read touches; it costs a
    dict lookup, and nothing once recording has ended (window over or
    ``max_entries`` reached).  Owned by the trio loop.
    """

    def __init__(self, catalog: Catalog, *, window_s: float = DEFAULT_WINDOW_S,
                 max_entries: int = DEFAULT_MAX_ENTRIES, clock: Callable[[], float] = time.monotonic) -> None:
        self.catalog = catalog
        self.window_s = window_s
        self.max_entries = max_entries
        self._clock = clock
        self._start = clock()
        self._seen: dict[tuple[int, int], None] = {}  # insertion-ordered set
        self.active = max_entries > 0 and window_s > 0

    def record(self, ino: int, offset: int) -> None:
        """A read touched the chunk of ``ino`` that starts at ``offset`` (or, for local files, that granule)."""
        if not self.active:
            return
        if self.expired():
            self.active = False
            return
        key = (ino, offset)
        if key not in self._seen:
            self._seen[key] = None
            if len(self._seen) >= self.max_entries:
                self.active = False

    def expired(self) -> bool:
        return self._clock() - self._start > self.window_s

    def stop(self) -> None:
        self.active = False

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

    def to_bytes(self, previous: Iterable[Entry] | None = None, *, snap_id: str | None = None) -> bytes:
        """The JSON body of the trace: this run's entries, then ``previous`` entries not touched this run."""
        return encode_trace(merge_traces(self.entries(), previous, limit=self.max_entries), snap_id=snap_id)


def save_trace(repo: Repository, snap_id: str, recorder: Recorder, previous: list[Entry] | None = None) -> str | None:
    """Store this mount's trace (refining ``previous``) under ``traces/<snap_id>/``; returns its key.

    Blocking (catalog queries, a store put): call it from a worker thread.
    Nothing is written when this mount read nothing: it has nothing to add to
    the trace it replayed, which the next mount finds as this one did.
    """
    if not len(recorder):
        return None
    entries = merge_traces(recorder.entries(), previous, limit=recorder.max_entries)
    if not entries:
        return None
    key = store_trace(repo, snap_id, entries)
    log.info("saved access trace %s: %d entries (%d from this mount)", key, len(entries), len(recorder))
    return key


async def save_when_recorded(repo: Repository, snap_id: str, recorder: Recorder,
                             previous: list[Entry] | None = None, *, poll: float = 1.0) -> str | None:
    """Daemon task: wait until ``recorder`` has stopped recording (window over or full), then save the trace.

    Store failures are logged, never raised: a lost trace only costs the next
    mount its head start.  On an earlier unmount, call :func:`save_trace` in a
    worker thread instead (``recorder.stop()`` first).
    """
    while recorder.active:
        await trio.sleep(poll)
        if recorder.expired():  # no read came to notice the end of the window
            recorder.stop()
    try:
        return await trio.to_thread.run_sync(save_trace, repo, snap_id, recorder, previous)
    except (StoreError, OSError, CorruptObject) as exc:
        log.warning("could not save the access trace: %s", exc)
        return None
