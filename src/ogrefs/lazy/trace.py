"""Access traces: what a resumed box read first, recorded on one mount and replayed on the next.

A mount records the *first touch* of each chunk of each file, in order, during
its first ``window_s`` seconds (300) and up to ``max_entries`` (200,000)
entries: the imports, CUDA libraries and checkpoint reads of a training
job's start.  Entries are stored as ``(path, file offset)``, not inode numbers,
so a trace recorded on one snapshot also serves a *newer* snapshot of the
same paths: a path is resolved in the newer catalog, an offset mapped to the
extent that holds it, and entries whose file or data no longer exist are
dropped.

Storage (docs/format.md, "Traces"): ``traces/<snapshot-id>/<time>-<random>``,
an envelope (encrypted like every other object of an encrypted repository)
of JSON.  Later traces refine earlier ones: a saved trace is this run's order
followed by the entries of the previous trace that this run did not touch.

:class:`Recorder` is called by the vfs on every read (cheap: one dict lookup
and, while recording, one clock read), on the trio thread.  :class:`Replayer`
feeds a trace's chunks to the fetcher at ``Priority.TRACE`` in order, a
bounded number of bytes at a time.  Path resolution and catalog queries run in
worker threads; the Recorder and Replayer themselves belong to the trio loop.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sqlite3
import time
import urllib.parse
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable

import trio

from ogrefs.repo.catalog import ROOT_INO, Catalog, Extent, valid_name
from ogrefs.errors import CorruptObject
from ogrefs.lazy.fetcher import ChunkRef, FetchError, Fetcher, Keep, Priority, Ticket
from ogrefs.store.base import NotFound, StoreError

if TYPE_CHECKING:
    from ogrefs.repo import Repository

log = logging.getLogger(__name__)

MiB = 1024 * 1024

TRACE_FORMAT = "ogrefs-trace"
TRACE_VERSION = 1
DEFAULT_WINDOW_S = 300.0
DEFAULT_MAX_ENTRIES = 200_000
#: Reads of a file served from a local copy carry no extent list; they are recorded per granule of
#: this size (the average chunk), which the replay maps back to the extents holding them.
LOCAL_GRANULE = MiB

Entry = tuple[bytes, int]  # (absolute path in the snapshot, file offset)


def trace_prefix(snap_id: str) -> str:
    return f"traces/{snap_id}/"


# -- recording --------------------------------------------------------------------------------------
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
        finder = _PathFinder(self.catalog.path)
        paths: dict[int, bytes | None] = {}
        out: list[Entry] = []
        for ino, off in list(self._seen):
            if ino not in paths:
                paths[ino] = finder.path_of(ino)
            path = paths[ino]
            if path is not None:
                out.append((path, off))
        return out

    def to_bytes(self, previous: Iterable[Entry] | None = None, *, snap_id: str | None = None) -> bytes:
        """The JSON body of the trace: this run's entries, then ``previous`` entries not touched this run."""
        return encode_trace(merge_traces(self.entries(), previous, limit=self.max_entries), snap_id=snap_id)


class _PathFinder:
    """One path of an inode (hardlinks have several), from the catalog's dirents; memoizes directories."""

    def __init__(self, catalog_path: Path) -> None:
        uri = f"file:{urllib.parse.quote(str(Path(catalog_path).absolute()))}?mode=ro&immutable=1"
        self._db = sqlite3.connect(uri, uri=True)
        self._dirs: dict[int, bytes | None] = {ROOT_INO: b""}

    def _parent_name(self, ino: int) -> tuple[int, bytes] | None:
        row = self._db.execute("SELECT parent, name FROM dirents WHERE ino=? LIMIT 1", (ino,)).fetchone()
        if row is None or type(row[0]) is not int or not valid_name(row[1]):
            return None
        return row[0], row[1]

    def _dir_path(self, ino: int, depth: int = 0) -> bytes | None:
        if ino in self._dirs:
            return self._dirs[ino]
        pn = self._parent_name(ino) if depth < 4096 else None
        path = None
        if pn is not None:
            parent = self._dir_path(pn[0], depth + 1)
            path = None if parent is None else parent + b"/" + pn[1]
        self._dirs[ino] = path
        return path

    def path_of(self, ino: int) -> bytes | None:
        pn = self._parent_name(ino)
        if pn is None:
            return None
        parent = self._dir_path(pn[0])
        return None if parent is None else parent + b"/" + pn[1]


def merge_traces(current: Iterable[Entry], previous: Iterable[Entry] | None, *, limit: int) -> list[Entry]:
    """``current`` in order, then the entries of ``previous`` it does not hold; at most ``limit``."""
    seen: dict[Entry, None] = {}
    for e in current:
        seen.setdefault(e, None)
    for e in previous or ():
        if len(seen) >= limit:
            break
        seen.setdefault(e, None)
    return list(seen)[:limit]


