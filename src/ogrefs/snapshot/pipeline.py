"""Take a snapshot: walk the tree, chunk, dedup, pack, upload, write the catalog.

The pipeline (docs/architecture.md has the picture):

0. Under the run's shared lock the main thread finds the parent while two
   *start threads* list the live packs and read the trash beside it (each only
   reads the store and returns what it read; joined before the walk); an
   *index thread* (snapshot/indexsync.py) then merges the index objects this
   box has not seen while the walk starts, and every lookup waits for it.
1. The *main thread* walks the tree in sorted order, stats every entry and
   decides whether a file is unchanged since the parent snapshot (or taken
   unchanged from the snapshot the box runs from: snapshot/frommount.py). It
   alone owns the CatalogWriter and, through the Packer, the open pack, the
   local chunk index's write side and the queue of chunks in flight.
2. Changed files go to the data path (snapshot/packer.py): *hash workers*
   get one immutable ``bytes`` chunk each, hash it, claim it (this run stores
   it) or find it stored, and compress it if claimed; the main thread consumes
   results strictly in submission order, so blobs land in packs in walk order
   (files of one directory stay together), and seals a pack at the target size.
3. *Upload workers* put a sealed pack and its per-pack index object; the main
   thread then records the pack in the local index.
4. When the walk ends, the environment probe's reads run in a *probe thread*
   (:class:`ObserverRun`) while the last packs upload; the main thread then
   turns its hints into catalog rows and writes the run's consolidated index
   object while a *commit thread* puts the catalog; once that object is
   stored, commit threads delete the per-pack index objects it replaces side
   by side (the threads get names and a closed file; all joined before the
   manifest), and the main thread writes the manifest.

Behind a far link every store request that waits for another costs a round
trip, and a snapshot at a preemption notice has seconds: only what needs
another's answer waits for it (docs/benchmarks.md, "A snapshot's fixed
requests behind a far link").

Nothing is visible as a snapshot until the manifest is written, last, after
every pack, index and the catalog are in the store.  An interrupted run leaves
packs with their index objects, which the next run finds and reuses.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import secrets
import socket
import sqlite3
import stat
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from ogrefs.inspect.machine import usable_cpus
from ogrefs.repo.catalog import ROOT_INO, Catalog, CatalogWriter, Inode, Listed
from ogrefs.box.records import clear_snapshot_running, mark_snapshot_running, mark_snapshot_started
from ogrefs.snapshot import origin
from ogrefs.snapshot.frommount import MountedSnapshots
from ogrefs.snapshot.origin import LocalRead, ParentDir, Reuse, Sources
from ogrefs.snapshot.indexsync import IndexSync
from ogrefs.snapshot.packer import PackStats, Packer
from ogrefs.snapshot.mounted import OwnMounts, own_mounts
from ogrefs.snapshot.readahead import ReadAhead
from ogrefs.snapshot.selection import box_of, machine_box, resolve_snapshot
from ogrefs.errors import OgrefsError, UsageError
from ogrefs.repo import Repository
from ogrefs.repo.trash import read_trash
from ogrefs.snapshot.treecopy import UntouchedTrees
from ogrefs.snapshot.untouched import KnownDir, UntouchedDirs
from ogrefs.snapshot.walk import WalkRules

log = logging.getLogger(__name__)

#: Store requests of a snapshot's commit in flight at once (the catalog, the per-pack index deletions).
_COMMIT_THREADS = 8

EXIT_PARTIAL = 3  # snapshot written, but some files could not be read


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
    box: str | None = None  # None: the box of the snapshot this box runs from, else selection.machine_box
    own_mounts: Any = None  # mounted.OwnMounts; None: look for ogrefs' own writable mounts (detect_mounts)
    detect_mounts: bool = True
    workers: int = field(default_factory=lambda: max(2, usable_cpus()))  # a container's CPU limit, not the host's
    upload_workers: int = 4
    skip_paths: list[bytes] = field(default_factory=list)
    observers: list[Any] = field(default_factory=list)  # objects with observe_dir(path, names)


@dataclass
class Stats(PackStats):
    files: int = 0
    dirs: int = 0
    others: int = 0
    bytes: int = 0  # apparent size of regular files seen
    reused_files: int = 0
    mount_reused_files: int = 0  # taken from the mounted snapshot's catalog: nothing in the upper directory
    local_copy_bytes: int = 0  # read from a mount's local copy (into another repository)
    started: float = field(default_factory=time.monotonic)


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


class _Ticker:
    """Calls ``progress(stats)`` at most every 0.2 s (or at once when forced); the main thread's."""

    def __init__(self, progress: Callable[[Stats], None] | None, stats: Stats) -> None:
        self.progress, self.stats, self.last = progress, stats, 0.0

    def __call__(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.progress is not None and (force or now - self.last > 0.2):
            self.last = now
            self.progress(self.stats)


class Snapshotter:
    def __init__(self, repo: Repository, opts: SnapshotOptions, progress: Callable[[Stats], None] | None = None):
        self.repo = repo
        self.opts = opts
        self.stats = Stats()
        self._tick = _Ticker(progress, self.stats)  # self._tick(force=False): progress at most every 0.2 s
        self._names = _Names()
        self._live_packs: set[str] = set()
        self._packer: Packer  # the data path, set in run() once the catalog writer exists
        self.unreadable: list[dict[str, str]] = []
        self.skipped: list[dict[str, str]] = []
        self._hardlinks: dict[tuple[int, int], int] = {}
        self._parent_cat: Catalog | None = None
        self._parent_manifest: dict | None = None
        self._ancestors: dict[bytes, int] = {}  # directories above a root, recorded once
        self.skipped_mounts: list[dict[str, str]] = []
        self._own = None  # mounted.OwnMounts, set in run()
        self._from: Any = None  # the own mount the box runs from (mounted.OwnMount), if any
        self._running_mark: Path | None = None  # <state>/snapshot-running.<pid> of that mount, while this runs
        self._mounted = MountedSnapshots(repo)
        self._roots: set[bytes] = set()
        self._root_dev = 0

    # -- main thread -------------------------------------------------------------
    def _read_file(self, path: bytes, lst: os.stat_result, ino: int, record_st: os.stat_result | None = None) -> None:
        self._packer.read_file(path, ino, self._names.user(lst.st_uid), self._names.group(lst.st_gid), record_st)

    def _not_walked(self, path: bytes) -> bool:
        """A directory the walk will not descend into, for the read-ahead (its thread: the rules only read)."""
        return not self.rules.descend(path) or path in self._skip_entirely or self.rules.excluded(path)

    def _unreadable(self, path: bytes, exc: OSError) -> None:
        self.unreadable.append({"path": os.fsdecode(path), "error": exc.strerror or str(exc)})

    def _take(self, ino: int, path: bytes, reuse: Reuse, lst: os.stat_result | None = None) -> None:
        """Record a file's extents as a catalog has them (origin.py said which); the bookkeeping of every reuse.

        ``lst``: the file as the walk saw it (its inode row is written from it); None where the inode row was
        copied from the mounted catalog already (a listing)."""
        if lst is not None:
            user = reuse.user[0] if reuse.user is not None else self._names.user(lst.st_uid)
            grp = reuse.grp[0] if reuse.grp is not None else self._names.group(lst.st_gid)
            self.cat.add_inode(ino, lst, user, grp)
        self.cat.add_located_extents(ino, reuse.rows)
        self.stats.reused_files += 1
        self.stats.chunks += len(reuse.rows)
        if reuse.from_mount:
            self.stats.mount_reused_files += 1
            self._mounted.unchanged_paths.add(os.fsdecode(path))

    def _file_data(self, path: bytes, lst: os.stat_result, ino: int, old: Inode | None,
                   old_dir: ParentDir | None) -> None:
        """A regular file's data: taken as a catalog has it, read from a local copy, or read (origin.py)."""
        found = origin.of_file(self._sources, path, lst, old, old_dir)
        if isinstance(found, Reuse):
            self._take(ino, path, found, lst)
        elif isinstance(found, LocalRead):
            before = self.stats.read_bytes
            self._read_file(found.path, lst, ino, record_st=lst)
            self.stats.local_copy_bytes += self.stats.read_bytes - before
        else:
            self._read_file(path, lst, ino)

    def _old_children(self, old_parent: int | None) -> ParentDir | None:
        if self._parent_cat is None or old_parent is None:
            return None
        return ParentDir(self._parent_cat, old_parent)

    def _record(self, parent_ino: int, name: bytes, path: bytes, old_parent: int | None,
                old_children: ParentDir | None = None) -> None:
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
            self._walk_dir(ino, path, lst.st_dev, old.ino if old else None)
        elif stat.S_ISREG(mode):
            self.stats.files += 1
            self.stats.bytes += lst.st_size
            self._file_data(path, lst, ino, old, old_children)
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

    def _walk_dir(self, ino: int, path: bytes, dev: int, old_ino: int | None, cat_ino: int | None = None) -> None:
        """List directory ``path`` (``cat_ino``: its inode in the mounted snapshot's catalog, when known)."""
        skipped = self.rules.not_descended(path, is_root=path in self._roots, dev=dev, root_dev=self._root_dev)
        if skipped is not None:
            if skipped["type"] != "directory":  # a mount point: listed; volatile plain dirs are the rules' own
                self.skipped_mounts.append(skipped)
            return
        known = self._untouched.known_dir(path, cat_ino) if not self.rules.submount(path) else None
        if known is not None and known.complete:
            names = known.names()  # untouched since the mount: the catalog's (and own layer's) names (untouched.py)
        else:
            try:
                names = sorted(os.listdir(path))
            except OSError as exc:
                self._unreadable(path, exc)
                return
        for obs in self.opts.observers:
            obs.observe_dir(path, names)
        if known is not None and known.complete and self._trees.copy(known, path, ino, dev, self._root_dev):
            return  # the whole subtree from the mounted catalog (treecopy.py)
        self._ahead.entering(path, dev, all_read=old_ino is None and known is None)  # nothing here is reused
        base = path.rstrip(b"/")
        old_children = self._old_children(old_ino)
        for name in names:
            child = base + b"/" + name
            listed = self._untouched.entry(known, name, child) if known is not None else None
            if listed is None or not self._record_listed(ino, name, child, listed, known, dev, old_children):
                self._record(ino, name, child, old_ino, old_children)

    def _record_listed(self, parent_ino: int, name: bytes, path: bytes, listed: Listed, known: KnownDir, dev: int,
                       old_children: ParentDir | None) -> bool:
        """Record an entry the mounted snapshot's catalog knows unchanged, sending nothing through the mount.

        False when it must be looked at after all (``_record``): a mount point, a hard link (overlayfs may
        show another alias's copy-up), a file whose data is gone from the repository or was read changing.
        """
        old = listed.node
        names = (self._untouched.known_names(path, old, self.rules.submount(path))
                 if self.rules.exclude_if_present else None)
        if self.rules.excluded(path, names) or path in self._skip_entirely:
            return True
        if path in self.rules.table or (old.nlink > 1 and not old.is_dir):
            return False
        reuse = origin.of_listed(self._sources, listed) if old.is_reg else None
        if old.is_reg and reuse is None:
            return False
        ino = self.cat.new_ino()
        self.cat.add_dirent(parent_ino, name, ino)
        self.cat.copy_inode(ino, old)
        xattrs = self._untouched.xattrs(listed)
        if xattrs:
            self.cat.add_xattrs(ino, xattrs)
        if old.is_dir:
            self.stats.dirs += 1
            prev = old_children.get(name) if old_children is not None else None
            self._walk_dir(ino, path, dev, prev.ino if prev is not None and prev.is_dir else None, old.ino)
        elif reuse is not None:
            self.stats.files += 1
            self.stats.bytes += old.size
            self._take(ino, path, reuse)
        else:  # symbolic links (their target is in the row), fifos, devices
            self.stats.others += 1
        self._tick()
        return True

    # -- orchestration ------------------------------------------------------------
    def _find_parent(self, roots: list[bytes]) -> None:
        """The parent: --parent, else the newest snapshot of this box and paths, else the one the box runs from."""
        if self.opts.no_parent:
            return
        want = sorted(os.fsdecode(r) for r in roots)
        if self.opts.parent:
            manifest = resolve_snapshot(self.repo, self.opts.parent, box=self.box)
        else:
            candidates = [m for m in self.repo.list_snapshots()
                          if sorted(m.get("paths", [])) == want and box_of(m) == self.box]
            if candidates:
                manifest = candidates[-1]
            elif self._mounted.from_manifest is not None:
                manifest = self._mounted.from_manifest
            else:
                return
        self._parent_manifest = manifest
        self._parent_cat = Catalog(self.repo.catalog_path(manifest["id"]))

    def _find_own_mounts(self, roots: list[bytes]) -> None:
        """ogrefs' own writable mounts (mounted.py), the one this box runs from, and the box name."""
        own = self.opts.own_mounts
        if own is None and self.opts.detect_mounts:
            own = OwnMounts(own_mounts())
        self._own = own if own is not None and own.mounts else None
        self._from = self._own.covering(roots) if self._own is not None else None
        if self._from is not None:
            _mark_snapshot_started(self._from.state_dir)
            self._running_mark = _mark_snapshot_running(self._from.state_dir)
        if self._from is not None and self._mounted.catalog(self._from.snapshot) is not None:
            self._mounted.from_manifest = self.repo.load_manifest(self._from.snapshot)
        self.box = self.opts.box or (box_of(self._mounted.from_manifest) if self._mounted.from_manifest
                                     else machine_box(self.opts.host))
        for obs in self.opts.observers:
            if self._own is not None and hasattr(obs, "known_checks"):
                obs.known_checks = self._mounted.known_check
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
        self._untouched = UntouchedDirs(self._own, self._mounted)
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
            with ThreadPoolExecutor(2, thread_name_prefix="ogrefs-start") as pool:
                packs = pool.submit(_pack_names, self.repo)
                trash = pool.submit(read_trash, self.repo)
                self._find_parent(roots)
                self._live_packs = packs.result() - set(trash.result()[0])
            self._index = IndexSync(self.repo, frozenset(self._live_packs))  # beside the walk's start
            self._sources = Sources(self._index, self._live_packs, self._parent_cat, self._own, self._mounted)
        except BaseException:
            self._lock.release()
            raise

        # Everything from here on gives the lock back however it ends: a cache disk found full by the
        # catalog's first write, too (a lock left held would be refreshed for as long as this process
        # lives — the agent's, for days — and prune would wait on it).
        tmpdir = None
        try:
            tmpdir = tempfile.TemporaryDirectory(prefix="ogrefs-snap-", dir=self.repo.cache_dir)
            cat_path = Path(tmpdir.name) / "catalog.sqlite"
            self.cat = CatalogWriter(cat_path)
            self._trees = UntouchedTrees(self.rules, self._skip_entirely, self.cat, self.stats, self.opts.observers,
                                         self._mounted.unchanged_paths, lambda packs: packs <= self._live_packs)
            self._packer = Packer(self.repo, self.cat, self.stats, self._live_packs, self.opts.workers,
                                  self.opts.upload_workers, self._unreadable, self._tick, self._index)
            self._ahead = ReadAhead(lambda: self.stats.bytes, self._not_walked,
                                    lambda: self.stats.files + self.stats.dirs + self.stats.others)
            try:
                return self._run(roots, cat_path)
            finally:
                self._ahead.close()
                self._packer.close()
        finally:
            self._index.join()  # nothing of this run writes to the index once its lock is released
            if tmpdir is not None:
                tmpdir.cleanup()
            self._lock.release()

    def _run(self, roots: list[bytes], cat_path: Path) -> dict[str, Any]:
        root_ino = self.cat.new_ino()
        assert root_ino == ROOT_INO
        self.cat.add_inode(ROOT_INO, os.lstat(b"/"), self._names.user(0), self._names.group(0))
        for root in roots:
            self.cat.add_root(root)
            self._root_dev = os.lstat(root).st_dev
            if self._parent_cat is not None and self._own is None:  # (a mount's trees are read from its catalog)
                self._ahead.stat_tree(root, self._root_dev)
            if root == b"/":
                self._walk_dir(ROOT_INO, b"/", os.lstat(b"/").st_dev, ROOT_INO if self._parent_cat else None)
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
        probing = ObserverRun(self.opts.observers)  # the environment probe reads while the last packs upload
        self._packer.finish()
        self._tick(force=True)
        return self._commit(roots, cat_path, probing)

    def _commit(self, roots: list[bytes], cat_path: Path, probing: ObserverRun) -> dict[str, Any]:
        self._index.wait()  # a run that never asked the index still fails if its sync failed
        for cid in self.cat.unlocated():
            loc = self._index.lookup(cid, self._live_packs)
            if loc is None and self._parent_cat is not None:
                loc = self._parent_cat.blob_location(cid)
                if loc is not None and loc.pack not in self._live_packs:
                    loc = None
            if loc is None:
                raise OgrefsError(f"internal error: chunk {cid.hex()[:12]} has no location; snapshot not saved")
            self.cat.set_location(cid, loc)
        environment = store_hints(probing.results(), self.cat)
        snap_id = secrets.token_hex(32)
        self.cat.set_meta("snapshot_id", snap_id)
        self.cat.close()
        catalog_size = _store_index_and_catalog(self.repo, snap_id, cat_path, self._packer.run_index,
                                                self._packer.run_packs)
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
            "changed_during_snapshot": self._packer.changed,
            "unreadable": self.unreadable,
            "skipped": self.skipped,
            "skipped_mounts": self.skipped_mounts,
        }
        if self._from is not None:
            manifest["resumed_from"] = {"snapshot": self._from.snapshot, "same_repository": self._mounted.from_manifest
                                        is not None, "finalized": self._from.finalized}
        if environment is not None:
            manifest["environment"] = environment
        self.repo.put_manifest(manifest)
        return manifest


