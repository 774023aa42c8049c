"""Durable writes into the local tree (worker-thread side): batches of chunks, metadata, the final flush.

A batch is ``pwrite`` into every target file, then ``fdatasync`` of each file
touched (one ``syncfs(2)`` when it touches many), and only then one plan
transaction records the batch's chunks done.  So a chunk recorded done is on
disk, and one written but not recorded (a crash, kill -9, a full disk in
between) is fetched and written again.  Files whose data is then all done get
their owner, mode, xattrs and times and are recorded complete.

Who owns what: a :class:`TreeWriter` is immutable (a catalog, the tree's root
fd, the plan, its :class:`Disk`) and only ever called in worker threads, one
at a time (the pipeline's writers take turns under a lock); it gets immutable
batches and returns new lists.  It never touches the loop's state.

Seams: the materializer makes its writer with a :data:`WriterFactory`
(:class:`TreeWriter` itself unless a caller passes another, e.g. a test's
writer that holds a batch back), and a writer does its durable I/O through a
:class:`Disk` (the real system calls unless one is passed that tears a write
or fails a flush, as :class:`~ogrefs.store.faults.FaultyStore` does for the
store).
"""

from __future__ import annotations

import logging
import os

from typing import Callable

from ogrefs.box.copyplan import TRACE, Item, Plan
from ogrefs.localtree import LocalTree, copy_identity, pwrite_all, syncfs_fd
from ogrefs.repo.catalog import Catalog

log = logging.getLogger(__name__)

#: A batch that touches more files than this is made durable with one syncfs(2) instead of an fdatasync
#: per file (20,000 files of 2-32 KiB from a local file repository: 5.2 s instead of 6.6 s).
_SYNCFS_ABOVE = 16
#: Chunks at least this large leave the page cache once durable (bulk data; small files stay cached).
_DROP_FROM_PAGE_CACHE = 256 * 1024
#: Files larger than this are recorded complete with their identity (``Plan.written``): FUSE passthrough
#: considers files over 1 MiB (lazy/fs/vfs.py, ``KERNEL_PAGES_MAX``) and trusts a copy so recorded and unchanged
#: without reading it back; smaller files would only cost a stat each.
RECORD_WRITTEN_ABOVE = 1024 * 1024



def syncfs(path: bytes) -> None:
    """Flush the file system holding ``path`` (the tree's entries were just created)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        syncfs_fd(fd)
    finally:
        os.close(fd)


class Disk:
    """The system calls a batch write makes durable with; stateless.  A seam: pass a subclass to fail them."""

    def pwrite(self, fd: int, data: bytes, offset: int) -> None:
        pwrite_all(fd, data, offset)

    def datasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def syncfs(self, fd: int) -> None:
        syncfs_fd(fd)


class TreeWriter:
    """Writes chunks and metadata into one local tree and records them in its plan; see the module docstring."""

    def __init__(self, catalog: Catalog, tree: LocalTree, plan: Plan, disk: Disk = Disk()) -> None:
        self.catalog = catalog
        self.tree = tree
        self.plan = plan
        self.disk = disk
        self._as_root = os.geteuid() == 0

    def apply_metadata(self, path: bytes, node) -> None:
        """An entry's final metadata, by fd; what cannot be set is logged, the rest applied."""
        problems = self.tree.apply_metadata(path, node, self.catalog.xattrs(node.ino), as_root=self._as_root)
        for p in problems:
            log.warning("materialization: %s of %s not set (%s)", p.what, os.fsdecode(path) or "/", p.reason)

    def complete_files(self, inos: list[int]) -> list[int]:
        """Apply the final metadata of files whose data is all done, then record them complete (a large one
        with its identity once its metadata is set: what the copy is while nobody changes it)."""
        done = []
        written: dict[int, str] = {}
        for ino in inos:
            path = self.plan.file_path(ino)
            node = self.catalog.get(ino)
            if path is None or node is None:
                continue
            self.apply_metadata(path, node)
            done.append(ino)
            if node.size > RECORD_WRITTEN_ABOVE:
                try:
                    identity = copy_identity(self.tree.lstat(path))
                except OSError:
                    identity = None  # (then an open names the copy before the kernel may serve it)
                if identity is not None:
                    written[ino] = identity
        self.plan.mark_complete(done, written)
        return done

    def write_batch(self, batch: list[tuple[Item, bytes]]) -> list[int]:
        """Write, fdatasync, then record done; returns the inodes that became complete."""
        fds: dict[int, int] = {}
        written: list[tuple[int, int, int]] = []  # (fd, offset, length)
        try:
            for item, data in batch:
                for ino, off, path in item.targets:
                    fd = fds.get(ino)
                    if fd is None:
                        fd = fds[ino] = self.tree.open(path, os.O_WRONLY)
                    self.disk.pwrite(fd, data, off)
                    if item.cls != TRACE:
                        written.append((fd, off, len(data)))
            if len(fds) > _SYNCFS_ABOVE:
                self.disk.syncfs(next(iter(fds.values())))  # many small files: one flush of the file system is cheaper
            else:
                for fd in fds.values():
                    self.disk.datasync(fd)
            # Durable now: the written pages leave the page cache.  The application that reads them
            # has them in the mount's own page cache already (adopted chunks) or reads them from disk
            # later, as after a reboot; a copy of the whole snapshot in the page cache would only
            # push out what the box is using (its training data) and, in a VM whose free memory is
            # handed back to the host, make every new page cost a fault in the host.
            # Not the trace's chunks: the trace is what the application reads next (its start-up,
            # bounded by the replay's memory), and dropping them sent those reads to the disk, where
            # on a busy box they queued behind another writer's fsyncs (issue 17).
            for fd, off, n in written:
                if n >= _DROP_FROM_PAGE_CACHE:
                    os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
        finally:
            for fd in fds.values():
                os.close(fd)
        return self.complete_files(self.plan.record_done(item for item, _ in batch))

    def finish(self, tree_root: bytes) -> None:
        """Directories get their metadata, deepest first, then everything is flushed and recorded finished."""
        for ino, path in self.plan.dirs_deepest_first():
            node = self.catalog.get(ino)
            if node is not None:
                self.apply_metadata(path, node)
        syncfs(tree_root)
        self.plan.mark_finished()


#: How the materializer's preparation makes the writer of a tree: (catalog, tree, plan) -> a TreeWriter.
#: :class:`TreeWriter` unless the Materializer is given another (a subclass that wraps :meth:`TreeWriter.write_batch`).
WriterFactory = Callable[[Catalog, LocalTree, Plan], TreeWriter]