def encode_trace(entries: list[Entry], *, snap_id: str | None = None) -> bytes:
    body = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "snapshot": snap_id,
            "created": datetime.now(timezone.utc).isoformat(),
            "entries": [[os.fsdecode(p), off] for p, off in entries]}
    return json.dumps(body, separators=(",", ":")).encode()


def decode_trace(data: bytes, what: str = "trace") -> list[Entry]:
    """Entries of a trace body; CorruptObject if it is not one.  Malformed entries are skipped."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        raise CorruptObject(f"{what} is not valid JSON") from None
    if not isinstance(body, dict) or body.get("format") != TRACE_FORMAT or not isinstance(body.get("entries"), list):
        raise CorruptObject(f"{what} is not an ogrefs trace")
    if body.get("version") != TRACE_VERSION:
        raise CorruptObject(f"{what} has trace version {body.get('version')!r}, this ogrefs reads {TRACE_VERSION}")
    out: list[Entry] = []
    for item in body["entries"]:
        if (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and item[0].startswith("/")
                and type(item[1]) is int and 0 <= item[1] < 2**63):
            try:
                out.append((os.fsencode(item[0]), item[1]))
            except UnicodeEncodeError:  # a lone surrogate that surrogateescape never produces (JSON "\ud800")
                continue
    return out


# -- storage ---------------------------------------------------------------------------------------------
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
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    key = f"{trace_prefix(snap_id)}{stamp}-{secrets.token_hex(4)}"
    repo.store.put(key, repo.codec.seal(key, encode_trace(entries, snap_id=snap_id)))
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


def _newest_trace(repo: Repository, snap_id: str) -> tuple[str, list[Entry]] | None:
    """The newest readable trace of one snapshot; unreadable ones are skipped with a warning."""
    try:
        keys = sorted(repo.store.list(trace_prefix(snap_id)), reverse=True)
    except StoreError as exc:
        log.warning("cannot list the traces of snapshot %s: %s", snap_id[:12], exc)
        return None
    for key in keys:
        try:
            return key, decode_trace(repo.codec.open(key, repo.store.get(key)), key)
        except NotFound:
            continue
        except (CorruptObject, StoreError) as exc:
            log.warning("skipping access trace %s: %s", key, exc)
    return None


def find_trace(repo: Repository, manifest: dict[str, Any]) -> tuple[str | None, list[Entry]]:
    """(key, entries) of the trace a mount of ``manifest`` should replay, or (None, []).

    The newest trace of this snapshot; else the newest trace of the newest
    *older* snapshot of the same paths (a new snapshot of the same box has
    none yet, and its paths are mostly the same files).  Blocking.
    """
    found = _newest_trace(repo, manifest["id"])
    if found is not None:
        log.info("replaying access trace %s of this snapshot (%d entries)", found[0], len(found[1]))
        return found
    paths = sorted(manifest.get("paths", []))
    try:
        snaps = repo.list_snapshots()
    except (StoreError, CorruptObject) as exc:
        log.warning("cannot list snapshots to find an older access trace: %s", exc)
        snaps = []
    older = [m for m in snaps if m["id"] != manifest["id"] and sorted(m.get("paths", [])) == paths
             and (m.get("time", ""), m["id"]) < (manifest.get("time", ""), manifest["id"])]
    for m in reversed(older):
        found = _newest_trace(repo, m["id"])
        if found is not None:
            log.info("no access trace of this snapshot yet; replaying %s of older snapshot %s (%d entries)",
                     found[0], m["id"][:12], len(found[1]))
            return found
    log.info("no access trace to replay (none for this snapshot or an older one of the same paths)")
    return None, []


def load_trace(repo: Repository, manifest: dict[str, Any]) -> list[Entry]:
    """Entries of the trace to replay for ``manifest`` (see :func:`find_trace`); [] when there is none."""
    return find_trace(repo, manifest)[1]


# -- mapping entries to chunks -------------------------------------------------------------------------
@dataclass(frozen=True)
class Resolved:
    ino: int
    extent: Extent

    @property
    def ref(self) -> ChunkRef:
        return ChunkRef.from_extent(self.extent)


class EntryResolver:
    """Maps (path, offset) entries to the extents of a catalog; memoizes files.  Blocking (thread)."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._files: dict[bytes, tuple[int, list[Extent], list[int]] | None] = {}
        self.dropped = 0  # entries whose file or data does not exist in this catalog

    def _file(self, path: bytes) -> tuple[int, list[Extent], list[int]] | None:
        if path in self._files:
            return self._files[path]
        try:
            node = self.catalog.resolve(path)
            info = None
            if node is not None and node.is_reg and node.size:
                extents = self.catalog.extents(node.ino)
                info = (node.ino, extents, [e.offset for e in extents])
        except CorruptObject as exc:
            log.warning("trace entry %s: %s", os.fsdecode(path), exc)
            info = None
        self._files[path] = info
        return info

    def resolve(self, entries: Iterable[Entry]) -> list[Resolved]:
        """The extent holding each entry, in order, each extent once; entries that map to nothing are dropped."""
        out: list[Resolved] = []
        seen: set[tuple[int, int]] = set()
        for path, off in entries:
            info = self._file(path)
            if info is None:
                self.dropped += 1
                continue
            ino, extents, starts = info
            k = bisect_right(starts, off) - 1
            if k < 0 or off >= extents[k].end:
                self.dropped += 1  # a hole now, or past the end of the file
                continue
            if (ino, extents[k].offset) not in seen:
                seen.add((ino, extents[k].offset))
                out.append(Resolved(ino, extents[k]))
        return out


