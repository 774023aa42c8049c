"""What a snapshot of a box running from an ogrefs mount takes from the mounted snapshot.

``snapshot/mounted.py`` says where an entry of the merged view comes from;
this module holds the mounted snapshots' side for one snapshot run: their
catalogs (only when they are in the repository being written: elsewhere their
chunk ids mean nothing), directory lookups in them, the files taken from them
unchanged, and the mounted snapshot's verdicts on checkpoint files, so the
environment probe does not read those files again through the lazy mount.

Used by the snapshot's main thread, and once the walk has ended by the probe's
thread (``known_check``, pipeline.ObserverRun), when the main thread no longer changes it.
"""

from __future__ import annotations

import contextlib
import os

from ogrefs.errors import SnapshotNotFound
from ogrefs.inspect.ckptfiles import FileCheck
from ogrefs.repo import Repository
from ogrefs.repo.catalog import Catalog, Inode

#: Directory lookups remembered per run before the memo starts afresh (a whole box has ~10^5 directories).
MAX_DIR_MEMO = 10_000


class MountedSnapshots:
    """The mounted snapshots' catalogs and verdicts, as one snapshot run needs them."""

    def __init__(self, repo: Repository) -> None:
        self.repo = repo
        self.from_manifest: dict | None = None  # the manifest of the snapshot the box runs from, if ours
        self.unchanged_paths: set[str] = set()  # files taken from a mounted snapshot unchanged
        self._cats: dict[str, Catalog | None] = {}  # mounted snapshot id -> its catalog (None: other repository)
        self._dirs: dict[tuple[str, bytes], int | None] = {}  # (snapshot, catalog dir) -> inode
        self._checks: dict[str, dict] | None = None  # path -> the mounted snapshot's FileCheck JSON

    def catalog(self, snap_id: str) -> Catalog | None:
        """The catalog of a mounted snapshot if it is in this repository (its chunks are ours), else None."""
        if snap_id not in self._cats:
            try:
                self.repo.load_manifest(snap_id)
                self._cats[snap_id] = Catalog(self.repo.catalog_path(snap_id))
            except SnapshotNotFound:
                self._cats[snap_id] = None
        return self._cats[snap_id]

    def entry(self, cat: Catalog, snap_id: str, cat_path: bytes) -> Inode | None:
        """The entry at ``cat_path`` in a mounted snapshot's catalog (directories looked up once)."""
        parent, name = os.path.split(cat_path)
        key = (snap_id, parent)
        if key not in self._dirs:
            if len(self._dirs) > MAX_DIR_MEMO:
                self._dirs.clear()
            node = cat.resolve(parent)
            self._dirs[key] = node.ino if node is not None and node.is_dir else None
        dino = self._dirs[key]
        return cat.lookup(dino, name) if dino is not None and name else None

    def known_check(self, path: str) -> FileCheck | None:
        """The mounted snapshot's verdict on a checkpoint file taken from it unchanged (not read again)."""
        if path not in self.unchanged_paths or not self.from_manifest:
            return None
        found = self._check_index().get(path)
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

    def _check_index(self) -> dict[str, dict]:
        if self._checks is None:
            self._checks = {}
            env = (self.from_manifest or {}).get("environment") or {}
            for run in (env.get("checkpoints") or {}).get("runs", []) or []:
                for ck in run.get("checkpoints", []) or []:
                    for f in ck.get("files", []) or []:
                        if isinstance(f, dict) and isinstance(f.get("path"), str):
                            self._checks[f["path"]] = f
        return self._checks
