"""Eager restore: write a snapshot's tree to local disk, verified, in parallel.

The algorithm, in plain words:

1. Walk the catalog and create every selected entry: directories (owner-only
   at first, so nothing is exposed before its final mode is set), empty
   regular files truncated to their size (holes stay holes), symlinks, FIFOs,
   device nodes, and hardlinks to the first path of each inode.
2. List every extent of the selected files in *pack order* and cut the packs
   into ranges: neighbouring blobs are fetched with one ranged GET (up to
   ``MAX_RANGE`` bytes, bridging gaps of up to ``MAX_GAP``), several ranges in
   flight at once; many small files in one directory cost one request.
3. A worker thread fetches a range, decodes and BLAKE3-verifies each blob, and
   ``pwrite``s it into every file that references it.  A blob that fails
   verification is fetched once more on its own (a bit flipped or a response
   cut short on the way is not a bad pack); if it fails again it is never
   written, and its files are reported and removed.
4. Owners, modes (setuid after chown), xattrs and times are applied last,
   directories deepest first so their mtimes survive.

Nothing is written outside the target: the catalog reader skips entries whose
name is not a plain file name (``..``, ``a/b``, empty, NUL) and directories met
twice (see :class:`ogrefs.catalog.Catalog`); those are listed in
:attr:`Restorer.skipped`.  Data is written through ``O_NOFOLLOW``, so even a
symlink that appeared where a restored file was cannot redirect a write.

Threads: the main thread owns the plan; workers receive one immutable range
description each and write disjoint byte ranges of files; ``_lock`` guards
the counters and the failure list.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Callable

from . import codec
from .catalog import ROOT_INO, Catalog, Inode
from .errors import CorruptObject, OgrefsError, UsageError
from .store.base import StoreError

MAX_RANGE = 16 * 1024 * 1024
MAX_GAP = 1024 * 1024

ReadRange = Callable[[str, int, int], bytes]


@dataclass(frozen=True)
class _Blob:
    pack_offset: int
    stored_len: int
    raw_len: int
    chunk: bytes
    targets: tuple[tuple[int, int], ...]  # (ino, file offset)


@dataclass(frozen=True)
class _Range:
    pack: str
    offset: int
    length: int
    blobs: tuple[_Blob, ...]


@dataclass
class RestoreStats:
    files: int = 0
    dirs: int = 0
    others: int = 0
    total_bytes: int = 0
    written_bytes: int = 0
    fetched_bytes: int = 0
    requests: int = 0
    refetched: int = 0  # blobs fetched a second time after failing verification
    started: float = field(default_factory=time.monotonic)


def plan_ranges(blobs_by_pack: dict[str, list[_Blob]]) -> list[_Range]:
    """Coalesce each pack's blobs (sorted by offset) into ranged reads."""
    ranges = []
    for pack, blobs in blobs_by_pack.items():
        blobs.sort(key=lambda b: b.pack_offset)
        cur: list[_Blob] = []
        start = end = 0
        for b in blobs:
            if cur and (b.pack_offset - end > MAX_GAP or b.pack_offset + b.stored_len - start > MAX_RANGE):
                ranges.append(_Range(pack, start, end - start, tuple(cur)))
                cur = []
            if not cur:
                start = b.pack_offset
                end = b.pack_offset
            cur.append(b)
            end = max(end, b.pack_offset + b.stored_len)
        if cur:
            ranges.append(_Range(pack, start, end - start, tuple(cur)))
    return ranges


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset``: a full disk may accept part of a write and say so only by its count."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]
        offset += n


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


def make_dir(dest: bytes) -> None:
    """A directory at ``dest``, owner-only until its final mode is applied; whatever else is there is replaced."""
    try:
        os.mkdir(dest, 0o700)
    except FileExistsError:
        if not os.path.isdir(dest) or os.path.islink(dest):
            os.unlink(dest)
            os.mkdir(dest, 0o700)


