"""The in-place copy's data path: one :class:`~ogrefs.restore.Restorer` over the whole copy, fed a group at a time.

Why not a Restorer per batch (as before): each batch planned, fetched, synced and renamed its files before the
next one started, so the link idled while a batch wrote its tail and its ``syncfs`` ran, and ranges were
coalesced only within a batch (more, smaller GETs).  Issue 48's bench measured the whole box at 1.39-2.14x a
plain ``ogrefs restore``.  Here, in plain words:

1. The engine's thread adds groups of entries (:meth:`Stream.add`) as fast as it checks what the box has.  A
   group's blobs join pending sets, one per priority class and pack: asked-for (urgent), the trace's, the
   hints', the rest.  A file's temporary file is made by the worker that writes its first blob (making
   22,000 of them took this thread 11 s on the bench's VM: the next groups' blobs waited behind it), one with
   nothing to fetch at once.
2. A worker cuts a range only when it takes one: the first pack of the highest class that has blobs, from
   its lowest offset, bridging gaps up to ``MAX_GAP`` and up to ``MAX_RANGE`` bytes (restore's rule).  So the
   blobs of every group of a class added by then are coalesced together: on a fresh box the engine adds the
   rest long before the workers reach it, and the rest is one plan, as in ``ogrefs restore``.
   :data:`URGENT_WORKERS` more workers take only asked-for ranges, so a path a job waits on starts at once
   even while every other worker is inside a 16 MiB range of the rest.
3. :meth:`Stream.bump` (a ``need``) moves the blobs not yet taken of the files asked for to the asked-for class;
   a file asked for later in a group still to come goes there when it is added.
4. A file asked for takes its name after its own ``fdatasync``, in the thread that finds it complete: the
   worker that completes it, or the asker's (:meth:`Stream.bump`), also while the placer syncs the round that
   holds it (a ``syncfs`` while the rest is being written waits for every dirty page of the file system:
   0.1-0.4 s a round on the bench's VM, paid by every wait of a job).  The placer thread puts the other complete
   files in place every :data:`PLACE_EVERY` seconds: one ``syncfs`` (every file of the round durable before any
   takes its name),
   then each file under its names unless someone on the box changed a name meanwhile (theirs stays), files
   asked for first; symlinks, FIFOs and device nodes are made there too, by the same class rule (nothing to
   fetch or sync).  The files of one round are reported durable (``on_durable``: the plan records them
   complete) after the next round's ``syncfs``, when their renames are durable too.
5. Once the working set is in place (:meth:`Stream.to_background`), the workers other than the urgent ones lower
   their own priority for good and leave asked-for ranges to the urgent ones: a job started on the working set
   gets the cores before the rest of the copy.
6. :meth:`Stream.close`: no more groups; once every range is fetched, the last round, a last ``syncfs``, and
   the Restorer's end (a file not in place is failed and its temporary file removed).

A complete file waits for its round open, its metadata set on the descriptor (once chowned, its temporary name
can no longer be proven ours), up to half of restore's budget of open files; past that it waits closed, still
root's, and its round reopens it (proven ours) and sets its metadata before its ``syncfs``, taking a bounded
number a round.  Held open without a bound, 2,883 files of a venv-shaped box's copy failed with "Too many open
files" under a 20,000 limit.  Everything else is the Restorer's: temporary names, every blob verified, the
rename.  A kill -9 leaves real names holding what was there before or a verified, durable file.  A chunk two
groups share is fetched once per group (within a group, once).

Threads: the engine's thread calls :meth:`start`, :meth:`add` and :meth:`close` and alone makes the
Restorer's file records there; workers fetch, make temporary files and write (the Restorer's); the files
asked for are placed by the worker that completes them or the thread that asks; the placer places the others;
any thread may :meth:`bump`.  ``_cond`` guards the pending sets (``_queue``, ``_where``,
``_queued_of``, ``_bytes``), ``_inflight``, ``_left``, ``_feeding``, ``_urgent_inos``, ``_unsynced`` and
``_sealed``; ``_background`` is set once by any thread and only read by the workers, each of which changes only
its own priority; the Restorer's ``_lock`` guards ``_ready``, ``_ready_open``, ``_placing``,
``_placing_closed``, ``_reopening`` and ``_specials_ready`` (taken by the placer; a file asked for taken out of
``_ready``, ``_placing`` or ``_placing_closed`` by the thread that places it, which waits on ``_reopened``
while the placer reopens that very file) and what it guarded before.  ``_cls_of`` is written by the engine's
thread before a file's blobs are queued.  ``_cond`` is never taken while holding ``_lock``, nor the reverse.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Iterable

from ogrefs.localtree import LocalTree, PathConflict, syncfs_fd
from ogrefs.repo.catalog import Catalog, Inode
from ogrefs import restore
from ogrefs.restore import Batch, Blob, PendingFile, Range, ReadRange, Restorer, first_range, reason_of, token_for

log = logging.getLogger(__name__)

#: Priority classes, highest first: asked for, the trace's, the hints', the rest.
URGENT, CLASSES = 0, 4
#: Complete files are put in place at least this often (one ``syncfs`` each round).
PLACE_EVERY = 0.2
#: The placer checks the names of this many files at once before renaming them (one resolution of a directory
#: for its names among them, not one a name), few enough that a name's check comes at most 64 renames (a few
#: milliseconds) before its own rename.
CHECK_EVERY = 64
#: Workers that take only asked-for ranges, beside the others.
URGENT_WORKERS = 2
#: Once the working set is in place the other workers run this much lower (the lazy mount's background jobs
#: do the same, lazy/fetch/threadnice.py): at +10 the kernel gives a thread about a tenth of what a nice-0
#: thread gets while both want a core, so a job started on the working set (``ogrefs run``) gets the cores
#: before the rest of the copy, which still takes all the time nobody else wants.
BACKGROUND_NICE = 10


class Stream(Restorer):
    """See the module docstring.  ``batch`` gives ``extents``, ``may_replace`` and ``done``;
    ``on_failed(ino, why)`` once a file or entry failed; ``on_durable(inos)`` once placed files (and those
    :meth:`durable_later` names) are durable under their names."""

    def __init__(self, catalog: Catalog, read_range: ReadRange, target: bytes, *, batch: Batch,
                 on_failed: Callable[[int, str], None], on_durable: Callable[[list[int]], None],
                 decode_blob: Callable[[bytes, int, bytes], bytes], workers: int,
                 stop_event: threading.Event) -> None:
        super().__init__(catalog, read_range, target, decode_blob=decode_blob, workers=workers, check_space=False,
                         stop_event=stop_event, batch=batch)
        self._on_failed = on_failed
        self._on_durable = on_durable
        self._pending: dict[int, int] = {}
        self._malformed: dict[int, str] = {}
        self._cond = threading.Condition()
        self._queue: list[dict[str, set[Blob]]] = [{} for _ in range(CLASSES)]  # class -> pack -> blobs
        self._where: dict[Blob, tuple[int, str]] = {}  # a pending blob -> (class, pack)
        self._bytes: dict[tuple[int, str], int] = {}  # (class, pack) -> its pending blobs' stored bytes
        self._queued_of: dict[int, list[Blob]] = {}  # ino -> blobs that were pending for it (some taken since)
        self._urgent_inos: set[int] = set()
        self._unsynced: list[int] = []  # placed or kept since the last syncfs
        self._inflight = [0] * CLASSES  # ranges being fetched, by class
        self._cls_of: dict[int, int] = {}  # a file added -> its class
        self._left = [0] * CLASSES  # files added and not yet placed or failed, by class
        self._sealed = False  # no more groups
        self._feeding = URGENT  # the class being added (the engine adds them in order): those above are whole
        self._specials_ready: list[tuple[int, int, list[tuple[bytes, Inode]]]] = []  # (class, ino, names): _lock
        self._placing: list = []  # the placer's round being synced: _lock (an asker may take its file out)
        self._placing_closed: list = []  # the round's files still to reopen: _lock (the same)
        self._reopening = -1  # the ino the placer is reopening (out of both lists meanwhile): _lock
        self._reopened = threading.Condition(self._lock)  # notified when _reopening is done with
        #: complete files waiting for their names: (file, its fd with the metadata set, the metadata's problems),
        #: or (file, -1, []) past ``_ready_open_max`` (closed; reopened, proven ours, and its metadata set by
        #: :meth:`_opened`); every fd closed by :meth:`_release` (_lock)
        self._ready: list[tuple[PendingFile, int, list]] = []
        self._ready_open = 0  # fds of complete files waiting for their names (_lock)
        #: the most :meth:`_complete` keeps open (held open, 2,883 files of a venv-shaped box's copy failed with
        #: "Too many open files" under a 20,000 limit while the placer's rounds fell behind)
        self._ready_open_max = max(16, restore.fds_to_keep() // 2)
        self._place_now = threading.Event()
        self._drained = threading.Event()  # every worker ended: only placement is left
        self._threads: list[threading.Thread] = []
        self._placer: threading.Thread | None = None
        self._error: BaseException | None = None
        self._background = False  # the working set is in place: set once, read by the workers

    # -- the engine's thread ------------------------------------------------------------------------
    def start(self, paths: list[tuple[bytes, None]], tmp_like: frozenset[bytes]) -> None:
        """Open the tree, pick the temporary names' token (in no path of ``paths``), start the threads."""
        self.tree = LocalTree(self.target or b"/")
        self._token = token_for(paths)
        self._paths = tmp_like
        for i in range(self.workers + URGENT_WORKERS):
            urgent_only = i >= self.workers
            t = threading.Thread(target=self._guard, args=(self._work, urgent_only), daemon=True,
                                 name=f"ogrefs-inplace-{'urgent' if urgent_only else 'fetch'}-{i}")
            t.start()
            self._threads.append(t)
        self._placer = threading.Thread(target=self._guard, args=(self._place_loop,), daemon=True,
                                        name="ogrefs-inplace-place")
        self._placer.start()

    def add(self, entries: list[tuple[bytes, Inode]], cls: int) -> None:
        """Non-directory entries (their directories exist) into the copy, their blobs pending in class ``cls``
        (a file asked for: the asked-for class).  Every name of a file comes in the same group."""
        self._malformed = {}
        by_pack, _needed = self._blobs({n.ino for _p, n in entries if n.is_reg and n.size})
        files: list[PendingFile] = []
        specials: dict[int, list[tuple[bytes, Inode]]] = {}  # made by the placer, in class order like files
        for path, node in entries:
            if not node.is_reg:
                specials.setdefault(node.ino, []).append((path, node))
                continue
            new = node.ino not in self._files
            try:
                self._make(path, node)
            except (OSError, PathConflict) as exc:
                self.failed[self.display(path)] = f"cannot create ({reason_of(exc)})"
            if new and node.ino in self._files:
                files.append(self._files[node.ino])
                self._cls_of[node.ino] = cls
        with self._cond:
            self._feeding = max(self._feeding, cls)
            self._left[cls] += len(files)
            for pack, blobs in by_pack.items():
                for b in blobs:
                    urgent = any(ino in self._urgent_inos for ino, _off in b.targets)
                    self._enqueue(b, URGENT if urgent else cls, pack)
            self._cond.notify_all()
        for ino, why in self._malformed.items():
            self._fail({ino}, why)
        with self._lock:
            self._specials_ready.extend((cls, ino, named) for ino, named in specials.items())
        for f in files:  # one with nothing to fetch is complete now; the others are made by their first write
            if self._stop.is_set():
                return
            if not self._pending.get(f.node.ino) and self._created(f) and not f.failed:
                self._complete(f)

    def durable_later(self, inos: list[int]) -> None:
        """Files kept as they were: reported durable with the next round's."""
        with self._cond:
            self._unsynced.extend(inos)

    def seal(self) -> None:
        """No more groups: the workers end once nothing is pending."""
        with self._cond:
            self._sealed = True
            self._cond.notify_all()

    def drained(self) -> bool:
        """Every worker ended (sealed and nothing pending, or stopped): only placement is left."""
        return not any(t.is_alive() for t in self._threads)

    def close(self) -> None:
        """Wait for every range and the last placement, then the Restorer's end; re-raises a thread's error."""
        self.seal()
        for t in self._threads:
            t.join()
        self._drained.set()
        self._place_now.set()
        if self._placer is not None:
            self._placer.join()
        self._finish()
        if self._error is not None:
            raise self._error

    # -- any thread -----------------------------------------------------------------------------------
    def bump(self, inos: Iterable[int]) -> None:
        """Files asked for: their blobs not yet taken go first; one complete already is placed at once."""
        inos = set(inos)
        with self._cond:
            self._urgent_inos |= inos
            for ino in inos:
                for b in self._queued_of.pop(ino, ()):
                    where = self._where.get(b)
                    if where is not None and where[0] != URGENT:
                        self._dequeue(b)
                        self._enqueue(b, URGENT, where[1])
            self._cond.notify_all()
        self._place_asked(inos)
        with self._lock:
            ready = any(ino in inos for _c, ino, _n in self._specials_ready)
        if ready:
            self._place_now.set()

    # -- the pending sets (under _cond) ----------------------------------------------------------------
    def _enqueue(self, b: Blob, cls: int, pack: str) -> None:
        self._queue[cls].setdefault(pack, set()).add(b)
        self._where[b] = (cls, pack)
        self._bytes[cls, pack] = self._bytes.get((cls, pack), 0) + b.stored_len
        for ino, _off in b.targets:
            self._queued_of.setdefault(ino, []).append(b)

    def _dequeue(self, b: Blob) -> None:
        cls, pack = self._where.pop(b)
        blobs = self._queue[cls][pack]
        blobs.discard(b)
        self._bytes[cls, pack] -= b.stored_len
        if not blobs:
            del self._queue[cls][pack]
            del self._bytes[cls, pack]

    def _take(self, urgent_only: bool, skip_urgent: bool = False) -> tuple[int, Range] | None:
        """The next range and its class, from the highest class with blobs (see :func:`_cut`).  None while a
        range of a class above that one (the asked-for class apart) is in flight: the working set's last ranges
        have the link to themselves (a drain at each class's end, two at most, instead of one a batch).  None
        too while the class is still being added and every pack's blobs so far would make a short range: the
        next group may extend it (a range is cut whole, or when nothing more can come).  ``skip_urgent``: a niced
        worker's, which leaves asked-for ranges to the urgent workers (a job waits on them)."""
        for cls in range(URGENT + 1 if urgent_only else CLASSES):
            packs = self._queue[cls]
            if not packs or (skip_urgent and cls == URGENT):
                continue
            if any(self._inflight[URGENT + 1:max(cls, URGENT + 1)]):
                return None
            growing = cls != URGENT and not self._sealed and cls >= self._feeding
            for pack in packs:
                if growing and self._bytes[cls, pack] < restore.MAX_RANGE:  # (restore's, looked up: one bound)
                    continue  # (a short range at most, so far)
                blobs, rng = _cut(pack, packs[pack])
                if not growing or len(blobs) < len(packs[pack]):
                    for b in blobs:
                        self._dequeue(b)
                    self._inflight[cls] += 1
                    return cls, rng
            return None
        return None

    # -- the workers and the placer ---------------------------------------------------------------------
    def _guard(self, body: Callable[..., None], *args: object) -> None:
        """A thread's body; an unexpected error is kept for :meth:`close` and ends the copy."""
        try:
            body(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised by close()
            self._error = self._error or exc
            self._stop.set()
            with self._cond:
                self._cond.notify_all()

    def to_background(self) -> None:
        """The working set is in place (any thread): from their next range on, the workers that are not the
        urgent ones lower their own priority by :data:`BACKGROUND_NICE`, for good (raising it back would need
        CAP_SYS_NICE), and leave asked-for ranges to the urgent workers, which keep theirs."""
        self._background = True

    def _work(self, urgent_only: bool) -> None:
        niced = False
        while True:
            if self._background and not urgent_only and not niced:
                niced = True
                _lower_own_priority(BACKGROUND_NICE)
            with self._cond:
                while True:
                    if self._stop.is_set() or (self._sealed and not any(self._queue)):
                        return
                    taken = self._take(urgent_only, skip_urgent=niced)
                    if taken is not None:
                        break
                    self._cond.wait()
            try:
                self._fetch(taken[1])
            finally:
                with self._cond:
                    self._inflight[taken[0]] -= 1
                    self._cond.notify_all()

    def _complete(self, f: PendingFile) -> None:
        """All data of ``f`` is written and verified: it waits for the placer in ``_ready``, open with its metadata
        set, or closed past ``_ready_open_max``; one asked for takes its name here (:meth:`_place_asked`)."""
        fd = self._open_tmp(f)
        if fd is None:
            return
        with self._lock:
            hold = self._ready_open < self._ready_open_max
            self._ready_open += hold
        if hold:  # (held open: once chowned, the name can no longer be proven ours)
            item = self._with_metadata(f, fd)
        else:  # closed while still root's and unchowned: reopened by name, proven ours, at its round
            os.close(fd)
            item = (f, -1, [])
        if item is not None:
            with self._lock:
                self._ready.append(item)
        with self._cond:
            asked = f.node.ino in self._urgent_inos
        if asked:  # (asked for before or while it was completed: bump looks after adding, this after appending)
            self._place_asked({f.node.ino})

    def _place_asked(self, inos: set[int]) -> None:
        """The complete files of ``inos`` still waiting for the placer (in ``_ready``, or in the round it is
        syncing), each made durable by its own ``fdatasync`` and put in place in this thread: a ``syncfs`` while
        the rest is written waits for every dirty page of the file system (0.1-0.4 s a round on the bench's VM),
        and every wait of a job would pay one.  Whoever takes a file out of those lists places it."""
        with self._lock:
            while self._reopening in inos:  # (back in _placing in a moment, or failed)
                self._reopened.wait()
            mine = [item for item in self._ready + self._placing + self._placing_closed if item[0].node.ino in inos]
            if not mine:
                return
            self._ready = [item for item in self._ready if item[0].node.ino not in inos]
            self._placing = [item for item in self._placing if item[0].node.ino not in inos]
            self._placing_closed = [item for item in self._placing_closed if item[0].node.ino not in inos]
        durable = []
        for f, fd, problems in self._opened(mine):
            try:
                os.fdatasync(fd)
            except OSError as exc:
                self._release(fd)
                self._fail({f.node.ino}, f"cannot be made durable ({reason_of(exc)})")
                continue
            durable.append((f, fd, problems))
        self._place_all(durable)

    def _with_metadata(self, f: PendingFile, fd: int) -> tuple[PendingFile, int, list] | None:
        """A complete file open as ``fd`` (counted in ``_ready_open``) with its metadata set; None (``fd``
        released, ``f`` failed) when it cannot be."""
        try:
            return f, fd, self._set_metadata(f, fd)
        except OSError as exc:
            self._release(fd)
            self._fail({f.node.ino}, f"cannot be put in place ({reason_of(exc)})")
            return None

    def _opened(self, items: list[tuple[PendingFile, int, list]]) -> list[tuple[PendingFile, int, list]]:
        """``items`` of ``_ready``, those that waited closed reopened (still ours) with their metadata set now;
        one that cannot be is failed and left out."""
        out = []
        for f, fd, problems in items:
            if fd < 0:
                fd = self._open_tmp(f)
                if fd is None:
                    continue
                with self._lock:
                    self._ready_open += 1
                item = self._with_metadata(f, fd)
                if item is None:
                    continue
                problems = item[2]
            out.append((f, fd, problems))
        return out

    def _release(self, fd: int) -> None:
        """A waiting complete file's fd closed."""
        os.close(fd)
        with self._lock:
            self._ready_open -= 1

    def _finish(self) -> None:
        """The Restorer's end, the fds of files that never took their names closed first (a stopped copy)."""
        with self._lock:
            left, self._ready = self._ready, []
        for _f, fd, _problems in left:
            if fd >= 0:
                self._release(fd)
        super()._finish()

    def _fail(self, inos: Iterable[int], reason: str) -> None:
        inos = set(inos)
        with self._lock:
            fresh = [i for i in inos if (f := self._files.get(i)) is not None and not f.failed and not f.done]
        super()._fail(inos, reason)
        with self._cond:
            for ino in fresh:
                self._left[self._cls_of[ino]] -= 1
        for ino in fresh:
            self._on_failed(ino, reason)

    def _place_loop(self) -> None:
        while True:
            self._place_now.wait(PLACE_EVERY)
            self._place_now.clear()
            last = self._drained.is_set()  # (read before the round: every worker's file is ready by then)
            if self._place_round(last):
                self._place_now.set()  # (files left waiting closed: the next round at once)
            elif last:
                return

    def _place_round(self, last: bool) -> bool:
        """One round: syncfs, the files placed before it durable, then the files that may take their names.
        A file waits while a file of a class above its own is not placed (one asked for never waits); the last
        round goes on, a syncfs between classes, until every file is placed.  Of the files that may take their
        names and wait closed (see ``_ready``) a round takes a bounded number, reopened before its syncfs;
        True when it left some (then the next round comes at once: it has files to place)."""
        assert self.tree is not None
        with self._lock:
            group, self._ready = self._ready, []
            specials, self._specials_ready = self._specials_ready, []
        later: list = []
        while True:
            with self._cond:
                unsynced, self._unsynced = self._unsynced, []
                urgent = set(self._urgent_inos)
                left = list(self._left)
            now, held = _placeable(group, lambda f: (f[0].node.ino, self._cls_of[f[0].node.ino]), urgent, left)
            links, specials = _placeable(specials, lambda item: (item[1], item[0]), urgent, left)
            if last and not now and not links:  # (stopped: a file above them never came)
                now, held, links, specials = held, [], specials, []
            now, later = _bounded(now, self._ready_open_max)
            with self._lock:  # (the others wait in _ready meanwhile: an asker can take its file out and place it)
                self._ready[:0] = held + later
            if not now and not unsynced and not links:
                break
            self._make_specials(links)
            with self._lock:  # until the syncfs ends a file asked for can still be taken and placed by its asker
                self._placing = [item for item in now if item[1] >= 0]
                self._placing_closed = [item for item in now if item[1] < 0]
            self._reopen_closed()
            if now or unsynced:
                syncfs_fd(self.tree.root_fd)
            with self._lock:
                now, self._placing = self._placing, []
            if unsynced:
                self._on_durable(unsynced)
            self._place_all(sorted(now, key=lambda item: (item[0].node.ino not in urgent,
                                                          self._cls_of[item[0].node.ino])))
            if not last:
                break
            with self._lock:
                group, self._ready = self._ready, []
        with self._lock:
            self._specials_ready[:0] = specials
        return bool(later) and not last

    def _reopen_closed(self) -> None:
        """The round's files that waited closed, reopened (proven ours) with their metadata set, one at a time,
        from ``_placing_closed`` into ``_placing``.  The one being reopened is in neither list: ``_reopening``
        names it, and an asker for it waits the moment it takes (:meth:`_place_asked`), not for the round."""
        while True:
            with self._lock:
                if not self._placing_closed:
                    return
                item = self._placing_closed.pop()
                self._reopening = item[0].node.ino
            opened: list = []
            try:
                opened = self._opened([item])
            finally:
                with self._lock:
                    self._placing.extend(opened)
                    self._reopening = -1
                    self._reopened.notify_all()

    def _make_specials(self, items: list[tuple[int, int, list[tuple[bytes, Inode]]]]) -> None:
        """Symlinks, FIFOs and device nodes under their names (made there at once: nothing to verify)."""
        for _cls, ino, named in items:
            for path, node in named:
                try:
                    self._make(path, node)
                except (OSError, PathConflict) as exc:
                    self.failed[self.display(path)] = f"cannot create ({reason_of(exc)})"
            why = next((self.failed[n] for n in (self.display(p) for p, _n in named) if n in self.failed), None)
            if why is not None:
                self._on_failed(ino, why)
            else:
                self.batch.done(ino)

    def _place_all(self, group: list[tuple[PendingFile, int, list]]) -> None:
        """Each durable file under its names unless someone on the box changed one meanwhile (theirs stays, and
        the file fails); its fd closed.  The placed ones wait for the next syncfs to be durable under them."""
        assert self.batch is not None
        placed = []
        whys: dict[bytes, str | None] = {}
        for i, (f, fd, problems) in enumerate(group):
            if i % CHECK_EVERY == 0:  # the next files' names checked together: one resolution a directory
                names = [name for g, _fd, _p in group[i:i + CHECK_EVERY] for name in g.names]
                whys = dict(zip(names, self.batch.may_replace(names)))
            try:
                why = next((w for w in map(whys.get, f.names) if w is not None), None)
                if why is not None:
                    self._fail({f.node.ino}, why)
                else:
                    self._place(f, fd, problems)
            finally:
                self._release(fd)
            if f.done:
                placed.append(f.node.ino)
        with self._cond:
            for ino in placed:
                self._left[self._cls_of[ino]] -= 1
            self._unsynced.extend(placed)


def _lower_own_priority(by: int) -> None:
    """This thread's nice value raised by ``by`` (Linux gives each thread its own); never fails the copy."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except OSError as exc:  # (a seccomp profile that refuses setpriority: the copy goes on as before)
        log.debug("the in-place copy's worker %d keeps its priority: %s", tid, exc)


def _bounded(items: list, closed_max: int) -> tuple[list, list]:
    """``items`` (files that may take their names) split into this round's (every one open, at most
    ``closed_max`` of those waiting closed) and the next round's, each in their order."""
    now, later = [], []
    closed = 0
    for item in items:
        if item[1] < 0:
            closed += 1
            if closed > closed_max:
                later.append(item)
                continue
        now.append(item)
    return now, later


def _cut(pack: str, pending: set[Blob]) -> tuple[tuple[Blob, ...], Range]:
    """The first range of a pack's pending blobs (restore's rule, from the lowest offset); its blobs."""
    rng = first_range(pack, sorted(pending, key=lambda b: b.pack_offset))
    return rng.blobs, rng


def _placeable(items: list, ino_cls: Callable, urgent: set[int], left: list[int]) -> tuple[list, list]:
    """``items`` split into those that may take their names now and those held (``ino_cls(item)``: its inode
    and class): an entry of class ``c`` waits while a file of a class above ``c`` is not placed (``left``), so
    the trace's files are in place, and durable, a round before the rest's; an entry asked for never waits."""
    now, held = [], []
    for item in items:
        ino, cls = ino_cls(item)
        free = ino in urgent or cls == URGENT or not any(left[URGENT + 1:cls])
        (now if free else held).append(item)
    return now, held


def all_paths(names: Iterable[list[bytes]], dirs: Iterable[bytes]) -> list[tuple[bytes, None]]:
    """Every path of the copy, as :meth:`Stream.start` takes them."""
    return [(p, None) for ps in names for p in ps] + [(p, None) for p in dirs]