def _store_index_and_catalog(repo: Repository, snap_id: str, cat_path: Path,
                             run_index: list[tuple[bytes, str, int, int, int]],
                             run_packs: list[str]) -> int:
    """The run's consolidated index object and its catalog, side by side; returns the catalog's stored size.

    The catalog goes to a pool thread at once; the consolidated index object
    is written here and only once it is stored are the per-pack index objects
    it replaces deleted (side by side): a pack's entries are always in one of
    the two. Everything is joined before this returns, so the manifest, which
    the caller writes next, comes last.
    """
    with ThreadPoolExecutor(_COMMIT_THREADS, thread_name_prefix="ogrefs-commit") as pool:
        catalog_put = pool.submit(repo.put_catalog, snap_id, cat_path)
        if run_index:  # one consolidated index object replaces this run's per-pack ones
            repo.write_index(snap_id, run_index)
            repo.index.add([], merged_name=snap_id)
            for done in [pool.submit(repo.store.delete, f"index/{name}") for name in run_packs]:
                done.result()
            repo.index.forget_merged(run_packs)
        return catalog_put.result()


def _pack_names(repo: Repository) -> set[str]:
    """The names of the packs in the store (a listing).  Blocking; run beside the parent's search."""
    return {k.rsplit("/", 1)[1] for k in repo.store.list("packs/")}