def resolve_entries(catalog: Catalog, entries: Iterable[Entry]) -> list[Resolved]:
    return EntryResolver(catalog).resolve(entries)


# -- replay ----------------------------------------------------------------------------------------------
@dataclass
class ReplayStats:
    entries: int = 0
    dropped: int = 0  # entries that no longer exist
    chunks: int = 0  # distinct chunks to fetch
    bytes_total: int = 0
    bytes_done: int = 0
    chunks_done: int = 0
    failed: int = 0
    finished: bool = False


class Replayer:
    """Fetch the chunks of a list of entries, in order, at ``priority``, keeping ``window_bytes`` outstanding.

    Used for a trace (``Priority.TRACE``) and, with :meth:`from_refs`, for
    catalog hints (``Priority.HINT``) when nothing is materialized: the
    chunks land in the chunk cache (``keep=True``); before the materializer's
    tree exists, held in memory for it (``hold=True``).  ``max_bytes`` bounds what
    is fetched at all (a trace or a hint set larger than the bounded cache
    would only evict itself).  Failures are counted, never raised.
    """

    def __init__(self, catalog: Catalog, fetcher: Fetcher, entries: list[Entry] | None = None, *,
                 priority: Priority = Priority.TRACE, window_bytes: int = 64 * MiB,
                 group_bytes: int = 16 * MiB, max_bytes: int | None = None, keep: "Keep | bool" = True,
                 bridge: bool = False, hold: bool = False,
                 pace: Callable[[], Awaitable[None]] | None = None) -> None:
        self.catalog = catalog
        self.fetcher = fetcher
        self.entries = entries or []
        self.priority = priority
        self.window_bytes = window_bytes
        self.group_bytes = group_bytes
        self.max_bytes = max_bytes
        self.keep = keep
        self.bridge = bridge  # nothing of the snapshot is on local disk yet: GETs may bridge gaps
        self.hold = hold  # held in the fetcher's memory until the materializer takes them (Fetcher.hold)
        self.pace = pace  # awaited before each group is requested (background work that yields)
        self.stats = ReplayStats(entries=len(self.entries))
        self._refs: list[ChunkRef] | None = None

    @classmethod
    def from_refs(cls, catalog: Catalog, fetcher: Fetcher, refs: list[ChunkRef], **kw) -> "Replayer":
        r = cls(catalog, fetcher, None, **kw)
        r._refs = refs
        return r

    def _plan(self) -> list[ChunkRef]:
        if self._refs is not None:
            refs = self._refs
        else:
            resolver = EntryResolver(self.catalog)
            refs = [r.ref for r in resolver.resolve(self.entries)]
            self.stats.dropped = resolver.dropped
        out, seen, total = [], set(), 0
        for ref in refs:
            if ref.chunk in seen:
                continue
            if self.max_bytes is not None and total + ref.raw_len > self.max_bytes:
                break
            seen.add(ref.chunk)
            out.append(ref)
            total += ref.raw_len
        return out

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> ReplayStats:
        task_status.started()
        refs = await trio.to_thread.run_sync(self._plan)
        self.stats.chunks = len(refs)
        self.stats.bytes_total = sum(r.raw_len for r in refs)
        i = 0
        outstanding: deque[Ticket] = deque()  # in order
        out_bytes = 0
        while i < len(refs) or outstanding:
            # request more while the window has room: a group at a time, so neighbours share a GET
            while i < len(refs) and out_bytes + self.group_bytes <= max(self.window_bytes, self.group_bytes):
                if self.pace is not None:
                    await self.pace()
                group, size = [], 0
                while i < len(refs) and (not group or size + refs[i].raw_len <= self.group_bytes):
                    group.append(refs[i])
                    size += refs[i].raw_len
                    i += 1
                outstanding.extend(self.fetcher.request(group, self.priority, keep=self.keep, bridge=self.bridge,
                                                        hold=self.hold))
                out_bytes += size
            t = outstanding.popleft()
            try:
                await t.result()
                self.stats.bytes_done += t.ref.raw_len
                self.stats.chunks_done += 1
            except FetchError:
                self.stats.failed += 1
            out_bytes -= t.ref.raw_len
        self.stats.finished = True
        return self.stats