def create_entry(dest: bytes, node: Inode, link_to: bytes | None = None) -> bool:
    """Create one non-directory entry at ``dest``: a hardlink to ``link_to`` when given, else an empty
    regular file of the node's size (all hole), a symlink, a FIFO or a device node, owner-only.

    An entry already at ``dest`` is replaced (a directory there is an error).  Returns False for a
    type that is not restored (a socket).  Owners, modes, xattrs and times come later, from
    :func:`apply_metadata`, once the data is in place.
    """
    mode = node.mode
    if os.path.lexists(dest):
        if os.path.isdir(dest) and not os.path.islink(dest):
            raise OgrefsError(f"{os.fsdecode(dest)}: a directory is in the way of a file")
        os.unlink(dest)
    if link_to is not None:
        os.link(link_to, dest, follow_symlinks=False)
        return True
    if stat.S_ISREG(mode):
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, node.size)
        finally:
            os.close(fd)
    elif stat.S_ISLNK(mode):
        os.symlink(node.target or b"", dest)
    elif stat.S_ISFIFO(mode):
        os.mkfifo(dest, 0o600)
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        os.mknod(dest, stat.S_IFMT(mode) | 0o600, node.rdev)
    else:
        return False
    return True


def apply_metadata(dest: bytes, node: Inode, xattrs: list[tuple[bytes, bytes]], *, as_root: bool) -> None:
    """Owner (as root), xattrs, mode and times of ``node`` onto ``dest``, in the order that keeps them all:
    chown first (it clears setuid bits and capabilities), chmod after the xattrs, times last."""
    link = stat.S_ISLNK(node.mode)
    if as_root:
        try:
            os.chown(dest, node.uid, node.gid, follow_symlinks=False)
        except OSError:
            pass
    for name, value in xattrs:
        try:
            os.setxattr(dest, name, value, follow_symlinks=False)
        except OSError as exc:
            if exc.errno not in (errno.ENOTSUP, errno.EPERM):
                raise
    if not link:
        os.chmod(dest, stat.S_IMODE(node.mode))
    os.utime(dest, ns=(node.atime_ns, node.mtime_ns), follow_symlinks=False)