class ObserverRun:
    """The observers' ``finish`` (the environment probe's reads: files, NVML, git) in a thread of its own.

    Started when the walk ends, so that the probe's reads through a lazy
    mount, NVML's start on a box of eight GPUs or a large repository's git
    status run while the last packs upload, not after them, at a preemption
    notice. Owned by the main thread, which starts it and takes the results:
    the thread gets the observers once the walk no longer calls them (nor
    anything they read, such as the files the snapshot took unchanged) and
    writes only its own result list, read after ``join``.
    """

    def __init__(self, observers: list[Any]) -> None:
        self._results: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._finish_all, args=(tuple(observers),), name="ogrefs-probe",
                                        daemon=True)  # a snapshot that fails meanwhile does not wait for it
        self._thread.start()

    def _finish_all(self, observers: tuple[Any, ...]) -> None:
        for obs in observers:
            try:
                result = obs.finish()
            except Exception as exc:  # the probe must never cost the snapshot
                result = {"notes": [f"environment capture failed: {exc!r}"]}
            self._results.append(result)

    def results(self) -> list[dict[str, Any]]:
        self._thread.join()
        return self._results


def store_hints(results: list[dict[str, Any]], cat: CatalogWriter) -> dict[str, Any] | None:
    """The environment manifest of the observers' results; their prefetch hints become catalog rows.

    Hints are ``{class: [absolute paths]}``; each path becomes a catalog row
    ``(class, ino, rank)`` in the order given, so the mount can prefetch
    python environments, CUDA libraries and the latest checkpoint first.
    Main thread only (the catalog writer is the main thread's).
    """
    environment = None
    for result in results:
        hints = result.pop("hints", None) or {}
        rank = 0
        for klass, paths in hints.items():
            for p in paths:
                ino = cat.resolve(os.fsencode(p))
                if ino is not None:
                    cat.add_hint(klass, ino, rank)
                    rank += 1
        result["hint_counts"] = {k: len(v) for k, v in hints.items()}
        environment = result
    return environment


