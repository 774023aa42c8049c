"""What this box already has: an entry in place that equals the snapshot's is kept, not fetched or rewritten.

A pod starts from an image, often the very template the snapshot's box was
made from, so most of ``/usr`` and a venv may already be there.  A regular
file is kept only when its bytes are the snapshot's, proven the way the
snapshot knows them: each extent read at its offset and hashed with the
repository's chunk id (BLAKE3, keyed in an encrypted repository), every gap
between extents (a hole in the snapshot) reading as zeros, the size equal.
Never by mtime or size alone.  A symlink is kept when it points where the
snapshot's does.  Then its metadata is made exactly the snapshot's on the
descriptor that was verified: owner, mode, xattrs (extra ones removed),
times.

Kept only where taking over the existing inode is as safe as making a new
one (:func:`may_adopt`): it has one link, and it belongs to root or already
to the snapshot's owner; a file of another user's is never chowned to
someone else, and a user's file never becomes setuid or gets capabilities
(the user could still write it through a descriptor opened before).  Anything
else is rewritten under a new inode, as ``restore`` does.

Thread-side: any thread may call these; each call opens and closes its own
descriptors and touches nothing shared.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import Callable

from ogrefs.localtree import LocalTree, MetadataProblem, apply_fd_metadata, split
from ogrefs.repo.catalog import Inode
from ogrefs.repo.catalog.schema import Extent

#: Bytes read at once when a gap must read as zeros.
_ZERO_STEP = 1 << 20
_CAPS = b"security.capability"

ChunkId = Callable[[bytes], bytes]


def may_adopt(st: os.stat_result, node: Inode, xattrs: list[tuple[bytes, bytes]]) -> bool:
    """Whether the existing inode ``st`` may become the snapshot's ``node`` in place (see the module docstring)."""
    if st.st_nlink != 1 or st.st_uid not in (0, node.uid):
        return False
    grants = node.mode & (stat.S_ISUID | stat.S_ISGID) or any(name == _CAPS for name, _v in xattrs)
    return st.st_uid == 0 or not grants


def _read_exact(fd: int, length: int, offset: int) -> bytes | None:
    parts, got = [], 0
    while got < length:
        piece = os.pread(fd, length - got, offset + got)
        if not piece:
            return None
        parts.append(piece)
        got += len(piece)
    return b"".join(parts)


def _zeros(fd: int, start: int, end: int) -> bool:
    """Whether bytes [start, end) of ``fd`` read as zeros (holes are skipped without reading them)."""
    pos = start
    while pos < end:
        try:
            pos = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return True  # nothing but hole up to the end of the file
            raise
        if pos >= end:
            return True
        step = min(_ZERO_STEP, end - pos)
        data = _read_exact(fd, step, pos)
        if data is None or data.count(0) != len(data):
            return False
        pos += step
    return True


def same_bytes(fd: int, node: Inode, extents: list[Extent], chunk_id: ChunkId) -> bool:
    """Whether open regular file ``fd`` holds exactly ``node``'s bytes: size, every chunk by its id, zeros between."""
    if os.fstat(fd).st_size != node.size:
        return False
    pos = 0
    for ext in extents:
        if ext.offset > pos and not _zeros(fd, pos, ext.offset):
            return False
        data = _read_exact(fd, ext.length, ext.offset)
        if data is None or chunk_id(data) != ext.chunk:
            return False
        pos = ext.end
    return pos >= node.size or _zeros(fd, pos, node.size)


def exact_xattrs(fd: int, xattrs: list[tuple[bytes, bytes]]) -> list[MetadataProblem]:
    """Remove the extended attributes ``fd`` has that the snapshot's entry has not (the rest are set after)."""
    wanted = {os.fsdecode(name) for name, _v in xattrs}
    problems = []
    try:
        names = os.listxattr(fd)
    except OSError:
        return []  # no xattrs on this file system: nothing to remove
    for name in names:
        if name in wanted:
            continue
        try:
            os.removexattr(fd, name)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.ENODATA):
                problems.append(MetadataProblem(f"xattr {name}", exc.strerror or str(exc)))
    return problems


def keep_file(tree: LocalTree, rel: bytes, node: Inode, extents: list[Extent], xattrs: list[tuple[bytes, bytes]],
              chunk_id: ChunkId, *, as_root: bool) -> list[MetadataProblem] | None:
    """Keep the regular file at ``rel`` if it is the snapshot's (its metadata made exact); None: it is not."""
    try:
        fd = tree.open(rel, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not may_adopt(st, node, xattrs):
            return None
        if not same_bytes(fd, node, extents, chunk_id):
            return None
        return exact_xattrs(fd, xattrs) + apply_fd_metadata(fd, node, xattrs, as_root=as_root)
    except OSError:
        return None
    finally:
        os.close(fd)


def keep_symlink(tree: LocalTree, rel: bytes, node: Inode, xattrs: list[tuple[bytes, bytes]], *,
                 as_root: bool) -> list[MetadataProblem] | None:
    """Keep the symlink at ``rel`` if it points where the snapshot's does (its metadata set); None: it does not."""
    with contextlib.suppress(OSError):
        st = tree.lstat(rel)
        if stat.S_ISLNK(st.st_mode) and st.st_nlink == 1 and node.nlink == 1:
            parent, name = split(rel)
            pfd = tree.open_dir(parent)
            try:
                same = os.readlink(name, dir_fd=pfd) == (node.target or b"")
            finally:
                os.close(pfd)
            if same:
                return tree.apply_metadata(rel, node, xattrs, as_root=as_root)
    return None
