"""The no-FUSE resume's engine: a snapshot written into place at its original paths, in priority order.

Where FUSE or mounting is not allowed (a RunPod or vast.ai container), ``ogrefs
mount SNAP /`` writes the snapshot onto this box's own disk instead of
mounting it (``mount/inplace.py`` runs this engine as a daemon).  In plain
words:

1. **Prepare.** Walk the catalog once, leaving out what this box keeps
   (``skip``: host-owned paths, mount points, below them too).  Record the
   entries in the plan (``box/copyplan.py``, the materializer's format: a
   regular file is recorded complete once it is in place with its metadata,
   so a rerun after a kill or a reboot skips it, and a snapshot of this box
   can ask which files are whole).  Create every directory, parents first,
   with its owner, mode and xattrs (its times come last).  On a rerun,
   temporary files a killed run left are removed first (``restore``'s pattern).
2. **Groups, in priority order, into one stream.** The files of the recorded
   trace, then the hints' (venv, CUDA libraries, the newest coherent checkpoint),
   then the rest in catalog order; the entries without bytes (links, empty files,
   device nodes) join the working set ahead of its files (a job execs
   ``venv/bin/python``, a link, and imports packages whose ``__init__.py`` is
   empty; the trace and the hints name only files with bytes).  The engine's
   thread takes them a group at a time (at most :data:`BATCH_FILES` files or
   :data:`BATCH_BYTES` bytes, one class a group; a path asked for,
   :meth:`InPlace.need`, goes into the next group, ahead of everything), keeps
   what the box already has (``kept.py``: the same bytes by chunk id, never by
   mtime), notes what each other name holds, and hands the group to the
   :class:`~ogrefs.inplace.stream.Stream`: one Restorer over the whole copy
   that fetches while the engine goes on, coalesces ranges across groups, and
   puts files in place in rounds (temporary names, every blob verified,
   metadata on the descriptor, ``syncfs``, rename; a lower class only once the
   classes above are placed).  A need of a file already handed over moves its
   blobs to the stream's asked-for class.  A name someone on this box changed
   meanwhile keeps their file (the snapshot's is not put over it).  Files are
   recorded complete in the plan once their renames are durable.
3. **Finish.** Directory times (and modes again), deepest first; the plan is
   marked finished when nothing failed.

A kill -9 or a full disk at any point leaves names that hold either what was
there before or the snapshot's verified file with its metadata, plus
temporary files a rerun removes: never a partial file under a real name.

Threads: the engine's thread (the daemon's) prepares, hands the groups over
and alone writes the tree's directories and the plan's build and end; the
stream's placer records files complete in the plan (its own connection) and
calls :meth:`InPlace._settle` as each is in place, its workers as a file fails
(see ``stream.py``).  Control connections call :meth:`InPlace.need` and
:meth:`InPlace.status` from their own threads, and :meth:`InPlace.pending` /
:meth:`InPlace.since` (what ``ogrefs run``'s supervisor keeps of what is still
to come).  ``_lock`` guards what those share: ``_settled``, ``_log``,
``_urgent``, ``_waiters``, ``_working``, ``failed`` and the counters.
``_before`` is written by the engine's thread before a group is handed over
and read by the placer after (one item each).  ``metadata_problems`` is one
dict with the stream's (each write one item).  The catalog answers any thread
(one SQLite connection each); ``_names``, ``_size``, ``_class_of`` are written
by :meth:`InPlace.prepare` before any other thread starts and only read after.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ogrefs.box.copyplan import CLASSES, Plan
from ogrefs.errors import CorruptObject, OgrefsError
from ogrefs.inplace import kept
from ogrefs.localtree import LocalTree, MetadataProblem, split, syncfs_fd
from ogrefs.repo import codec
from ogrefs.repo.catalog import ROOT_INO, Catalog, Inode
from ogrefs.inplace.stream import URGENT, Stream, all_paths
from ogrefs.restore import Batch, Interrupted, ReadRange, default_workers, looks_temporary, remove_stale
from ogrefs.units import MiB

log = logging.getLogger(__name__)

#: A group (what the engine's thread checks against the box and hands to the stream at once) holds at most
#: this many files ...
BATCH_FILES = 256
#: ... or this many bytes (a box that has them already hashes them: a path asked for and not yet handed over
#: waits for the group in hand, well under a second) ...
BATCH_BYTES = 64 * MiB
#: ... or this many entries, counting those without bytes (links, empty files, device nodes): nothing to fetch, a
#: rename each, so a group of them is not held to :data:`BATCH_FILES` (a root box has ~20,000 links).
BATCH_ENTRIES = 4096
#: While everything is handed over and the working set is not yet in place, the engine's thread looks this often.
_WAIT = 0.1
#: Symlinks followed while resolving a path asked for (the kernel's own limit).
_MAX_LINKS = 40

#: What a name holds (inode, change time, size), or None: someone changed it if this differs later.
Identity = tuple[int, int, int] | None
#: ``skip(path, parent ino, name)``: this box keeps the entry at ``path`` (and everything below it).
Skip = Callable[[bytes, int, bytes], bool]


class Refused(OgrefsError):
    """The state directory holds the plan of another snapshot."""


@dataclass(frozen=True)
class Order:
    """Which entries go first: the trace's files in trace order, then the hints' (inode numbers). A hint is a
    file or a directory, which names every file below it: the engine finds those in the walk it makes anyway
    (:meth:`InPlace._hinted`), so that the mount command need not walk each hinted tree before the fork."""

    trace: tuple[int, ...] = ()
    hints: tuple[int, ...] = ()


@dataclass
class Need:
    """One ``need`` request: it is answered when every entry it waits for is in place, or one failed."""

    pending: set[int]
    answer: str = "ok"  # ok, or "failed <reason>"; "absent"/"host" are answered at once
    event: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def now(cls, answer: str) -> "Need":
        need = cls(set(), answer)
        need.event.set()
        return need


class InPlace:
    """See the module docstring."""

    def __init__(self, catalog: Catalog, read_range: ReadRange, target: bytes, plan: Plan, *, snapshot_id: str,
                 skip: Skip, chunk_id: kept.ChunkId = codec.chunk_id,
                 decode_blob: Callable[[bytes, int, bytes], bytes] = codec.decode_blob, workers: int | None = None,
                 stop: threading.Event | None = None) -> None:
        self.cat = catalog
        self.read_range = read_range
        self.target = os.path.abspath(target).rstrip(b"/")
        self.plan = plan
        self.snapshot_id = snapshot_id
        self.skip = skip
        self.chunk_id = chunk_id
        self.decode_blob = decode_blob
        self.workers = workers or default_workers()
        self.stop = stop or threading.Event()
        self._as_root = os.geteuid() == 0
        self._lock = threading.Lock()
        self._names: dict[int, list[bytes]] = {}  # non-directory ino -> its names (hard links: several)
        #: non-directory ino -> its size if regular, -1 if not (inodes are read again per batch: a box of
        #: millions of files keeps only this and the names in memory)
        self._size: dict[int, int] = {}
        self._dirs: list[tuple[bytes, Inode]] = []  # parents first
        self._skipped: set[bytes] = set()  # top paths this box keeps
        self._class_of: dict[int, int] = {}
        self._queues: list[deque[int]] = [deque(), deque(), deque()]
        self._urgent: deque[int] = deque()
        self._settled: dict[int, str | None] = {}  # ino -> None (in place) or why it failed
        self._waiters: dict[int, list[Need]] = {}
        self._log: list[int] = []  # inos settled in place, in that order: what :meth:`since` reads
        self._working: set[int] = set()  # the working set still to settle
        self.failed: dict[bytes, str] = {}  # path -> reason
        self.metadata_problems: dict[bytes, str] = {}
        self.counts = {"bytes_total": [0, 0, 0], "bytes_done": [0, 0, 0], "files_total": 0, "files_done": 0,
                       "kept_files": 0, "kept_bytes": 0, "fetched_bytes": 0, "written_bytes": 0}
        self._tmp_like: frozenset[bytes] = frozenset()  # paths of the tree named like temporary files
        self._prepared = threading.Event()  # set once prepare() ended; need() waits for it
        self._prepare_error: str | None = None
        self._working_done = threading.Event()  # set once _working is empty (after prepare)
        self._fed: set[int] = set()  # inos handed to the stream (the engine's thread's)
        self._before: dict[bytes, Identity] = {}  # what a name to write held when its group was checked
        self._tree: LocalTree | None = None  # open while run() runs
        batch = Batch(self._extents, self._may_replace, lambda ino: self._settle(ino, None))
        self._stream = Stream(catalog, read_range, self.target or b"/", batch=batch, on_failed=self._settle,
                              on_durable=self._durable, decode_blob=decode_blob, workers=self.workers,
                              stop_event=self.stop)
        self._stream.metadata_problems = self.metadata_problems  # one dict: each write one item

    # -- 1. prepare ---------------------------------------------------------------------------------
    def prepare(self, order: Order) -> None:
        """Walk, record the plan, make the directories, queue the files (the engine's thread)."""
        try:
            self._prepare(order)
        except BaseException as exc:
            self._prepare_error = str(exc) or type(exc).__name__
            raise
        finally:
            self._prepared.set()

    def _prepare(self, order: Order) -> None:
        owner = self.plan.open(self.snapshot_id)
        if owner != self.snapshot_id:
            raise Refused(f"{self.plan.path.parent} holds the in-place copy of snapshot {owner[:12]}, not "
                          f"{self.snapshot_id[:12]}; give this one another --state-dir")
        resuming = self.plan.meta("built") == "1"
        walk_order = self._walk()
        if not resuming:
            self._record_plan()
        with LocalTree(self.target or b"/") as tree:
            self._make_dirs(tree, clean=resuming)
            complete = self.plan.complete_inos()
            if resuming and complete:
                complete = self._still_in_place(tree, complete)
        self._queue(order, walk_order, complete)

    def _still_in_place(self, tree: LocalTree, complete: frozenset[int]) -> frozenset[int]:
        """On a rerun: the files recorded complete, less those with a name that holds nothing any more (removed
        since, or a directory of them).  Those are recorded incomplete and go back to the queue: a rerun puts
        back what is missing and never calls a file in place that is not.  A name that holds something else
        (written, truncated, replaced since: a job running from the copy appends to its log) is the box's own
        and stays as it is, as during the copy; so does every name of an inode one of whose names was changed.
        One ``stat`` a name, a directory's names from one descriptor of it (:meth:`LocalTree.lstats`)."""
        by_dir: dict[bytes, list[tuple[bytes, int]]] = {}
        for ino in complete:
            for name in self._names.get(ino, ()):
                parent, base = split(name)
                by_dir.setdefault(parent, []).append((base, ino))
        first: dict[int, int] = {}  # inode -> the inode number its first name found holds
        missing: set[int] = set()
        changed: set[int] = set()
        for parent, entries in by_dir.items():
            found = tree.lstats(parent, [base for base, _ino in entries])
            if found is None:  # (made by _make_dirs just now: a symlink or a file in its place is someone's)
                changed.update(ino for _base, ino in entries)
                continue
            for (_base, ino), st in zip(entries, found):
                if st is None:
                    missing.add(ino)
                elif (not stat.S_ISREG(st.st_mode) or st.st_size != self._size[ino]
                        or first.setdefault(ino, st.st_ino) != st.st_ino):
                    changed.add(ino)
        gone = missing - changed
        if gone:
            self.plan.mark_incomplete(sorted(gone))
            log.warning("%d files recorded in place before are missing (removed since): written again", len(gone))
        return complete - gone

    def _walk(self) -> list[int]:
        """Every entry this box does not keep; the non-directory inodes in catalog order."""
        walk_order: list[int] = []
        paths: list[bytes] = []
        parents: dict[bytes, int] = {b"": ROOT_INO}
        for path, node in self.cat.walk():
            parent, name = split(path)
            if parent in self._skipped or parent not in parents:
                if node.is_dir:
                    self._skipped.add(path)
                continue
            if self.skip(path, parents[parent], name):
                self._skipped.add(path)
                continue
            if looks_temporary(name):
                paths.append(path)
            if node.is_dir:
                parents[path] = node.ino
                self._dirs.append((path, node))
                continue
            if node.ino not in self._names:
                self._names[node.ino] = []
                self._size[node.ino] = node.size if node.is_reg else -1
                walk_order.append(node.ino)
            self._names[node.ino].append(path)
        self._tmp_like = frozenset(paths)
        return walk_order

    def _record_plan(self) -> None:
        files, others, links = [], [], []
        for ino, names in self._names.items():
            if self._size[ino] >= 0:
                files.append((ino, names[0]))
                links.extend((name, ino) for name in names[1:])
            else:
                others.extend((ino, name, 0) for name in names)
        others.extend((node.ino, path, 1) for path, node in self._dirs)
        self.plan.begin_build()
        self.plan.add_entries(files, others, links)
        self.plan.commit_build()

    def _make_dirs(self, tree: LocalTree, *, clean: bool) -> None:
        """Every directory, parents first, owner and mode set at once (a job running meanwhile can enter it)."""
        for path, node in self._dirs:
            try:
                tree.make_dir(path)
                if clean:
                    remove_stale(tree, path, self._tmp_like)
                self._note(path, tree.apply_metadata(path, node, self.cat.xattrs(node.ino), as_root=self._as_root))
            except OSError as exc:
                raise OgrefsError(f"cannot create directory {os.fsdecode(self._display(path))}: "
                                  f"{exc.strerror}") from None
        if clean:
            remove_stale(tree, b"", self._tmp_like)

    def _hinted(self, hints: tuple[int, ...], walk_order: list[int]) -> list[int]:
        """The files the hints name, first hint first, each in walk order; a file under several hints comes
        with the first of them (as :func:`~ogrefs.lazy.background.materialize.build.hint_files` gives them)."""
        rank: dict[int, int] = {}
        for i, ino in enumerate(hints):
            rank.setdefault(ino, i)
        # each directory's best rank, its own or a parent's (the walk lists parents first)
        inf = len(hints)
        dir_rank = {b"": rank.get(ROOT_INO, inf)}
        for path, node in self._dirs:
            dir_rank[path] = min(rank.get(node.ino, inf), dir_rank.get(split(path)[0], inf))
        by_rank: dict[int, list[int]] = {}
        for ino in walk_order:
            if self._size[ino] < 0:
                continue  # (hints name regular files)
            best = min([rank.get(ino, inf)] + [dir_rank.get(split(name)[0], inf) for name in self._names[ino]])
            if best < inf:
                by_rank.setdefault(best, []).append(ino)
        return [ino for r in sorted(by_rank) for ino in by_rank[r]]

    def _queue(self, order: Order, walk_order: list[int], complete: frozenset[int]) -> None:
        seen: set[int] = set()
        hinted = self._hinted(order.hints, walk_order) if order.hints else []
        for cls, inos in enumerate((order.trace, hinted, walk_order)):
            for ino in inos:
                if ino not in self._size or ino in seen:
                    continue
                seen.add(ino)
                self._class_of[ino] = cls
                size = max(self._size[ino], 0)
                self.counts["bytes_total"][cls] += size
                self.counts["files_total"] += 1
                if ino in complete:
                    self._settled[ino] = None
                    self.counts["bytes_done"][cls] += size
                    self.counts["files_done"] += 1
                else:
                    self._queues[cls].append(ino)
        first = order.trace or hinted
        self._working = {ino for ino in first if ino in self._size and ino not in complete}
        if self._working:
            self._bytesless_first(0 if order.trace else 1, walk_order, complete)

    def _bytesless_first(self, cls: int, walk_order: list[int], complete: frozenset[int]) -> None:
        """The entries without bytes go into the working set's class ``cls``, ahead of its files: the links and
        empty files on a job's way are in place when ``mount`` returns (a trace records reads, hints name files
        with bytes), and they cost no fetch."""
        bytesless = [ino for ino in walk_order if self._size[ino] <= 0 and ino not in complete]
        for ino in bytesless:
            self._class_of[ino] = cls
        self._queues[cls].extendleft(reversed(bytesless))
        self._working.update(bytesless)

    # -- 2. batches -----------------------------------------------------------------------------------
    def run(self, on_working_set: Callable[[], None] = lambda: None) -> None:
        """Every group handed to the stream in order, then the directories' metadata; ``on_working_set`` once the
        trace's files (or the hints', without a trace) are settled.  Raises :class:`~ogrefs.restore.Interrupted`
        when stopped."""
        signalled = False
        with LocalTree(self.target or b"/") as tree:
            self._tree = tree
            self._stream.start(all_paths(self._names.values(), (p for p, _n in self._dirs)), self._tmp_like)
            try:
                while not self.stop.is_set():
                    signalled = signalled or self._signal(on_working_set)
                    cls, inos = self._next_batch()
                    if not inos:
                        break
                    self._feed(tree, cls, inos)
                self._stream.seal()
                while not (signalled or self.stop.is_set() or self._stream.drained()):
                    self._working_done.wait(_WAIT)
                    signalled = self._signal(on_working_set)
            finally:
                self._stream.close()
                self._tree = None
        if not signalled and not self.stop.is_set():
            self._signal(on_working_set)
        if self.stop.is_set():
            raise Interrupted("stopped")
        self._finish()

    def _signal(self, on_working_set: Callable[[], None]) -> bool:
        """Call ``on_working_set`` if the working set is settled; whether it was."""
        if self.working_left():
            return False
        self._stream.to_background()
        on_working_set()
        return True

    def working_left(self) -> int:
        with self._lock:
            return len(self._working)

    def _next_batch(self) -> tuple[int, list[int]]:
        """The next group and its class: asked-for files first, then the queues in class order; one class a
        group."""
        out: list[int] = []
        size = files = 0
        with self._lock:
            for cls, queue in enumerate((self._urgent, *self._queues)):
                while queue and files < BATCH_FILES and len(out) < BATCH_ENTRIES and size < BATCH_BYTES:
                    ino = queue.popleft()
                    if ino in self._settled or ino in self._fed:
                        continue
                    out.append(ino)
                    self._fed.add(ino)
                    size += max(self._size[ino], 0)
                    files += self._size[ino] > 0
                if out:
                    return cls, out
        return URGENT, out

    def _feed(self, tree: LocalTree, cls: int, inos: list[int]) -> None:
        """Keep what the box has of a group; hand the rest to the stream (their names' state noted first)."""
        rest, before = self._keep_what_is_there(tree, inos)
        self._before.update(before)
        kept = set(inos).difference(rest)
        self._stream.durable_later([ino for ino in inos if ino in kept and self._size[ino] >= 0])
        found = self.cat.get_many(rest)
        nodes = {ino: found.get(ino) for ino in rest}
        for ino in [ino for ino, node in nodes.items() if node is None]:
            self._settle(ino, "not written (no longer in the catalog)")
        self._stream.add([(name, node) for ino, node in nodes.items() if node is not None
                          for name in self._names[ino]], cls)

    def _may_replace(self, names: list[bytes]) -> list[str | None]:
        """For each of ``names``: None when the stream may rename over what it holds; else why not (the placer's
        thread, or an asker's).  A directory is resolved once for its names in ``names``, not once a name
        (the placer's checks were a tenth of the copy's thread time on a venv of 39,000 files)."""
        out: list[str | None] = [None] * len(names)
        tree = self._tree
        if tree is None:
            return out
        by_dir: dict[bytes, list[int]] = {}
        for i, name in enumerate(names):
            by_dir.setdefault(split(name)[0], []).append(i)
        for parent, idx in by_dir.items():
            found = tree.lstats(parent, [split(names[i])[1] for i in idx]) or [None] * len(idx)
            for i, st in zip(idx, found):
                now = _identity_of(st)
                if now is not None and now != self._before.get(names[i]):
                    out[i] = "changed on this box while it was copied: this box's version is kept"
        return out

    def _durable(self, inos: list[int]) -> None:
        """Files durable under their names: the plan records them complete (the placer's thread)."""
        self.plan.mark_complete([ino for ino in inos if self._size[ino] >= 0])

    def _keep_what_is_there(self, tree: LocalTree, inos: list[int]) -> tuple[list[int], dict[bytes, Identity]]:
        """Keep the batch's entries that are already in place; the others, to write, and what each of their
        names holds now (see :func:`_identity`)."""
        listed: dict[bytes, set[bytes]] = {}  # one listing a directory instead of a stat a name
        for ino in inos:
            for name in self._names[ino]:
                parent = split(name)[0]
                if parent not in listed:
                    listed[parent] = _names_in(tree, parent)

        def check(ino: int) -> tuple[list[MetadataProblem] | None, dict[bytes, Identity]]:
            names = self._names[ino]
            ids = {name: _identity(tree, name) if split(name)[1] in listed[split(name)[0]] else None
                   for name in names}
            if ids[names[0]] is None or len(names) != 1:
                return None, ids  # nothing there (most of a fresh pod): no catalog query
            return self._keep_one(tree, ino, names[0]), ids

        there = [ino for ino in inos if any(split(n)[1] in listed[split(n)[0]] for n in self._names[ino])]
        found_there = {}
        if there:  # (nothing on most of a fresh pod)
            with ThreadPoolExecutor(self.workers, thread_name_prefix="ogrefs-inplace-keep") as pool:
                found_there = dict(zip(there, pool.map(check, there)))
        found = [found_there.get(ino) or (None, {n: None for n in self._names[ino]}) for ino in inos]
        rest, before = [], {}
        for ino, (problems, ids) in zip(inos, found):
            if problems is None:
                rest.append(ino)
                before.update(ids)
                continue
            self._note(self._names[ino][0], problems)
            with self._lock:
                self.counts["kept_files"] += 1
                self.counts["kept_bytes"] += max(self._size[ino], 0)
            self._settle(ino, None)
        return rest, before

    def _keep_one(self, tree: LocalTree, ino: int, name: bytes) -> list[MetadataProblem] | None:
        """Keep entry ``ino`` at ``name`` if it is the snapshot's already (kept.py); its metadata problems."""
        node = self.cat.get(ino)
        if node is None or node.nlink != 1:
            return None
        xattrs = self.cat.xattrs(ino)
        if node.is_lnk:
            return kept.keep_symlink(tree, name, node, xattrs, as_root=self._as_root)
        if not node.is_reg:
            return None
        try:
            extents = self.cat.extents(ino)
        except CorruptObject:
            return None  # the restorer fails it alone
        return kept.keep_file(tree, name, node, extents, xattrs, self.chunk_id, as_root=self._as_root)

    def _extents(self, wanted: set[int], on_malformed: Callable[[int, str], object]
                 ) -> Iterator[tuple[int, int, int, bytes, str | None, int, int]]:
        """The group's extents in a few queries (one a file cost the engine's thread most of its time, and
        the copy's workers waited for it on a box of small files)."""
        return self.cat.extents_of(wanted, on_malformed=on_malformed)

    def _settle(self, ino: int, why: str | None) -> None:
        """``ino`` is in place (``why`` None) or failed: counted, and the requests waiting on it answered."""
        size, cls = max(self._size[ino], 0), self._class_of.get(ino, 2)
        with self._lock:
            if ino in self._settled:
                return
            self._settled[ino] = why
            self._working.discard(ino)
            if not self._working:
                self._working_done.set()
            if why is None:
                self._log.append(ino)
                self.counts["files_done"] += 1
                self.counts["bytes_done"][cls] += size
            else:
                for name in self._names[ino]:
                    self.failed[self._display(name)] = why
            for need in self._waiters.pop(ino, []):
                need.pending.discard(ino)
                if why is not None:
                    need.answer = f"failed {os.fsdecode(self._display(self._names[ino][0]))}: {why}"
                if not need.pending or why is not None:
                    need.event.set()

    # -- 3. finish ------------------------------------------------------------------------------------
    def _finish(self) -> None:
        """Directories' metadata deepest first (their times survive), then the plan says finished."""
        with LocalTree(self.target or b"/") as tree:
            dirs = list(self._dirs)
            if self.target:
                dirs.insert(0, (b"", self.cat.get(ROOT_INO)))
            for path, node in reversed(dirs):
                try:
                    self._note(path, tree.apply_metadata(path, node, self.cat.xattrs(node.ino),
                                                         as_root=self._as_root))
                except OSError as exc:
                    self._note(path, [MetadataProblem("metadata", exc.strerror or str(exc))])
            syncfs_fd(tree.root_fd)
        if not self.failed and not self.skipped():
            self.plan.mark_finished()

    def skipped(self) -> list[str]:
        """Catalog entries not written because they are unsafe or malformed (as ``restore`` lists them)."""
        return [f"{name!r} in directory inode {parent}: {reason}"
                for (parent, name), reason in sorted(self.cat.rejected.items())]

    # -- asked for: the supervisor's requests -----------------------------------------------------------
    def need(self, path: bytes, whole: bool = True) -> Need:
        """Bring the entry at absolute ``path`` to the front; a :class:`Need` to wait on.

        ``whole``: a directory's entries too (a listing); without it a directory is in place already (every
        directory is made before the first file).  Symlinks of the snapshot on the way are followed (and
        their own entries brought too).  Answered at once with ``absent`` for a path the snapshot does not
        have, ``host`` for one this box keeps.
        """
        self._prepared.wait()
        if self._prepare_error is not None:
            return Need.now(f"failed {self._prepare_error}")
        rel = self._relative(path)
        if rel is None:
            return Need.now("absent")
        found = self._resolve(rel, whole)
        if isinstance(found, str):
            return Need.now(found)
        with self._lock:
            pending = {ino for ino in found if ino not in self._settled}
            failed = next((self._settled[i] for i in found if self._settled.get(i)), None)
            if failed is not None:
                return Need.now(f"failed {failed}")
            if not pending:
                return Need.now("ok")
            need = Need(pending)
            for ino in pending:
                self._waiters.setdefault(ino, []).append(need)
                self._urgent.append(ino)
        self._stream.bump(pending)
        return need

    def pending(self) -> tuple[list[tuple[bytes, bool]], int, bool]:
        """Every name not in place yet (or failed), whether it is a regular file, the position in the log of
        settled entries at that same instant (for :meth:`since`), and whether everything is in place.

        Taken under ``_lock``: an entry settled after it is in the log after that position, so a reader
        that starts from this and applies :meth:`since` never drops a name that is not in place.
        """
        self._prepared.wait()
        if self._prepare_error is not None:
            raise OgrefsError(self._prepare_error)
        with self._lock:
            inos = [ino for ino in self._size if self._settled.get(ino, "") is not None]
            seq = len(self._log)
        names = [(self._display(name), self._size[ino] >= 0) for ino in inos for name in self._names[ino]]
        return names, seq, not inos

    def since(self, seq: int) -> tuple[list[bytes], int, bool]:
        """The names settled in place after position ``seq`` of the log, the log's end, whether all is in place."""
        self._prepared.wait()
        with self._lock:
            inos = self._log[max(seq, 0):]
            end = len(self._log)
            complete = self.counts["files_done"] == self.counts["files_total"]
        return [self._display(name) for ino in inos for name in self._names[ino]], end, complete

    def _relative(self, path: bytes) -> bytes | None:
        path = os.path.normpath(path)
        if not self.target:
            return path if path.startswith(b"/") else None
        if path == self.target:
            return b""
        return path[len(self.target):] if path.startswith(self.target + b"/") else None

    def _resolve(self, rel: bytes, whole: bool) -> list[int] | str:
        """The non-directory inodes that must be in place for ``rel`` to be as the snapshot has it (a symlink's
        ``..`` goes up from the directory the link is in, as the kernel's walk does)."""
        parts = [p for p in rel.split(b"/") if p]
        root = self.cat.get(ROOT_INO)
        stack: list[tuple[Inode | None, bytes]] = [(root, b"")]  # the directories walked: ``..`` pops one
        links, out = 0, []
        while parts:
            part = parts.pop(0)
            node, here = stack[-1]
            if part in (b".", b".."):
                if part == b".." and len(stack) > 1:
                    stack.pop()
                continue
            child = self.cat.lookup(node.ino, part) if node is not None and node.is_dir else None
            path = here + b"/" + part
            if any(path == s or path.startswith(s + b"/") for s in self._skipped):
                return self._links_or(out, "host")
            if child is None:  # (after a link: the snapshot's links lead out of it, to this box's own file)
                return self._links_or(out, "absent")
            if child.is_lnk and links < _MAX_LINKS:
                links += 1
                out.append(child.ino)
                target = child.target or b""
                parts = [p for p in target.split(b"/") if p] + parts
                if target.startswith(b"/"):
                    stack = [(root, b"")]
                continue
            stack.append((child, path))
        node = stack[-1][0]
        if node is not None and node.is_dir:
            if whole:
                out.extend(c.ino for _n, c in self.cat.children(node.ino) if not c.is_dir)
        elif node is not None:
            out.append(node.ino)
        return [ino for ino in out if ino in self._size]

    def _links_or(self, links: list[int], answer: str) -> list[int] | str:
        """The snapshot's links a path went through, to wait for (``venv/bin/python -> python3.11 ->
        /usr/bin/python3.11``: the exec needs both links in place, the target is this box's), else ``answer``."""
        return [ino for ino in links if ino in self._size] or answer

    # -- what the status says ---------------------------------------------------------------------------
    def status(self) -> dict:
        """Counters for the status file (any thread)."""
        with self._lock:
            self.counts["fetched_bytes"] = self._stream.stats.fetched_bytes
            self.counts["written_bytes"] = self._stream.stats.written_bytes
            c = {k: (list(v) if isinstance(v, list) else v) for k, v in self.counts.items()}
            failed = len(self.failed)
            first = next(iter(self.failed.items()), None)
        classes = {name: {"bytes_total": c["bytes_total"][i], "bytes_done": c["bytes_done"][i]}
                   for i, name in enumerate(CLASSES)}
        return {"mode": "in-place", "classes": classes, "bytes_total": sum(c["bytes_total"]),
                "bytes_done": sum(c["bytes_done"]), "files_total": c["files_total"], "files_done": c["files_done"],
                "kept_files": c["kept_files"], "kept_bytes": c["kept_bytes"], "fetched_bytes": c["fetched_bytes"],
                "written_bytes": c["written_bytes"], "failed": failed, "skipped": self.skipped(),
                "first_failure": f"{os.fsdecode(first[0])}: {first[1]}" if first else None,
                "metadata_problems": len(self.metadata_problems), "working_left": self.working_left(),
                "workers": self.workers}

    def _display(self, rel: bytes) -> bytes:
        return (self.target + rel) if rel else (self.target or b"/")

    def _note(self, rel: bytes, problems: list[MetadataProblem]) -> None:
        if problems:
            with self._lock:
                self.metadata_problems[self._display(rel)] = "; ".join(f"{p.what} not set ({p.reason})"
                                                                       for p in problems)


def _names_in(tree: LocalTree, rel: bytes) -> set[bytes]:
    """The names in directory ``rel`` of the tree (none where it cannot be listed: its entries are then written,
    and say why they cannot be)."""
    try:
        return set(tree.names_in(rel))
    except OSError:
        return set()


def _identity(tree: LocalTree, rel: bytes) -> Identity:
    """What the name holds now (inode, change time, size), or None: changed by someone if this differs later."""
    try:
        return _identity_of(tree.lstat(rel))
    except OSError:
        return None


def _identity_of(st: os.stat_result | None) -> Identity:
    """:func:`_identity` of what an lstat found (None: nothing there)."""
    if st is None:
        return None
    return (st.st_ino, st.st_ctime_ns, st.st_size) if not stat.S_ISDIR(st.st_mode) else (st.st_ino, 0, 0)
