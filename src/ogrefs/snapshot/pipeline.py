"""Take a snapshot: walk the tree, chunk, dedup, pack, upload, write the catalog.

The pipeline (docs/architecture.md has the picture):

1. The *main thread* walks the tree in sorted order, stats every entry, decides
   whether a file is unchanged since the parent snapshot, reads changed files
   and cuts them into chunks.  It alone owns the CatalogWriter, the
   PackBuilder, the local chunk index's write side and the ``_pending`` queue.
2. *Hash workers* (a thread pool) get one immutable ``bytes`` chunk each: they
   hash it, ask :meth:`Snapshotter._claim` whether this run must store it (the
   claim set is guarded by ``_claim_lock``) and compress it if so.
3. The main thread consumes results strictly in submission order, so blobs
   land in packs in walk order (files of one directory stay together), and
   seals a pack when it reaches the target size.
4. *Upload workers* put a sealed pack and its per-pack index object; the main
   thread then records the pack in the local index.

Nothing is visible as a snapshot until the manifest is written, last, after
every pack, index and the catalog are in the store.  An interrupted run leaves
packs with their index objects, which the next run finds and reuses.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import secrets
import socket
import sqlite3
import stat
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from ogrefs.repo.catalog import FLAG_CHANGED, ROOT_INO, Catalog, CatalogWriter, Inode
from ogrefs.snapshot.chunker import Chunker, data_extents
from ogrefs.errors import OgrefsError, UsageError
from ogrefs.repo import Repository
from ogrefs.repo.trash import read_trash
from ogrefs.snapshot.walk import WalkRules


EXIT_PARTIAL = 3  # snapshot written, but some files could not be read

MAX_PENDING_CHUNKS = 64
MAX_REREADS = 3


@dataclass
class SnapshotOptions:
    paths: list[bytes]
    tags: list[str] = field(default_factory=list)
    excludes: list[str] = field(default_factory=list)
    exclude_if_present: list[tuple[bytes, bytes | None]] = field(default_factory=list)  # see patterns.py
    whole_box: bool = False
    cross_mounts: bool = True
    parent: str | None = None  # snapshot name; None = newest of the same box and paths
    no_parent: bool = False
    host: str = field(default_factory=socket.gethostname)
    box: str | None = None  # None: the box of the snapshot this box runs from, else the host name
    own_mounts: Any = None  # mounted.OwnMounts; None: look for ogrefs' own writable mounts (detect_mounts)
    detect_mounts: bool = True
    workers: int = max(2, os.cpu_count() or 2)
    upload_workers: int = 4
    skip_paths: list[bytes] = field(default_factory=list)
    observers: list[Any] = field(default_factory=list)  # objects with observe_dir(path, names)


@dataclass
class Stats:
    files: int = 0
    dirs: int = 0
    others: int = 0
    bytes: int = 0  # apparent size of regular files seen
    read_bytes: int = 0
    reused_files: int = 0
    mount_reused_files: int = 0  # taken from the mounted snapshot's catalog: nothing in the upper directory
    local_copy_bytes: int = 0  # read from a mount's local copy (into another repository)
    chunks: int = 0
    new_chunks: int = 0
    new_raw_bytes: int = 0
    stored_bytes: int = 0  # bytes of blobs written by this run
    packs: int = 0
    started: float = field(default_factory=time.monotonic)


@dataclass
class _FileRec:
    ino: int
    path: bytes
    st: os.stat_result
    user: str | None
    grp: str | None
    extents: list[tuple[int, int, bytes]] = field(default_factory=list)
    remaining: int = 0
    closed: bool = False
    discarded: bool = False
    flags: int = 0


def _same_content_stat(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_size, a.st_mtime_ns, a.st_ctime_ns, a.st_ino, a.st_dev) == (
        b.st_size, b.st_mtime_ns, b.st_ctime_ns, b.st_ino, b.st_dev)


class _Names:
    """uid/gid -> name caches (names are stored so a restore can map by name)."""

    def __init__(self) -> None:
        self._users: dict[int, str | None] = {}
        self._groups: dict[int, str | None] = {}

    def user(self, uid: int) -> str | None:
        if uid not in self._users:
            try:
                self._users[uid] = pwd.getpwuid(uid).pw_name
            except KeyError:
                self._users[uid] = None
        return self._users[uid]

    def group(self, gid: int) -> str | None:
        if gid not in self._groups:
            try:
                self._groups[gid] = grp.getgrgid(gid).gr_name
            except KeyError:
                self._groups[gid] = None
        return self._groups[gid]


def read_xattrs(path: bytes) -> list[tuple[bytes, bytes]]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return []
    out = []
    for name in sorted(names):
        try:
            out.append((os.fsencode(name), os.getxattr(path, name, follow_symlinks=False)))
        except OSError:
            continue
    return out


def normalize_roots(paths: list[bytes]) -> list[bytes]:
    """Absolute, normalized, without duplicates or paths nested in another root."""
    out: list[bytes] = []
    for p in sorted({os.path.normpath(os.path.abspath(p)) for p in paths}):
        if any(p == r or p.startswith(r.rstrip(b"/") + b"/") for r in out):
            continue
        out.append(p)
    return out


class Snapshotter:
    def __init__(self, repo: Repository, opts: SnapshotOptions, progress: Callable[[Stats], None] | None = None):
        self.repo = repo
        self.opts = opts
        self.stats = Stats()
        self._progress = progress
        self._last_progress = 0.0
        self._names = _Names()
        self._chunker = Chunker(repo.config.chunker)
        self._codec = repo.codec  # immutable, thread-safe: hash workers use it
        self._claim_lock = threading.Lock()
        self._claimed: set[bytes] = set()
        self._live_packs: set[str] = set()
        self._pending: deque[tuple[Future, _FileRec, int, int]] = deque()
        self._uploads: deque[Future] = deque()
        self._pack = self.repo.new_pack()
        self._run_packs: list[str] = []
        self._run_index: list[tuple[bytes, str, int, int, int]] = []
        self.unreadable: list[dict[str, str]] = []
        self.changed: list[str] = []
        self.skipped: list[dict[str, str]] = []
        self._hardlinks: dict[tuple[int, int], int] = {}
        self._parent_cat: Catalog | None = None
        self._parent_manifest: dict | None = None
        self._ancestors: dict[bytes, int] = {}  # directories above a root, recorded once
        self.skipped_mounts: list[dict[str, str]] = []
        self._own = None  # mounted.OwnMounts, set in run()
        self._from: Any = None  # the own mount the box runs from (mounted.OwnMount), if any
        self._from_manifest: dict | None = None
        self._mcats: dict[str, Catalog | None] = {}  # mounted snapshot id -> its catalog (None: other repository)
        self._mdirs: dict[tuple[str, bytes], int | None] = {}  # (snapshot, catalog dir) -> inode
        self._mount_paths: set[str] = set()  # files taken from a mounted snapshot unchanged
        self._roots: set[bytes] = set()
        self._root_dev = 0

    # -- worker side ------------------------------------------------------------
    def _claim(self, cid: bytes) -> bool:
        """True if this run must store ``cid`` (called from hash workers)."""
        with self._claim_lock:
            if cid in self._claimed:
                return False
            if self.repo.index.lookup(cid, self._live_packs) is not None:
                return False
            self._claimed.add(cid)
            return True

    def _process(self, data: bytes) -> tuple[bytes, bytes | None]:
        cid = self._codec.chunk_id(data)
        if not self._claim(cid):
            return cid, None
        return cid, self._codec.encode_blob(cid, data)

    def _upload(self, name: str, body: bytes, entries: list[tuple[bytes, int, int, int]]) -> tuple[str, list]:
        index_entries = [(cid, name, off, slen, rlen) for cid, off, slen, rlen in entries]
        self.repo.put_pack(name, body)
        self.repo.write_index(name, index_entries)
        return name, index_entries

    # -- main thread -------------------------------------------------------------
    def _tick(self, force: bool = False) -> None:
        if self._progress is None:
            return
        now = time.monotonic()
        if force or now - self._last_progress > 0.2:
            self._last_progress = now
            self._progress(self.stats)

    def _consume_one(self) -> None:
        fut, rec, off, length = self._pending.popleft()
        cid, blob = fut.result()
        self.stats.chunks += 1
        if blob is not None:
            self._pack.add(cid, blob, length)
            self.stats.new_chunks += 1
            self.stats.new_raw_bytes += length
            self.stats.stored_bytes += len(blob)
            if self._pack.size >= self.repo.config.pack_target_size:
                self._seal_pack()
        rec.extents.append((off, length, cid))
        rec.remaining -= 1
        if rec.remaining == 0 and rec.closed:
            self._finish_file(rec)

    def _drain(self, keep: int = 0) -> None:
        while len(self._pending) > keep:
            self._consume_one()

    def _reap_uploads(self, keep: int) -> None:
        while len(self._uploads) > keep or (self._uploads and self._uploads[0].done()):
            name, entries = self._uploads.popleft().result()
            self.repo.index.add(entries, merged_name=name)
            self._run_packs.append(name)
            self._run_index.extend(entries)

    def _seal_pack(self) -> None:
        if not len(self._pack):
            return
        name, body, entries = self._pack.finish()
        self._pack = self.repo.new_pack()
        self._live_packs.add(name)
        self.stats.packs += 1
        self._uploads.append(self._upload_pool.submit(self._upload, name, body, entries))
        self._reap_uploads(keep=self.opts.upload_workers)

    def _finish_file(self, rec: _FileRec) -> None:
        if rec.discarded:
            return
        self.cat.add_inode(rec.ino, rec.st, rec.user, rec.grp, flags=rec.flags)
        rec.extents.sort()
        self.cat.add_extents(rec.ino, rec.extents)

    def _read_file(self, path: bytes, lst: os.stat_result, ino: int, record_st: os.stat_result | None = None) -> None:
        """Chunk a regular file, re-reading it if it changes underneath us.

        ``record_st``: the attributes to record when ``path`` is a copy of the
        file (a mount's local copy) rather than the file itself.
        """
        user, group = self._names.user(lst.st_uid), self._names.group(lst.st_gid)
        for attempt in range(MAX_REREADS):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                self._unreadable(path, exc)
                return
            try:
                st0 = os.fstat(fd)
                if not stat.S_ISREG(st0.st_mode):
                    raise OSError(0, "replaced by a non-regular file while snapshotting")
                rec = _FileRec(ino, path, record_st or st0, user, group)
                for off, data in self._chunker.chunks(fd, data_extents(fd, st0.st_size)):
                    rec.remaining += 1
                    self.stats.read_bytes += len(data)
                    self._pending.append((self._hash_pool.submit(self._process, data), rec, off, len(data)))
                    if len(self._pending) > MAX_PENDING_CHUNKS:
                        self._drain(keep=MAX_PENDING_CHUNKS // 2)
                    self._tick()
                st1 = os.fstat(fd)
            except OSError as exc:
                os.close(fd)
                self._unreadable(path, exc)
                return
            os.close(fd)
            if _same_content_stat(st0, st1):
                break
            if attempt < MAX_REREADS - 1:
                rec.discarded = True
                continue
            rec.flags |= FLAG_CHANGED
            self.changed.append(os.fsdecode(path))
        rec.closed = True
        if rec.remaining == 0:
            self._finish_file(rec)

    def _unreadable(self, path: bytes, exc: OSError) -> None:
        self.unreadable.append({"path": os.fsdecode(path), "error": exc.strerror or str(exc)})

    def _reuse_from_parent(self, path: bytes, lst: os.stat_result, ino: int, old: Inode | None) -> bool:
        if old is None or self._parent_cat is None or not old.is_reg or old.flags & FLAG_CHANGED:
            return False
        if (old.size, old.mtime_ns, old.ctime_ns, old.src_ino, old.src_dev) != (
                lst.st_size, lst.st_mtime_ns, lst.st_ctime_ns, lst.st_ino, lst.st_dev):
            return False
        rows = self._live_rows(self._parent_cat, old.ino)
        if rows is None:
            return False
        self.cat.add_inode(ino, lst, self._names.user(lst.st_uid), self._names.group(lst.st_gid))
        self.cat.add_located_extents(ino, rows)
        self.stats.reused_files += 1
        self.stats.chunks += len(rows)
        return True

    def _live_rows(self, cat: Catalog, old_ino: int) -> list | None:
        """A file's extents in ``cat`` with locations in live packs; None if some data is gone."""
        rows = []
        for off, length, cid, loc in cat.located_extents(old_ino):
            if loc is None or loc.pack not in self._live_packs:
                loc = self.repo.index.lookup(cid, self._live_packs)
                if loc is None:
                    return None  # the data it pointed to is gone: read the file again
            rows.append((off, length, cid, loc))
        return rows

    def _mounted_catalog(self, snap_id: str) -> Catalog | None:
        """The catalog of a mounted snapshot if it is in this repository (its chunks are ours), else None."""
        if snap_id not in self._mcats:
            from ogrefs.errors import SnapshotNotFound

            try:
                self.repo.load_manifest(snap_id)
                self._mcats[snap_id] = Catalog(self.repo.catalog_path(snap_id))
            except SnapshotNotFound:
                self._mcats[snap_id] = None
        return self._mcats[snap_id]

    def _mounted_entry(self, cat: Catalog, snap_id: str, cat_path: bytes) -> Inode | None:
        parent, name = os.path.split(cat_path)
        key = (snap_id, parent)
        if key not in self._mdirs:
            if len(self._mdirs) > 10_000:
                self._mdirs.clear()
            node = cat.resolve(parent)
            self._mdirs[key] = node.ino if node is not None and node.is_dir else None
        dino = self._mdirs[key]
        return cat.lookup(dino, name) if dino is not None and name else None

    def _reuse_from_mount(self, path: bytes, lst: os.stat_result, ino: int) -> bool:
        """A file of the mounted snapshot that nothing has changed: its entry, unread (mounted.py says how)."""
        origin = self._own.origin(path) if self._own is not None else None
        if origin is None or (origin.in_upper and not origin.metacopy):
            return False  # new or copied up: read as usual
        mount = origin.layer.mount
        cat = self._mounted_catalog(mount.snapshot)
        if cat is None:  # another repository: its chunk ids mean nothing here; read locally where we can
            if not mount.local_complete(origin.cat_path):
                return False
            local = mount.tree_path(origin.cat_path)
            try:
                if os.lstat(local).st_size != lst.st_size:
                    return False
            except OSError:
                return False
            before = self.stats.read_bytes
            self._read_file(local, lst, ino, record_st=lst)
            self.stats.local_copy_bytes += self.stats.read_bytes - before
            return True
        old = self._mounted_entry(cat, mount.snapshot, origin.cat_path)
        if old is None or not old.is_reg or old.flags & FLAG_CHANGED or old.size != lst.st_size:
            return False
        if not origin.metacopy and old.mtime_ns != lst.st_mtime_ns:
            return False  # not the snapshot's file (the box's own content below the snapshot's)
        rows = self._live_rows(cat, old.ino)
        if rows is None:
            return False
        self.cat.add_inode(ino, lst, old.user if old.uid == lst.st_uid else self._names.user(lst.st_uid),
                           old.grp if old.gid == lst.st_gid else self._names.group(lst.st_gid))
        self.cat.add_located_extents(ino, rows)
        self.stats.reused_files += 1
        self.stats.mount_reused_files += 1
        self.stats.chunks += len(rows)
        self._mount_paths.add(os.fsdecode(path))
        return True

    def _known_check(self, path: str):
        """The mounted snapshot's verdict on a checkpoint file taken from it unchanged (not read again)."""
        if path not in self._mount_paths or not self._from_manifest:
            return None
        index = getattr(self, "_check_index", None)
        if index is None:
            index = self._check_index = {}
            env = self._from_manifest.get("environment") or {}
            for run in (env.get("checkpoints") or {}).get("runs", []) or []:
                for ck in run.get("checkpoints", []) or []:
                    for f in ck.get("files", []) or []:
                        if isinstance(f, dict) and isinstance(f.get("path"), str):
                            index[f["path"]] = f
        from ogrefs.inspect.ckptfiles import FileCheck

        found = index.get(path)
        if found:
            return FileCheck.from_json(found)
        # unchanged, and the mounted snapshot's probe did not count it as part of a checkpoint
        # (e.g. a data shard named *.bin): the same verdict, without reading it through the mount
        fc = FileCheck(path=path, kind="unknown", ok=None)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            fc.size, fc.mtime = st.st_size, st.st_mtime
        fc.evidence.append("unchanged since the mounted snapshot, which found no checkpoint in it")
        return fc

    def _old_children(self, old_parent: int | None) -> dict[bytes, Inode] | None:
        if self._parent_cat is None or old_parent is None:
            return None
        return dict(self._parent_cat.children(old_parent))

    def _record(self, parent_ino: int, name: bytes, path: bytes, old_parent: int | None,
                old_children: dict[bytes, Inode] | None = None) -> None:
        """Record one entry (and, for a directory, everything below it)."""
        if self.rules.excluded(path) or path in self._skip_entirely:
            return
        try:
            lst = os.lstat(path)
        except OSError as exc:
            self._unreadable(path, exc)
            return
        mode = lst.st_mode
        if stat.S_ISSOCK(mode):
            self.skipped.append({"path": os.fsdecode(path), "reason": "socket"})
            return
        old = old_children.get(name) if old_children is not None else None
        if old is not None and stat.S_IFMT(old.mode) != stat.S_IFMT(mode):
            old = None
        if lst.st_nlink > 1 and not stat.S_ISDIR(mode):
            key = (lst.st_dev, lst.st_ino)
            existing = self._hardlinks.get(key)
            if existing is not None:
                self.cat.add_dirent(parent_ino, name, existing)
                return
        ino = self.cat.new_ino()
        self.cat.add_dirent(parent_ino, name, ino)
        if lst.st_nlink > 1 and not stat.S_ISDIR(mode):
            self._hardlinks[(lst.st_dev, lst.st_ino)] = ino
        xattrs = read_xattrs(path)
        if xattrs:
            self.cat.add_xattrs(ino, xattrs)
        if stat.S_ISDIR(mode):
            self.stats.dirs += 1
            self.cat.add_inode(ino, lst, self._names.user(lst.st_uid), self._names.group(lst.st_gid))
            self._walk_dir(ino, path, lst, old.ino if old else None)
        elif stat.S_ISREG(mode):
            self.stats.files += 1
            self.stats.bytes += lst.st_size
            if not (self._reuse_from_mount(path, lst, ino) or self._reuse_from_parent(path, lst, ino, old)):
                self._read_file(path, lst, ino)
        elif stat.S_ISLNK(mode):
            self.stats.others += 1
            try:
                target = os.readlink(path)
            except OSError as exc:
                self._unreadable(path, exc)
                target = b""
            self.cat.add_inode(ino, lst, self._names.user(lst.st_uid), self._names.group(lst.st_gid),
                               target=target, size=len(target))
        else:  # fifo, char and block devices
            self.stats.others += 1
            self.cat.add_inode(ino, lst, self._names.user(lst.st_uid), self._names.group(lst.st_gid), size=0)
        self._tick()

    def _walk_dir(self, ino: int, path: bytes, lst: os.stat_result, old_ino: int | None) -> None:
        skipped = self.rules.not_descended(path, is_root=path in self._roots, dev=lst.st_dev,
                                           root_dev=self._root_dev)
        if skipped is not None:
            if skipped["type"] != "directory":  # a mount point: listed; volatile plain dirs are the rules' own
                self.skipped_mounts.append(skipped)
            return
        try:
            names = sorted(os.listdir(path))
        except OSError as exc:
            self._unreadable(path, exc)
            return
        for obs in self.opts.observers:
            obs.observe_dir(path, names)
        base = path.rstrip(b"/")
        old_children = self._old_children(old_ino)
        for name in names:
            self._record(ino, name, base + b"/" + name, old_ino, old_children)

    # -- orchestration ------------------------------------------------------------
    def _find_parent(self, roots: list[bytes]) -> None:
        """The parent: --parent, else the newest snapshot of this box and paths, else the one the box runs from."""
        if self.opts.no_parent:
            return
        from ogrefs.snapshot.selection import box_of

        want = sorted(os.fsdecode(r) for r in roots)
        if self.opts.parent:
            from ogrefs.snapshot.selection import resolve_snapshot

            manifest = resolve_snapshot(self.repo, self.opts.parent, box=self.box)
        else:
            candidates = [m for m in self.repo.list_snapshots()
                          if sorted(m.get("paths", [])) == want and box_of(m) == self.box]
            if candidates:
                manifest = candidates[-1]
            elif self._from_manifest is not None:
                manifest = self._from_manifest
            else:
                return
        self._parent_manifest = manifest
        self._parent_cat = Catalog(self.repo.catalog_path(manifest["id"]))

    def _find_own_mounts(self, roots: list[bytes]) -> None:
        """ogrefs' own writable mounts (mounted.py), the one this box runs from, and the box name."""
        own = self.opts.own_mounts
        if own is None and self.opts.detect_mounts:
            from ogrefs.snapshot.mounted import OwnMounts, own_mounts

            own = OwnMounts(own_mounts())
        self._own = own if own is not None and own.mounts else None
        self._from = self._own.covering(roots) if self._own is not None else None
        if self._from is not None and self._mounted_catalog(self._from.snapshot) is not None:
            self._from_manifest = self.repo.load_manifest(self._from.snapshot)
        from ogrefs.snapshot.selection import box_of

        self.box = self.opts.box or (box_of(self._from_manifest) if self._from_manifest else self.opts.host)
        for obs in self.opts.observers:
            if self._own is not None and hasattr(obs, "known_checks"):
                obs.known_checks = self._known_check
                # `git status` would read every tracked file through the lazy mount to compare it
                if hasattr(obs, "check_git_dirty"):
                    obs.check_git_dirty = False

    def run(self) -> dict[str, Any]:
        roots = normalize_roots(self.opts.paths)
        if not roots:
            raise UsageError("nothing to snapshot: give at least one path")
        for r in roots:
            if not os.path.lexists(r):
                raise UsageError(f"{os.fsdecode(r)}: no such file or directory")
        self._find_own_mounts(roots)
        layers = self._own.targets if self._own is not None else frozenset()
        if self.opts.whole_box:
            self.rules = WalkRules.for_whole_box(self.opts.excludes, [], self.opts.cross_mounts, layers)
        else:
            self.rules = WalkRules.for_paths(self.opts.excludes, self.opts.cross_mounts, layers)
        self.rules.exclude_if_present = list(self.opts.exclude_if_present)
        self._skip_entirely = {os.path.normpath(p) for p in self.opts.skip_paths}
        if self._own is not None:
            self._skip_entirely |= {os.path.normpath(p) for p in self._own.state_dirs}
        self._roots = set(roots)

        # The shared lock is taken before looking at packs: prune then knows that
        # anything it marks as trash after this moment may still be referenced by us.
        self._lock = self.repo.lock("shared", "snapshot").acquire()
        try:
            self.repo.index.sync()
            self._live_packs = {k.rsplit("/", 1)[1] for k in self.repo.store.list("packs/")}
            self._live_packs -= set(read_trash(self.repo)[0])
            self.repo.recover_orphan_packs(self._live_packs)
            self._find_parent(roots)
        except BaseException:
            self._lock.release()
            raise

        tmpdir = tempfile.TemporaryDirectory(prefix="ogrefs-snap-", dir=self.repo.cache_dir)
        cat_path = Path(tmpdir.name) / "catalog.sqlite"
        self.cat = CatalogWriter(cat_path)
        self._hash_pool = ThreadPoolExecutor(self.opts.workers, thread_name_prefix="ogrefs-hash")
        self._upload_pool = ThreadPoolExecutor(self.opts.upload_workers, thread_name_prefix="ogrefs-upload")
        try:
            return self._run(roots, cat_path)
        finally:
            self._hash_pool.shutdown(wait=True, cancel_futures=True)
            self._upload_pool.shutdown(wait=True, cancel_futures=True)
            tmpdir.cleanup()
            self._lock.release()

    def _run(self, roots: list[bytes], cat_path: Path) -> dict[str, Any]:
        root_ino = self.cat.new_ino()
        assert root_ino == ROOT_INO
        self.cat.add_inode(ROOT_INO, os.lstat(b"/"), self._names.user(0), self._names.group(0))
        for root in roots:
            self.cat.add_root(root)
            self._root_dev = os.lstat(root).st_dev
            if root == b"/":
                self._walk_dir(ROOT_INO, b"/", os.lstat(b"/"), ROOT_INO if self._parent_cat else None)
                continue
            # Ancestors are recorded with their own attributes but without other children.
            parent, old_parent = ROOT_INO, (ROOT_INO if self._parent_cat else None)
            parts = root.strip(b"/").split(b"/")
            prefix = b""
            for part in parts[:-1]:
                prefix += b"/" + part
                node = self._ancestors.get(prefix)
                old = self._parent_cat.lookup(old_parent, part) if old_parent else None
                if node is None:
                    node = self.cat.new_ino()
                    self.cat.add_dirent(parent, part, node)
                    st = os.lstat(prefix)
                    self.cat.add_inode(node, st, self._names.user(st.st_uid), self._names.group(st.st_gid))
                    self._ancestors[prefix] = node
                parent, old_parent = node, (old.ino if old else None)
            self._record(parent, parts[-1], root, old_parent, self._old_children(old_parent))
        self._drain()
        self._seal_pack()
        self._reap_uploads(keep=0)
        self._tick(force=True)
        return self._commit(roots, cat_path)

    def _finish_observers(self) -> dict[str, Any] | None:
        """Let the environment probe read what it noted; store its prefetch hints in the catalog.

        Hints are ``{class: [absolute paths]}``; each path becomes a catalog row
        ``(class, ino, rank)`` in the order given, so the mount can prefetch
        python environments, CUDA libraries and the latest checkpoint first.
        """
        environment = None
        for obs in self.opts.observers:
            try:
                result = obs.finish()
            except Exception as exc:  # the probe must never cost the snapshot
                result = {"notes": [f"environment capture failed: {exc!r}"]}
            hints = result.pop("hints", None) or {}
            rank = 0
            for klass, paths in hints.items():
                for p in paths:
                    ino = self.cat.resolve(os.fsencode(p))
                    if ino is not None:
                        self.cat.add_hint(klass, ino, rank)
                        rank += 1
            result["hint_counts"] = {k: len(v) for k, v in hints.items()}
            environment = result
        return environment

    def _commit(self, roots: list[bytes], cat_path: Path) -> dict[str, Any]:
        for cid in self.cat.unlocated():
            loc = self.repo.index.lookup(cid, self._live_packs)
            if loc is None and self._parent_cat is not None:
                loc = self._parent_cat.blob_location(cid)
                if loc is not None and loc.pack not in self._live_packs:
                    loc = None
            if loc is None:
                raise OgrefsError(f"internal error: chunk {cid.hex()[:12]} has no location; snapshot not saved")
            self.cat.set_location(cid, loc)
        environment = self._finish_observers()
        snap_id = secrets.token_hex(32)
        self.cat.set_meta("snapshot_id", snap_id)
        self.cat.close()
        if self._run_index:
            # One consolidated index object replaces this run's per-pack ones.
            self.repo.write_index(snap_id, self._run_index)
            self.repo.index.add([], merged_name=snap_id)
            for name in self._run_packs:
                self.repo.store.delete(f"index/{name}")
            self.repo.index.forget_merged(self._run_packs)
        catalog_size = self.repo.put_catalog(snap_id, cat_path)
        s = self.stats
        manifest: dict[str, Any] = {
            "id": snap_id,
            "time": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
            "host": self.opts.host,
            "box": self.box,
            "paths": [os.fsdecode(r) for r in roots],
            "tags": sorted(set(self.opts.tags)),
            "parent": self._parent_manifest["id"] if self._parent_manifest else None,
            "whole_box": self.opts.whole_box,
            "excludes": self.opts.excludes,
            "totals": {
                "files": s.files, "dirs": s.dirs, "others": s.others, "bytes": s.bytes,
                "read_bytes": s.read_bytes, "reused_files": s.reused_files, "chunks": s.chunks,
                "mount_reused_files": s.mount_reused_files, "local_copy_bytes": s.local_copy_bytes,
                "new_chunks": s.new_chunks, "new_raw_bytes": s.new_raw_bytes, "new_stored_bytes": s.stored_bytes,
                "packs": s.packs, "catalog_bytes": catalog_size,
                "seconds": round(time.monotonic() - s.started, 3),
            },
            "changed_during_snapshot": self.changed,
            "unreadable": self.unreadable,
            "skipped": self.skipped,
            "skipped_mounts": self.skipped_mounts,
        }
        if self._from is not None:
            manifest["resumed_from"] = {"snapshot": self._from.snapshot, "same_repository": self._from_manifest
                                        is not None, "finalized": self._from.finalized}
        if environment is not None:
            manifest["environment"] = environment
        self.repo.put_manifest(manifest)
        return manifest


def take_snapshot(repo: Repository, opts: SnapshotOptions,
                  progress: Callable[[Stats], None] | None = None) -> dict[str, Any]:
    try:
        return Snapshotter(repo, opts, progress).run()
    except sqlite3.Error as exc:
        # the catalog being built and the index cache live in the local cache directory
        raise OgrefsError(f"local cache {repo.cache_dir}: {exc} (is the disk full?); "
                          "nothing was saved as a snapshot") from None
