"""Read ahead of the walk where every file will be read: a tree the parent snapshot does not have.

The walk reads files one after the other on the main thread. Where they
are not in the page cache (a box's first snapshot, a new venv) small
files make that a chain of disk round trips, whatever the number of cores:
a cold first snapshot of a 25,530-file venv took 11.5–13.5 s on the 2-core
VM against 7.1 s warm, and a 69,000-file torch venv on a 16-core H200 box
went at 180 MiB/s. So where the walk enters a directory that its parent
snapshot does not have (all of it will be read, none reused), a read-ahead
thread walks the same tree in the same order just ahead of it, and asks
the kernel to read each small regular file (``posix_fadvise(WILLNEED)``:
asynchronous, several requests in flight at the device) before the main
thread gets there. Large files need nothing: the kernel's own readahead
follows a sequential read.

It only advises: it never reads file data, opens only what lstat just
showed a regular file (non-blocking, and advises it only if fstat of what
it opened agrees: no FIFO or device is ever waited on), never crosses
into another file system, and stays at most ``AHEAD_BYTES`` of file data
in front of the walk (``progress()``: the bytes of regular files the walk
has passed), so on a small box it does not evict what it advised before
the walk reads it. Where it falls behind (a warm cache) it advises nothing,
and once the walk is ``AHEAD_BYTES`` in front of it, it stops.

Where the walk will reuse what its parent snapshot has (a no-change
snapshot), it reads no file, but it still lists every directory and
lstat()s every entry, one at a time: with the box's metadata out of memory
(a box under memory pressure, a snapshot an hour later) that is a chain of
disk round trips too — 9.4 s against 2.5 s warm for 39,099 files. So
:meth:`ReadAhead.stat_tree` lists and lstat()s the tree ahead of the walk
with several threads at once (directories as tasks, any order), at most
``AHEAD_ENTRIES`` entries in front of it; the walk then finds the kernel's
caches warm. It reads and changes nothing but those caches.

Ownership: the main thread creates :class:`ReadAhead`, calls
:meth:`ReadAhead.entering` for each directory it walks and :meth:`close`
at the end; one walker thread at a time gets immutable inputs (the top
path, its device, the rule callables, which only read) and writes only its
own counters. The stat-ahead threads get the same kind of inputs; their
one shared counter (entries looked at) is guarded by its lock.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

log = logging.getLogger(__name__)

#: How long stopping a walker waits for its thread (each of its steps is one system call).
STOP_WAIT_S = 5.0
#: Files up to this size are advised (larger ones are read sequentially, which the kernel reads ahead).
SMALL_FILE = 2 * 1024 * 1024
#: How far, in bytes of regular files in walk order, the walker may run ahead of the walk.
AHEAD_BYTES = 64 * 1024 * 1024
#: How far, in entries, the stat-ahead may run in front of the walk, and with how many threads.
AHEAD_ENTRIES = 50_000
STAT_THREADS = 8
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class _Walker:
    """One subtree's read-ahead thread."""

    def __init__(self, top: bytes, dev: int, progress: Callable[[], int], skip: Callable[[bytes], bool]) -> None:
        self.top = top.rstrip(b"/") or b"/"
        self.advised = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(dev, progress, progress(), skip),
                                        name="ogrefs-readahead", daemon=True)
        self._thread.start()

    def covers(self, path: bytes) -> bool:
        """Below this walker's top (walked, being walked, or to be: a finished walker is done with it)."""
        return path == self.top or path.startswith(self.top.rstrip(b"/") + b"/")

    def stop(self) -> None:
        """Stop and wait for it, a little: a walker stuck in a hung network file system is left behind (daemon)."""
        self._stop.set()
        self._thread.join(STOP_WAIT_S)

    def _run(self, dev: int, progress: Callable[[], int], start: int, skip: Callable[[bytes], bool]) -> None:
        try:
            self._walk(dev, progress, start, skip)
        except Exception:  # noqa: BLE001 - advice only: the walk reads and reports on its own
            log.debug("read-ahead below %s stopped", os.fsdecode(self.top), exc_info=True)

    def _walk(self, dev: int, progress: Callable[[], int], start: int, skip: Callable[[bytes], bool]) -> None:
        pos = 0  # bytes of regular files passed, in the walk's order
        stack = [iter(self._listing(self.top))]
        while stack and not self._stop.is_set():
            path = next(stack[-1], None)
            if path is None:
                stack.pop()
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if st.st_dev == dev and not skip(path):
                    stack.append(iter(self._listing(path)))
            elif stat.S_ISREG(st.st_mode):
                while pos - (progress() - start) > AHEAD_BYTES and not self._stop.wait(0.005):
                    pass
                walked = progress() - start
                if walked - pos > AHEAD_BYTES:
                    return  # the walk is far ahead (the files were in memory): nothing left to help with
                if st.st_size and st.st_size <= SMALL_FILE and pos >= walked:
                    self._advise(path)
                pos += st.st_size

    @staticmethod
    def _listing(path: bytes) -> list[bytes]:
        try:
            names = sorted(os.listdir(path))
        except OSError:
            return []
        base = path.rstrip(b"/")
        return [base + b"/" + n for n in names]

    def _advise(self, path: bytes) -> None:
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError:
            return
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                self.advised += 1
        except OSError:
            pass
        finally:
            os.close(fd)