def take_snapshot(repo: Repository, opts: SnapshotOptions,
                  progress: Callable[[Stats], None] | None = None) -> dict[str, Any]:
    snap = Snapshotter(repo, opts, progress)
    try:
        return snap.run()
    except sqlite3.Error as exc:
        # the catalog being built and the index cache live in the local cache directory
        raise OgrefsError(f"local cache {repo.cache_dir}: {exc} (is the disk full?); "
                          "nothing was saved as a snapshot") from None
    finally:
        if snap._running_mark is not None:  # the mount the box runs from takes up its background work again
            clear_snapshot_running(snap._running_mark)


def _mark_snapshot_started(state_dir: bytes) -> None:
    """Tell the mount this box runs from that a snapshot starts: its access trace ends here (lazy/trace/recorder.py)."""
    try:
        mark_snapshot_started(Path(os.fsdecode(state_dir)))
    except OSError as exc:  # the trace then records on (to its quiet period): nothing of the snapshot is lost
        log.info("could not mark the snapshot's start in %s: %s", os.fsdecode(state_dir), exc)


def _mark_snapshot_running(state_dir: bytes) -> Path | None:
    """Tell the mount this box runs from that a snapshot runs: its prefetch and materialization wait
    (lazy/background/snapshotgate.py) and leave the CPU, the disk and the store to it; the mark, or None."""
    try:
        return mark_snapshot_running(Path(os.fsdecode(state_dir)))
    except OSError as exc:  # the mount's background work then goes on beside the snapshot: nothing is lost
        log.info("could not mark the running snapshot in %s: %s", os.fsdecode(state_dir), exc)
        return None
