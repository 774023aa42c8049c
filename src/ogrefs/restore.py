"""Eager restore: write a snapshot's tree to local disk, verified, in parallel.

The algorithm, in plain words:

1. Walk the catalog and list the selected entries; list every extent of the
   selected files in *pack order* and cut the packs into ranges: neighbouring
   blobs are fetched with one ranged GET (up to ``MAX_RANGE`` bytes, bridging
   gaps of up to ``MAX_GAP``), several ranges in flight at once.
2. Refuse before writing anything when the data does not fit in the target's
   free space (``check_space=False`` overrides: files being replaced free
   theirs).
3. Create the tree: directories (owner-only at first, so nothing is exposed
   before its final mode is set), symlinks, FIFOs and device nodes.  Then,
   while the workers already fetch (step 4), the main thread makes for each
   regular file, in the walk's order, an empty owner-only file under a
   *temporary name*
   (``.ogrefs-restore-<token>-<ino>.tmp``) in the directory of its first name,
   of its final size (holes stay holes).  ``<token>`` is random per restore
   and occurs in no name of the snapshot, so a tree whose own files look like
   temporary names never collides with them.  Temporary files an earlier,
   killed restore left in a directory (that pattern, owned by us, not a name
   of the snapshot) are removed.  A worker whose blob arrives before the walk
   reached its file makes the file itself (whoever comes first, under the
   file's creation lock): making thousands of small files and fetching their
   data overlap instead of following each other.  The file is kept open from
   its creation to its completion (up to a quarter of the open-files limit),
   so its writes go to the inode this restore made and resolve no name.
4. A worker thread fetches a range, decodes and BLAKE3-verifies each blob, and
   ``pwrite``s it into every temporary file that references it.  A blob that
   fails verification is fetched once more on its own (a bit flipped on the
   way is not a bad pack); if it fails again it is never written.  That
   second fetch is a policy about bad bytes, not a retry of a failed store
   call: those are retried only by the store's RetryingStore, within
   ``--retry-for`` (``restore --retry-for``), and what still fails there
   fails the range's files.  When the
   last blob of a file is written, its owner, xattrs, mode and times are set
   on its fd and it is renamed to its name; its other hardlinked names are
   linked to it then.  The temporary name sits in a directory a local user
   may be able to write, so it is trusted only while it holds the inode this
   restore created (:meth:`~ogrefs.localtree.LocalTree.open_own`, and the
   checks of :meth:`~ogrefs.localtree.LocalTree.rename`): a user's
   file renamed over it is never written, chowned, chmodded or put in place
   (before, root made a user's file a root-owned setuid binary that way).
   A file whose data fails is never renamed: every one of its names is
   reported and its temporary file removed, so an interrupted or failed
   restore never leaves a full-size wrong file under a real name.
5. Every name put in place is checked to still hold its file; one that
   does not (removed or replaced during the restore) is reported: restore
   counts every file it did not produce.
6. Directories get their owners, modes and times last, deepest first (so
   their mtimes survive), also when the restore failed or was stopped.

The summary's bytes are the logical sizes of the files in place (a sparse
file counts whole, a file that failed counts nothing), not the bytes
written.

One entry's trouble is that entry's: a path conflict (a non-empty directory
where the snapshot has a file), an xattr the target refuses, a failed write
are reported (:attr:`Restorer.failed`, :attr:`Restorer.metadata_problems`)
and the restore goes on.  :meth:`Restorer.stop` (SIGINT/SIGTERM, see
:func:`stop_on_signals`) ends it after the ranges in flight: no more are
fetched, and :class:`Interrupted` is raised once directories are finished.

Nothing is written outside the target: the catalog reader skips entries whose
name is not a plain file name (``..``, ``a/b``, empty, NUL) and directories met
twice (see :class:`ogrefs.repo.catalog.Catalog`); those are listed in
:attr:`Restorer.skipped`.  Every step goes through :class:`ogrefs.localtree.LocalTree`
(directory fds, no symlink followed, metadata set on open fds), so a local
user swapping a restored directory for a symlink cannot redirect a write, a
chown or a chmod.

Threads: the main thread owns the plan and builds the tree; workers receive
one immutable range description each and write disjoint byte ranges of the
temporary files; ``_lock`` guards the per-file pending counts, the counters
and the failure lists; a file's creation lock (one of 64, by inode number;
taken before ``_lock``, never after) guards its ``own`` and ``fd``, set once.  A file is finished by the worker that wrote its last
blob (its count reached zero under the lock), so by exactly one thread.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import secrets
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ogrefs.repo import codec
from ogrefs.repo.catalog import ROOT_INO, Catalog, Inode
from ogrefs.errors import CorruptObject, OgrefsError, UsageError
from ogrefs.localtree import (
    EntryReplaced,
    FileId,
    LocalTree,
    MetadataProblem,
    PathConflict,
    apply_fd_metadata,
    pwrite_all,
    split,
)
from ogrefs.inspect.machine import usable_cpus
from ogrefs.units import human_bytes
from ogrefs.store.base import StoreError

MAX_RANGE = 16 * 1024 * 1024
MAX_GAP = 1024 * 1024
#: Ranges fetched at once (restore, the no-FUSE copy): two per usable CPU (:func:`default_workers`), within these
#: bounds.  A worker waits for its GET, then decodes, names and writes: two per core keep the cores busy while half
#: wait on the link; more trade the GIL and the directories' locks (the 2-core VM restored the classic box in 9.7 s
#: with 8, 8.1 s with 4: docs/benchmarks.md).  At least 4 to overlap round trips; at most 32 (16 MiB each).
MIN_WORKERS, MAX_WORKERS = 4, 32

ReadRange = Callable[[str, int, int], bytes]
#: Temporary files of a restore are named ``.ogrefs-restore-<token>-<ino>.tmp`` (the token: 16 hex digits,
#: random per restore); a rerun removes leftovers of that pattern that are ours and not names of the snapshot.
TMP_PREFIX = b".ogrefs-restore-"
TMP_SUFFIX = b".tmp"
_TMP_NAME = re.compile(rb"\.ogrefs-restore-[0-9a-f]{16}-[0-9]+\.tmp")
#: Errors of one range's fetch that fail only its files: store errors, bad bytes, and a location the
#: store refuses as a key (a forged pack name in a catalog is ValueError from key validation).
_FETCH_ERRORS = (StoreError, CorruptObject, ValueError)


@dataclass(frozen=True)
class Batch:
    """What the no-FUSE mount's in-place copy (:mod:`ogrefs.inplace`) gives the :class:`Restorer` its stream is
    (which drives it in place of :meth:`Restorer.run`).

    ``extents(inos, on_malformed)``: the rows of :meth:`~ogrefs.repo.catalog.Catalog.all_extents` for those
    files only (a file whose rows are malformed is named to ``on_malformed`` and fails alone);
    ``may_replace(names)``: for each name, None when a finished file may be renamed over what it holds now, else
    why not (someone on the box changed it meanwhile: theirs stays); ``done(ino)``: called once a file is in place
    under all of its names.  Every file is made durable before its rename, so a file in place survives a crash
    with its bytes.
    """

    extents: Callable[[set[int], Callable[[int, str], object]],
                      Iterator[tuple[int, int, int, bytes, str | None, int, int]]]
    may_replace: Callable[[list[bytes]], list[str | None]]
    done: Callable[[int], None]


class Interrupted(OgrefsError):
    """The restore was stopped (SIGINT/SIGTERM) before it finished."""

    exit_code = 130


@contextlib.contextmanager
def stop_on_signals(stop: Callable[[], None]) -> Iterator[None]:
    """While in the block, SIGINT and SIGTERM call ``stop`` (once is enough) instead of raising."""
    def handler(signum: int, frame: object) -> None:
        stop()

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


#: The GIL's switch interval in a process whose work is a copy (Python's default: 5 ms). Each of a copy's threads
#: lets the GIL go for every file system call and catalog query, and then waits for it until the thread that took
#: it meanwhile lets go, up to the interval: with eight workers, a file's few calls each paid that wait. Measured
#: on bench_resume's classic box (22,567 files) from a file:// repository, three pairs taking turns: restore
#: 9.48 / 10.22 / 10.06 s at 5 ms against 9.00 / 9.13 / 8.59 s at 0.5 ms, the no-FUSE copy 11.43 / 10.68 / 11.12 s
#: against 10.99 / 9.89 / 10.49 s, with less CPU in every pair (docs/benchmarks.md).
COPY_SWITCH_INTERVAL = 0.0005


def short_gil_turns() -> None:
    """For a process whose work is a copy (``ogrefs restore``, the no-FUSE mount's daemon): the GIL changes hands
    after at most :data:`COPY_SWITCH_INTERVAL` (never longer than it was). Process-wide, and left so."""
    if sys.getswitchinterval() > COPY_SWITCH_INTERVAL:  # (set only then: CPython rounds it down a little)
        sys.setswitchinterval(COPY_SWITCH_INTERVAL)


def default_workers() -> int:
    """How many ranges a copy fetches at once on this box: see :data:`MIN_WORKERS`.  The CPUs are those this
    process may use (its affinity and its cgroups' CPU limit: a container limited to 8 CPUs of a 128-core host
    counts 8)."""
    return min(MAX_WORKERS, max(MIN_WORKERS, 2 * usable_cpus()))


def interruptible_sleep(stop: threading.Event) -> Callable[[float], None]:
    """A ``sleep`` for :class:`~ogrefs.store.RetryingStore` that ends a retry wait when ``stop`` is set:
    a restore stopped during an outage fetches nothing more and exits at once."""
    def sleep(seconds: float) -> None:
        if stop.wait(seconds):
            raise StoreError("interrupted while waiting to retry")
    return sleep


@dataclass
class PendingFile:
    """A regular file being restored: its names (the first holds the temporary file) and its missing writes."""

    node: Inode
    names: list[bytes]
    tmp: bytes
    pending: int = 0
    # Set once, under the file's creation lock, by whoever comes first (the main thread's walk, or the worker
    # with its first blob); read by the writers after they took that lock once.
    own: FileId | None = None  # the inode this restore created under ``tmp``: the name is trusted only while it holds it
    fd: int = -1  # ``own`` kept open from its creation (writes need no name), closed by _complete or _finish
    failed: bool = False
    done: bool = False


@dataclass(frozen=True)
class Blob:
    pack_offset: int
    stored_len: int
    raw_len: int
    chunk: bytes
    targets: tuple[tuple[int, int], ...]  # (ino, file offset)


@dataclass(frozen=True)
class Range:
    pack: str
    offset: int
    length: int
    blobs: tuple[Blob, ...]


@dataclass
class RestoreStats:
    files: int = 0
    dirs: int = 0
    others: int = 0
    total_bytes: int = 0
    written_bytes: int = 0  # bytes of data written (holes are not written; a file that failed later counts)
    restored_bytes: int = 0  # logical size of the files in place: what the summary calls restored
    fetched_bytes: int = 0
    requests: int = 0
    refetched: int = 0  # blobs fetched a second time after failing verification
    files_done: int = 0  # regular files complete, verified and in place under their names
    started: float = field(default_factory=time.monotonic)


def plan_ranges(blobs_by_pack: dict[str, list[Blob]]) -> list[Range]:
    """Coalesce each pack's blobs (sorted by offset) into ranged reads."""
    ranges = []
    for pack, blobs in blobs_by_pack.items():
        blobs.sort(key=lambda b: b.pack_offset)
        i = 0
        while i < len(blobs):
            rng = first_range(pack, blobs, i)
            ranges.append(rng)
            i += len(rng.blobs)
    return ranges


def first_range(pack: str, blobs: list[Blob], i: int = 0) -> Range:
    """The ranged read of ``blobs[i:]`` (sorted by offset) that starts at ``blobs[i]``: the blobs that follow
    it with gaps of at most ``MAX_GAP`` bytes (read and dropped), up to ``MAX_RANGE`` bytes in all."""
    start = end = blobs[i].pack_offset
    n = i
    while n < len(blobs):
        b = blobs[n]
        if n > i and (b.pack_offset - end > MAX_GAP or b.pack_offset + b.stored_len - start > MAX_RANGE):
            break
        end = max(end, b.pack_offset + b.stored_len)
        n += 1
    return Range(pack, start, end - start, tuple(blobs[i:n]))


def _selected(path: bytes, includes: list[bytes]) -> tuple[bool, bool]:
    """(record this entry, descend below it) for an ``--include`` list."""
    if not includes:
        return True, True
    for inc in includes:
        if path == inc or path.startswith(inc + b"/"):
            return True, True
        if inc.startswith(path + b"/"):
            return True, True  # an ancestor of an included path
    return False, False




def looks_temporary(name: bytes) -> bool:
    """Whether ``name`` has the pattern of a restore's temporary files (a tree may hold such names itself)."""
    return _TMP_NAME.fullmatch(name) is not None


def remove_stale(tree: LocalTree, rel: bytes, paths: set[bytes] | frozenset[bytes]) -> int:
    """Remove temporary files an earlier restore, killed before it finished, left in directory ``rel``:
    regular files of ours named by the pattern that are not entries of the snapshot (``paths``: at least
    every such path of the snapshot named by the pattern). How many."""
    removed = 0
    for name in tree.names_in(rel):
        path = rel + b"/" + name
        if not _TMP_NAME.fullmatch(name) or path in paths:
            continue
        with contextlib.suppress(OSError, EntryReplaced):
            tree.unlink(path, FileId.of(tree.lstat(path)))
            removed += 1
    return removed


def _tmp_for(rel: bytes, ino: int, token: bytes) -> bytes:
    parent, _ = split(rel)
    return parent + b"/" + TMP_PREFIX + token + b"-" + str(ino).encode() + TMP_SUFFIX


def token_for(entries: list[tuple[bytes, Inode]]) -> bytes:
    """A random token that occurs in no path of ``entries``: no temporary name can be a name of the tree."""
    while True:
        token = secrets.token_hex(8).encode()
        if not any(token in path for path, _node in entries):
            return token


class Restorer:
    def __init__(self, catalog: Catalog, read_range: ReadRange, target: bytes, *,
                 includes: list[bytes] | None = None, workers: int | None = None,
                 progress: Callable[[RestoreStats], None] | None = None,
                 decode_blob: Callable[[bytes, int, bytes], bytes] = codec.decode_blob,
                 check_space: bool = True, stop_event: threading.Event | None = None,
                 batch: Batch | None = None) -> None:
        self.cat = catalog
        self.batch = batch
        self.read_range = read_range
        self.decode_blob = decode_blob
        self.target = os.path.abspath(target).rstrip(b"/")
        self.includes = [os.path.normpath(b"/" + i.lstrip(b"/")) for i in (includes or [])]
        self.workers = workers or default_workers()
        self.progress = progress
        self.check_space = check_space
        self.stats = RestoreStats()
        self._lock = threading.Lock()
        self._stop = stop_event or threading.Event()  # (shared with the store's retry waits: see interruptible_sleep)
        self.failed: dict[bytes, str] = {}  # restored path -> reason it is not there
        self.metadata_problems: dict[bytes, str] = {}  # restored path -> metadata that could not be set
        self.skipped: list[str] = []  # catalog entries not restored because they are unsafe or malformed
        self._files: dict[int, PendingFile] = {}  # ino -> regular file with data or names to finish
        self._specials: dict[int, bytes] = {}  # ino -> first name of a hardlinked non-regular entry
        self._dirs: list[tuple[bytes, Inode]] = []
        self._bad_dirs: dict[bytes, bytes] = {}  # a directory not restored (or below one) -> the top one
        self._below_bad: dict[bytes, int] = {}  # top directory not restored -> entries below it not restored
        self._is_root = os.geteuid() == 0
        self._last_tick = 0.0
        self.tree: LocalTree | None = None
        self._token = b""  # of the temporary names (see token_for)
        # every selected path: a leftover-like name among them is the tree's
        self._paths: set[bytes] | frozenset[bytes] = set()
        #: files that may still be kept open from creation to completion (under _lock; one given back by
        #: :meth:`_open_tmp` when it takes a kept fd over)
        self._keep_fds = fds_to_keep()
        self._create_locks = [threading.Lock() for _ in range(64)]  # a file's: its ino modulo 64

    # -- public ---------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop after the ranges in flight (thread-safe; a signal handler calls it)."""
        self._stop.set()

    @property
    def problems(self) -> int:
        """Entries not restored or restored without all of their metadata."""
        return len(self.failed) + len(self.metadata_problems) + sum(self._below_bad.values()) + len(self.skipped)

    def run(self) -> RestoreStats:
        for inc in self.includes:
            if self.cat.resolve(inc) is None:
                raise UsageError(f"{os.fsdecode(inc)} is not in this snapshot")
        root = self.cat.get(ROOT_INO)
        if root is None:  # Catalog() refuses such a file; a defence for other readers
            raise CorruptObject("catalog has no root directory")
        self.tree = LocalTree(self.target or b"/")
        try:
            if self.batch is not None:  # (the in-place copy's stream drives a Restorer with a batch itself)
                raise TypeError("Restorer.run() restores a whole selection, not a batch")
            entries = self._select()
            self._token = token_for(entries)
            self._paths = {path for path, _node in entries}
            ranges, needed = self._plan({n.ino for _p, n in entries if n.is_reg and n.size})
            if self.check_space:
                self._check_space(needed)
            if self.target:
                self._dirs.append((b"", root))
            self._build(entries)
            self._fetch_all(ranges, self._create_files)
            self._verify_in_place()
        finally:
            self._finish()
        if self._stop.is_set():
            raise Interrupted(f"interrupted: {self.stats.files_done} of {self.stats.files} files restored; "
                              "the others were not put in place")
        return self.stats

    def display(self, rel: bytes) -> bytes:
        return (self.target + rel) if rel else (self.target or b"/")

    def _tick(self, force: bool = False) -> None:
        if self.progress and (force or time.monotonic() - self._last_tick > 0.2):
            self._last_tick = time.monotonic()
            self.progress(self.stats)

    # -- step 1: what to restore, and the ranges ---------------------------------------------------
    def _select(self) -> list[tuple[bytes, Inode]]:
        out = []
        for path, node in self.cat.walk():
            if _selected(path, self.includes)[0]:
                out.append((path, node))
        return out

    def _plan(self, wanted: set[int]) -> tuple[list[Range], int]:
        """Ranges to fetch, the writes each file waits for (``_pending``), and the bytes to be written."""
        self._pending: dict[int, int] = {}
        # files whose data the catalog lays out or locates wrongly (ino -> why): they fail alone
        self._malformed: dict[int, str] = {}
        by_pack, needed = self._blobs(wanted)
        return plan_ranges(by_pack), needed

    def _blobs(self, wanted: set[int]) -> tuple[dict[str, list[Blob]], int]:
        """The blobs of files ``wanted`` by pack (one per chunk, with every write it feeds), counted into
        ``_pending`` (and malformed files into ``_malformed``); the bytes to be written."""
        by_chunk: dict[bytes, tuple[str, int, int, int, list[tuple[int, int]]]] = {}
        needed = 0
        rows = (self.cat.all_extents(on_malformed=self._malformed.setdefault) if self.batch is None
                else self.batch.extents(wanted, self._malformed.setdefault))
        for ino, off, length, chunk, pack, poff, slen in rows:
            if ino not in wanted:
                continue
            if pack is None:
                self._malformed.setdefault(ino, f"catalog {self.cat.path.name}: a chunk has no location")
                continue
            entry = by_chunk.get(chunk)
            if entry is None:
                entry = by_chunk[chunk] = (pack, poff, slen, length, [])
            entry[4].append((ino, off))
            self._pending[ino] = self._pending.get(ino, 0) + 1
            needed += length
        by_pack: dict[str, list[Blob]] = {}
        for chunk, (pack, poff, slen, raw_len, targets) in by_chunk.items():
            by_pack.setdefault(pack, []).append(Blob(poff, slen, raw_len, chunk, tuple(targets)))
        return by_pack, needed

    def _check_space(self, needed: int) -> None:
        assert self.tree is not None
        st = os.fstatvfs(self.tree.root_fd)
        free = (st.f_bfree if self._is_root else st.f_bavail) * st.f_frsize
        if needed > free:
            raise OgrefsError(f"{os.fsdecode(self.target or b'/')}: not enough free space: the restore needs "
                              f"{human_bytes(needed)}, {human_bytes(free)} free (--force restores anyway)")

    # -- step 3: the tree ------------------------------------------------------------------------
    def _build(self, entries: list[tuple[bytes, Inode]]) -> None:
        assert self.tree is not None
        self._clean_stale(b"")
        for path, node in entries:
            if self._stop.is_set():
                return
            parent = split(path)[0]
            top = self._bad_dirs.get(parent)
            if top is not None:  # below a directory that could not be made
                self._below_bad[top] += 1
                if node.is_dir:
                    self._bad_dirs[path] = top
                continue
            try:
                self._make(path, node)
            except (OSError, PathConflict) as exc:
                reason = exc.strerror if isinstance(exc, OSError) else str(exc)
                self.failed[self.display(path)] = f"cannot create ({reason})"
                if node.is_dir:
                    self._bad_dirs[path] = path
                    self._below_bad[path] = 0
            self._tick()
        for ino, why in self._malformed.items():
            self._fail({ino}, why)

    def _make(self, path: bytes, node: Inode) -> None:
        assert self.tree is not None
        if node.is_dir:
            if self.tree.make_dir(path):
                self._clean_stale(path)
            self._dirs.append((path, node))
            self.stats.dirs += 1
            return
        if node.is_reg:
            self._make_file(path, node)
            return
        first = self._specials.get(node.ino) if node.nlink > 1 else None
        if first is not None:
            self.tree.link_name(first, path)
            return
        if not self.tree.create_special(path, node):
            return  # a socket: not restored
        self.stats.others += 1
        if node.nlink > 1:
            self._specials[node.ino] = path
        self._note(path, self.tree.apply_metadata(path, node, self.cat.xattrs(node.ino), as_root=self._is_root))

    def _make_file(self, path: bytes, node: Inode) -> None:
        assert self.tree is not None
        f = self._files.get(node.ino) if node.nlink > 1 else None
        if f is not None:
            self.tree.clear_for_file(path)  # a non-empty directory in the way is a conflict of this name only
            f.names.append(path)
            return
        self._files[node.ino] = PendingFile(node, [path], _tmp_for(path, node.ino, self._token),
                                      self._pending.get(node.ino, 0))
        self.stats.files += 1
        self.stats.total_bytes += node.size

    def _create_files(self) -> None:
        """The main thread's side of the data phase: every temporary file, in the walk's order (a worker whose
        blob arrives first creates its file itself); a file with nothing to fetch is finished here."""
        for f in list(self._files.values()):
            if self._stop.is_set():
                return
            if self._created(f) and not self._pending.get(f.node.ino) and not f.failed:
                self._complete(f)  # nothing to fetch: empty, or all holes
            self._tick()

    def _created(self, f: PendingFile) -> bool:
        """``f``'s temporary file exists (made now if it did not): False when it could not be made (reported)."""
        assert self.tree is not None
        with self._create_locks[f.node.ino % 64]:
            if f.own is not None or f.failed:
                return f.own is not None
            try:  # a non-empty directory in the way of its name is a conflict of this name only
                f.own, fd = self.tree.create_open(f.tmp, f.node.size, clear=split(f.names[0])[1])
            except (OSError, PathConflict) as exc:
                self._fail({f.node.ino}, f"cannot create ({reason_of(exc)})")
                return False
            with self._lock:
                keep = self._keep_fds > 0
                self._keep_fds -= keep
            if keep:
                f.fd = fd
            else:
                os.close(fd)
            return True

    def _clean_stale(self, rel: bytes) -> None:
        assert self.tree is not None
        remove_stale(self.tree, rel, self._paths)

    # -- step 4: the data ------------------------------------------------------------------------
    def _fetch_all(self, ranges: list[Range], meanwhile: Callable[[], None]) -> None:
        """Every range by the workers, while the main thread runs ``meanwhile``."""
        with ThreadPoolExecutor(self.workers, thread_name_prefix="ogrefs-restore") as pool:
            futures = [pool.submit(self._fetch, r) for r in ranges]
            try:
                meanwhile()
            finally:
                if self._stop.is_set():
                    for other in futures:
                        other.cancel()
            for fut in as_completed(futures):
                if fut.cancelled():  # (stopped: never started)
                    continue
                fut.result()
                self._tick()
                if self._stop.is_set():
                    for other in futures:
                        other.cancel()

    def _fail(self, inos: Iterator[int] | set[int], reason: str) -> None:
        with self._lock:
            for ino in inos:
                f = self._files.get(ino)
                if f is not None and not f.failed and not f.done:
                    f.failed = True
                    for name in f.names:
                        self.failed.setdefault(self.display(name), reason)

    def _fetch(self, rng: Range) -> None:
        if self._stop.is_set():
            return
        try:
            data = self.read_range(rng.pack, rng.offset, rng.length)
        except _FETCH_ERRORS as exc:
            self._fail({t[0] for b in rng.blobs for t in b.targets}, f"pack {rng.pack[:12]}: {exc}")
            return
        with self._lock:
            self.stats.fetched_bytes += len(data)
            self.stats.requests += 1
        for b in rng.blobs:
            start = b.pack_offset - rng.offset
            try:
                plain = self.decode_blob(data[start:start + b.stored_len], b.raw_len, b.chunk)
            except CorruptObject:
                plain = self._refetch(rng.pack, b)
                if plain is None:
                    continue
            for ino, off in b.targets:
                self._write(ino, plain, off)

    def _write(self, ino: int, plain: bytes, off: int) -> None:
        assert self.tree is not None
        f = self._files.get(ino)
        if f is None or f.failed or not self._created(f):  # (its entry could not be made: reported already)
            return
        try:
            if f.fd >= 0:  # (closed only once every write of the file is done)
                pwrite_all(f.fd, plain, off)
            else:
                fd = self.tree.open_own(f.tmp, os.O_WRONLY, f.own)
                try:
                    pwrite_all(fd, plain, off)
                finally:
                    os.close(fd)
        except (OSError, EntryReplaced) as exc:
            self._fail({ino}, f"write failed: {reason_of(exc)}")
            return
        with self._lock:
            self.stats.written_bytes += len(plain)
            f.pending -= 1
            last = f.pending == 0 and not f.failed
        if last:
            self._complete(f)

    def _refetch(self, pack: str, b: Blob) -> bytes | None:
        """A blob that failed verification, fetched once more on its own; None (and its files failed) if bad again."""
        with self._lock:
            self.stats.refetched += 1
        try:
            data = self.read_range(pack, b.pack_offset, b.stored_len)
            return self.decode_blob(data, b.raw_len, b.chunk)
        except _FETCH_ERRORS as exc:
            self._fail({t[0] for t in b.targets}, str(exc) if isinstance(exc, CorruptObject)
                       else f"pack {pack[:12]}: {exc}")
            return None

    def _complete(self, f: PendingFile) -> None:
        """All data of ``f`` is written and verified: metadata on its fd, then its names (one thread per file).

        The in-place copy's stream overrides it: there the names wait for a round's ``syncfs``."""
        fd = self._open_tmp(f)
        if fd is None:
            return
        try:
            self._place(f, fd, self._set_metadata(f, fd))
        except OSError as exc:
            self._fail({f.node.ino}, f"cannot be put in place ({reason_of(exc)})")
        finally:
            os.close(fd)

    def _set_metadata(self, f: PendingFile, fd: int) -> list[MetadataProblem]:
        """``f``'s owner, mode, xattrs and times on ``fd``: what could not be set (OSError when nothing can)."""
        return apply_fd_metadata(fd, f.node, self.cat.xattrs(f.node.ino), as_root=self._is_root)

    def _open_tmp(self, f: PendingFile) -> int | None:
        """``f``'s temporary file, still ours and of its size; None (and ``f`` failed) otherwise."""
        assert self.tree is not None
        fd, f.fd = f.fd, -1  # a kept fd is this thread's to close now
        if fd >= 0:  # (its place in the budget goes to the next file made: the caller's own bound applies now)
            with self._lock:
                self._keep_fds += 1
        try:
            if fd >= 0:
                self.tree.check_own(fd, f.own)  # (no second name was given to it meanwhile)
            else:
                fd = self.tree.open_own(f.tmp, os.O_RDONLY, f.own)
        except (OSError, EntryReplaced) as exc:
            self._fail({f.node.ino}, f"temporary file lost ({reason_of(exc)})")
            if fd >= 0:
                os.close(fd)
            return None
        if os.fstat(fd).st_size != f.node.size:
            os.close(fd)
            self._fail({f.node.ino}, "temporary file was truncated or extended by someone else")
            return None
        return fd

    def _place(self, f: PendingFile, fd: int, problems: list[MetadataProblem]) -> None:
        """Rename ``f`` (open as ``fd``) to its first name, link its others; its metadata problems noted."""
        assert self.tree is not None
        try:
            self.tree.rename(f.tmp, f.names[0], own_fd=fd)
            with self._lock:
                f.done = True
                self.stats.files_done += 1
                self.stats.restored_bytes += f.node.size
            for name in f.names[1:]:
                try:
                    self.tree.link(fd, name)
                except (OSError, PathConflict) as exc:
                    with self._lock:
                        self.failed[self.display(name)] = f"hardlink not made ({reason_of(exc)})"
            for name in f.names:
                self._note(name, problems)
            if self.batch is not None:
                self.batch.done(f.node.ino)
        except (OSError, PathConflict) as exc:
            self._fail({f.node.ino}, f"cannot be put in place ({reason_of(exc)})")

    def _verify_in_place(self) -> None:
        """Every name put in place still holds its file, or the file is reported and not counted: a name
        removed or replaced during the restore is a file this restore did not produce.  Names are looked
        up a directory at a time (one resolution of each directory, then a stat per name)."""
        assert self.tree is not None
        by_dir: dict[bytes, list[tuple[bytes, PendingFile]]] = {}
        for f in self._files.values():
            if f.done:
                for name in f.names:
                    if self.display(name) not in self.failed:
                        by_dir.setdefault(split(name)[0], []).append((name, f))
        for parent, named in by_dir.items():
            found = self.tree.identities(parent, [split(name)[1] for name, _f in named])
            for (name, f), ident in zip(named, found):
                if ident == f.own:
                    continue
                self.failed[self.display(name)] = "not in place at the end (removed or replaced during the restore)"
                if name == f.names[0]:
                    self.stats.files_done -= 1
                    self.stats.restored_bytes -= f.node.size

    def _note(self, rel: bytes, problems: list[MetadataProblem]) -> None:
        if problems:
            with self._lock:
                self.metadata_problems[self.display(rel)] = "; ".join(f"{p.what} not set ({p.reason})"
                                                                      for p in problems)

    # -- step 5: directories, whatever happened ------------------------------------------------------
    def _finish(self) -> None:
        tree = self.tree
        if tree is None:
            return
        try:
            for f in self._files.values():
                if f.fd >= 0:
                    os.close(f.fd)
                    f.fd = -1
                if not f.done:
                    if not f.failed and not self._stop.is_set():
                        self._fail({f.node.ino}, "not restored")
                    if f.own is not None:
                        with contextlib.suppress(OSError, EntryReplaced):
                            tree.unlink(f.tmp, f.own)
            for rel, node in reversed(self._dirs):
                try:
                    self._note(rel, tree.apply_metadata(rel, node, self.cat.xattrs(node.ino), as_root=self._is_root))
                except OSError as exc:
                    self.metadata_problems[self.display(rel)] = f"metadata not set ({exc.strerror})"
            self.skipped = [f"{name!r} in directory inode {parent}: {reason}"
                            for (parent, name), reason in sorted(self.cat.rejected.items())]
            self._tick(force=True)
        finally:
            tree.close()
            self.tree = None

    def below_failed(self) -> dict[bytes, int]:
        """Directories not restored -> how many entries below them were not restored either."""
        return {self.display(k): v for k, v in self._below_bad.items() if v}


def fds_to_keep() -> int:
    """How many files a restore keeps open from creation to completion at once: a quarter of what the open-files
    limit (the entry point raised it to the hard one) leaves to this process beside the descriptors it holds now,
    at most 65,536; the others are opened by name per write."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(0, min(65536, (soft - _open_fds()) // 4))


def _open_fds() -> int:
    """How many descriptors this process holds (0 where /proc is not there to say)."""
    try:
        return max(0, len(os.listdir("/proc/self/fd")) - 1)  # (less the listing's own)
    except OSError:
        return 0


def reason_of(exc: BaseException) -> str:
    return (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)