class _StatAhead:
    """Threads that list and lstat a tree ahead of the walk (directories as tasks), to warm the kernel's caches."""

    def __init__(self, top: bytes, dev: int, walked: Callable[[], int], skip: Callable[[bytes], bool]) -> None:
        self._dev, self._walked, self._skip = dev, walked, skip
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.seen = 0  # entries looked at (under _lock)
        self._pending = 0  # directories submitted and not done (under _lock)
        self.done = threading.Event()  # no directory left to look at (the whole tree, or stopped)
        self._pool = ThreadPoolExecutor(STAT_THREADS, thread_name_prefix="ogrefs-statahead")
        self._submit(top)

    def _submit(self, path: bytes) -> None:
        with self._lock:
            self._pending += 1
        try:
            self._pool.submit(self._dir, path)
        except RuntimeError:  # (closed meanwhile)
            self._task_done()

    def _task_done(self) -> None:
        with self._lock:
            self._pending -= 1
            if not self._pending:
                self.done.set()

    def _dir(self, path: bytes) -> None:
        try:
            while self.seen - self._walked() > AHEAD_ENTRIES:
                if self._stop.wait(0.01):
                    return
            base = path.rstrip(b"/")
            with os.scandir(path) as it:
                names = [e.name for e in it]
            with self._lock:  # (counted before its subdirectories are submitted: they wait on it)
                self.seen += len(names)
            for name in names:
                if self._stop.is_set():
                    return
                child = base + b"/" + name
                st = os.lstat(child)
                if stat.S_ISDIR(st.st_mode) and st.st_dev == self._dev and not self._skip(child):
                    self._submit(child)
        except OSError:  # advice only: the walk reads and reports on its own
            return
        finally:
            self._task_done()

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)


class ReadAhead:
    """Starts a walker where the walk enters a tree it will read whole; one at a time."""

    def __init__(self, progress: Callable[[], int], skip: Callable[[bytes], bool],
                 entries: Callable[[], int] = lambda: 0) -> None:
        self._progress = progress
        self._skip = skip
        self._entries = entries  # entries the walk has recorded (for the stat-ahead's lead)
        self._walker: _Walker | None = None
        self._stat: list[_StatAhead] = []
        self.advised = 0  # files advised, over the run (for tests and the curious)

    def stat_tree(self, top: bytes, dev: int) -> None:
        """List and lstat the tree below ``top`` (on ``dev``) ahead of a walk that will reuse its files."""
        self._stat.append(_StatAhead(top, dev, self._entries, self._skip))

    def entering(self, path: bytes, dev: int, all_read: bool) -> None:
        """The walk enters directory ``path`` on device ``dev``; ``all_read``: nothing below it is reused."""
        if self._walker is not None and self._walker.covers(path):
            return
        self._end_walker()
        if all_read:
            self._walker = _Walker(path, dev, self._progress, self._skip)

    def close(self) -> None:
        self._end_walker()
        for ahead in self._stat:
            ahead.stop()
        self._stat = []

    def _end_walker(self) -> None:
        if self._walker is not None:
            self._walker.stop()
            self.advised += self._walker.advised
            self._walker = None
