"""The file system's shared vocabulary, a leaf: errors and their errno, attributes, counters, the protocols.

Every module of ``lazy/fs`` and the FUSE adapter name these; none of them
imports :mod:`.vfs` for a type (a type-only import is still a cycle).
Nothing here holds state that is shared: the counters of :class:`VfsStats`
belong to the vfs that owns them (the trio loop), the protocols are
implemented elsewhere (the recorder in ``lazy/trace``, the local copy in
``lazy/background``).
"""

from __future__ import annotations

import errno
import os
import sqlite3
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from ogrefs.errors import OgrefsError
from ogrefs.lazy.fetch.blobio import FetchError
from ogrefs.repo.catalog import Inode
from ogrefs.store.base import StoreError


class FsError(Exception):
    """A file-system answer that is an errno (ENOENT, EIO, ...)."""

    def __init__(self, err: int, detail: str = "") -> None:
        super().__init__(err, detail or os.strerror(err))
        self.errno = err


def errno_for(exc: BaseException) -> int:
    """The errno an adapter replies for ``exc``: the single exception-to-errno mapping."""
    if isinstance(exc, FsError):
        return exc.errno
    if isinstance(exc, (FetchError, StoreError, OgrefsError, sqlite3.Error)):
        return errno.EIO
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    return errno.EIO


class Attr(NamedTuple):
    """What stat() shows for an inode: the catalog row plus the blocks its data occupies."""

    node: Inode
    blocks: int  # 512-byte blocks of data; holes take none


class StatFs(NamedTuple):
    bsize: int
    blocks: int
    files: int
    namemax: int


@dataclass
class VfsStats:
    lookups: int = 0
    getattrs: int = 0
    dir_opens: int = 0  # opendir: one per listing (a snapshot's walk of the mount shows here)
    xattr_lists: int = 0  # listxattr
    opens: int = 0
    reads: int = 0
    bytes_read: int = 0  # bytes returned to applications (the kernel)
    read_errors: int = 0
    read_wait: float = 0.0  # seconds reads spent waiting for chunks (summed over concurrent reads)
    local_opens: int = 0  # opens served from the local copy (materialization)
    local_reads: int = 0
    local_named_whole: int = 0  # complete local copies named whole for the kernel to serve (localread.whole)
    local_written_whole: int = 0  # ... handed to the kernel unread: as their writer recorded them, unchanged since
    local_too_large_to_name: int = 0  # ... left to the daemon: not so recorded, and too large to name at an open
    local_corrupt: int = 0  # chunks of the local copy that failed verification (then read from the store)
    page_cache_pushed: int = 0  # files whose bytes were put into the kernel's page cache ahead of their reads
    open_pushed: int = 0  # small files put into the kernel's page cache from memory at their open (lazy/fs/openpush.py)


class AccessRecorder(Protocol):
    """What the vfs tells about reads (``ogrefs.lazy.trace.recorder.Recorder``): first touches of chunks."""

    active: bool

    def record(self, ino: int, offset: int, length: int = 0) -> None: ...


class LocalCopy(Protocol):
    """Where the local copy of a file is (``ogrefs.lazy.background.materialize.materializer.Materializer``).

    Which chunks of it are in place is the fetcher's residency's to say
    (:meth:`~ogrefs.lazy.fetch.residency.Residency.where`).
    """

    def local_path(self, ino: int) -> bytes | None:
        """The complete local copy of ``ino`` (data durable, metadata applied), or None."""
        ...

    def tree_path(self, ino: int) -> bytes | None:
        """The local copy of ``ino``, complete or not (the residency says which chunks are in it)."""
        ...

    def local_paths(self, inos: list[int]) -> dict[int, bytes]:
        """Blocking, thread-safe (worker threads): the complete local copies among ``inos``."""
        ...

    def written_identity(self, ino: int) -> str | None:
        """Blocking, thread-safe: what the complete copy of ``ino`` was when its writer, which wrote it from
        verified chunks, recorded it complete (:func:`ogrefs.localtree.copy_identity`); None if not recorded."""
        ...