class Restorer:
    def __init__(self, catalog: Catalog, read_range: ReadRange, target: bytes, *,
                 includes: list[bytes] | None = None, workers: int = 8,
                 progress: Callable[[RestoreStats], None] | None = None,
                 decode_blob: Callable[[bytes, int, bytes], bytes] = codec.decode_blob) -> None:
        self.cat = catalog
        self.read_range = read_range
        self.decode_blob = decode_blob
        self.target = os.path.abspath(target).rstrip(b"/")
        self.includes = [os.path.normpath(b"/" + i.lstrip(b"/")) for i in (includes or [])]
        self.workers = workers
        self.progress = progress
        self.stats = RestoreStats()
        self._lock = threading.Lock()
        self.failed: dict[bytes, str] = {}  # restored path -> reason
        self.skipped: list[str] = []  # catalog entries not restored because they are unsafe or malformed
        self._paths: dict[int, bytes] = {}  # ino -> first restored path, for data and hardlinks
        self._meta: list[tuple[bytes, Inode]] = []
        self._dirs: list[tuple[bytes, Inode]] = []
        self._is_root = os.geteuid() == 0
        self._last_tick = 0.0

    def _dest(self, path: bytes) -> bytes:
        return (self.target + path) if path else (self.target or b"/")

    def _tick(self, force: bool = False) -> None:
        if self.progress and (force or time.monotonic() - self._last_tick > 0.2):
            self._last_tick = time.monotonic()
            self.progress(self.stats)

    # -- step 1: the tree ---------------------------------------------------------
    def _make(self, dest: bytes, node: Inode) -> None:
        if stat.S_ISDIR(node.mode):
            make_dir(dest)
            self._dirs.append((dest, node))
            self.stats.dirs += 1
            return
        link_to = self._paths.get(node.ino) if node.nlink > 1 else None
        if not create_entry(dest, node, link_to) or link_to is not None:
            return
        if stat.S_ISREG(node.mode):
            self.stats.files += 1
            self.stats.total_bytes += node.size
        else:
            self.stats.others += 1
        self._paths[node.ino] = dest
        self._meta.append((dest, node))

    def _build_tree(self) -> set[int]:
        """Create entries; returns the inos of regular files whose data is needed."""
        os.makedirs(self.target or b"/", exist_ok=True)
        root = self.cat.get(ROOT_INO)
        if root is None:  # Catalog() refuses such a file; a defence for other readers
            raise CorruptObject("catalog has no root directory")
        if self.target:
            self._dirs.append((self.target, root))
        wanted: set[int] = set()
        for path, node in self.cat.walk():
            record, _ = _selected(path, self.includes)
            if not record:
                continue
            dest = self._dest(path)
            try:
                self._make(dest, node)
            except OSError as exc:
                raise OgrefsError(f"{os.fsdecode(dest)}: cannot create ({exc.strerror})") from None
            if node.is_reg and node.size:
                wanted.add(node.ino)
            self._tick()
        return wanted

    # -- step 2/3: the data ----------------------------------------------------------
    def _plan(self, wanted: set[int]) -> list[_Range]:
        by_chunk: dict[bytes, tuple[str, int, int, int, list[tuple[int, int]]]] = {}
        for ino, off, length, chunk, pack, poff, slen in self.cat.all_extents():
            if ino not in wanted:
                continue
            if pack is None:
                raise OgrefsError(f"catalog is damaged: a chunk of {os.fsdecode(self._paths[ino])} has no location")
            entry = by_chunk.get(chunk)
            if entry is None:
                entry = by_chunk[chunk] = (pack, poff, slen, length, [])
            entry[4].append((ino, off))
        by_pack: dict[str, list[_Blob]] = {}
        for chunk, (pack, poff, slen, raw_len, targets) in by_chunk.items():
            by_pack.setdefault(pack, []).append(_Blob(poff, slen, raw_len, chunk, tuple(targets)))
        return plan_ranges(by_pack)

    def _fail(self, inos: set[int], reason: str) -> None:
        with self._lock:
            for ino in inos:
                self.failed.setdefault(self._paths[ino], reason)

    def _fetch(self, rng: _Range) -> None:
        try:
            data = self.read_range(rng.pack, rng.offset, rng.length)
        except (StoreError, CorruptObject) as exc:
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
                path = self._paths[ino]
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                    try:
                        _pwrite_all(fd, plain, off)
                    finally:
                        os.close(fd)
                except OSError as exc:
                    self._fail({ino}, f"write failed: {exc.strerror}")
                    continue
                with self._lock:
                    self.stats.written_bytes += len(plain)

    def _refetch(self, pack: str, b: _Blob) -> bytes | None:
        """A blob that failed verification, fetched once more on its own; None (and its files failed) if bad again."""
        with self._lock:
            self.stats.refetched += 1
        try:
            data = self.read_range(pack, b.pack_offset, b.stored_len)
            return self.decode_blob(data, b.raw_len, b.chunk)
        except (StoreError, CorruptObject) as exc:
            self._fail({t[0] for t in b.targets}, f"pack {pack[:12]}: {exc}" if isinstance(exc, StoreError)
                       else str(exc))
            return None

    # -- step 4: metadata ----------------------------------------------------------
    def _apply_meta(self, dest: bytes, node: Inode) -> None:
        apply_metadata(dest, node, self.cat.xattrs(node.ino), as_root=self._is_root)

    def run(self) -> RestoreStats:
        if self.includes:
            for inc in self.includes:
                if self.cat.resolve(inc) is None:
                    raise UsageError(f"{os.fsdecode(inc)} is not in this snapshot")
        wanted = self._build_tree()
        ranges = self._plan(wanted)
        with ThreadPoolExecutor(self.workers, thread_name_prefix="ogrefs-restore") as pool:
            futures = [pool.submit(self._fetch, r) for r in ranges]
            for fut in as_completed(futures):
                fut.result()
                self._tick()
        for path in sorted(self.failed):
            try:
                os.unlink(path)  # never leave a file that looks restored but holds wrong bytes
            except OSError:
                pass
        failed = set(self.failed)
        for dest, node in self._meta:
            if dest not in failed:
                self._apply_meta(dest, node)
        for dest, node in reversed(self._dirs):
            self._apply_meta(dest, node)
        self.skipped = [f"{name!r} in directory inode {parent}: {reason}"
                        for (parent, name), reason in sorted(self.cat.rejected.items())]
        self._tick(force=True)
        return self.stats
