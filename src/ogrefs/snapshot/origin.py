"""Where a regular file's data comes from in a new snapshot, asked once per file.

A snapshot of a resumed box can take a file's chunk list without reading the
file from four places, and this module is where the walk asks which:

* the **mounted snapshot** (the box runs from an ogrefs mount, :mod:`.mounted`):
  a file nothing has changed since the mount, by its path's origin in the
  overlay (nothing in the upper directory, or a metadata-only copy-up);
* the mounted snapshot's **listing** (:mod:`.untouched`): an entry of a
  directory nothing has changed, taken from the catalog without a stat;
* the **parent** snapshot: size, times and source inode as they were;
* a mount of **another repository**, whose chunk ids mean nothing here: the
  file is read from that mount's complete local copy instead of through the mount.

Otherwise the file is read.  (Whole untouched subtrees are copied in one go by
:mod:`.treecopy` before any of this is asked.)  :func:`of_file` and
:func:`of_listed` answer with a :class:`Reuse` (the located extents to record
as they are) or a :class:`LocalRead` (the path to read instead), or None: read
it.  The walk records a reuse in one place (``Snapshotter._take``), so the
counters and the set of unchanged paths the environment probe trusts are kept
the same way whichever the source.

Who owns what: the snapshotting thread alone calls these; :class:`Sources`
holds only what the run resolved before the walk (read-only for the run).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ogrefs.repo.catalog import FLAG_CHANGED, Catalog, Inode, Listed, child_extent_rows

if TYPE_CHECKING:
    from ogrefs.snapshot.frommount import MountedSnapshots
    from ogrefs.snapshot.indexsync import IndexSync
    from ogrefs.snapshot.mounted import OwnMounts

PARENT, MOUNT, LISTING = "parent", "mount", "listing"


@dataclass(frozen=True)
class Reuse:
    """A file recorded from a catalog as it is: its extents (located in live packs) and where they came from."""

    source: str  # PARENT, MOUNT or LISTING
    rows: list
    #: The owner's and group's names as the catalog has them, each where the id is still the same
    #: (MOUNT: a name the box's own database may not know); None: look the id up on this box.
    user: tuple[str | None] | None = None
    grp: tuple[str | None] | None = None

    @property
    def from_mount(self) -> bool:
        """Taken from the mounted snapshot: unchanged since the mount (the probe trusts its verdicts)."""
        return self.source != PARENT


@dataclass(frozen=True)
class LocalRead:
    """Read the file's bytes from this local copy instead of through the mount (a mount of another repository)."""

    path: bytes


def live_extents(index: IndexSync, live_packs: set[str], extents: list) -> list | None:
    """Extents ``(offset, length, chunk, location or None)`` located in live packs; None if some data is gone."""
    rows = []
    for off, length, cid, loc in extents:
        if loc is None or loc.pack not in live_packs:
            loc = index.lookup(cid, live_packs)
            if loc is None:
                return None  # the data it pointed to is gone: read the file again
        rows.append((off, length, cid, loc))
    return rows


@dataclass(frozen=True)
class Sources:
    """What a run resolved before its walk: the parent's catalog, this box's own mounts, the live packs."""

    index: IndexSync
    live_packs: set[str]
    parent: Catalog | None = None
    own: OwnMounts | None = None
    mounted: MountedSnapshots | None = None

    def live(self, extents: list) -> list | None:
        return live_extents(self.index, self.live_packs, extents)


class ParentDir:
    """A directory as the parent snapshot has it: its entries, and their extent rows fetched with them (two
    queries a directory, not one per file; a file's rows are checked when it is reused)."""

    def __init__(self, cat: Catalog, ino: int) -> None:
        self.cat = cat
        self.children = dict(cat.children(ino))
        self._rows = child_extent_rows(cat, ino) if any(n.is_reg for n in self.children.values()) else {}

    def get(self, name: bytes) -> Inode | None:
        return self.children.get(name)

    def located_extents(self, ino: int) -> list:
        return self.cat.located(ino, self._rows.get(ino, ()))


def of_file(src: Sources, path: bytes, lst: os.stat_result, old: Inode | None,
            old_dir: ParentDir | None = None) -> Reuse | LocalRead | None:
    """Where regular file ``path`` (``lst``: its lstat; ``old``: its entry in the parent, in ``old_dir``)
    comes from."""
    found = _from_mount(src, path, lst)
    return found if found is not None else _from_parent(src, lst, old, old_dir)


def of_listed(src: Sources, listed: Listed) -> Reuse | None:
    """A regular file of an untouched directory's listing: its extents as the mounted catalog has them."""
    node = listed.node
    if node.flags & FLAG_CHANGED:
        return None
    rows = src.live(listed.extents)
    return Reuse(LISTING, rows) if rows is not None else None  # (its inode row is copied whole, names too)


def _from_parent(src: Sources, lst: os.stat_result, old: Inode | None, old_dir: ParentDir | None) -> Reuse | None:
    if old is None or src.parent is None or not old.is_reg or old.flags & FLAG_CHANGED:
        return None
    if (old.size, old.mtime_ns, old.ctime_ns, old.src_ino, old.src_dev) != (
            lst.st_size, lst.st_mtime_ns, lst.st_ctime_ns, lst.st_ino, lst.st_dev):
        return None
    rows = src.live(old_dir.located_extents(old.ino) if old_dir is not None else src.parent.located_extents(old.ino))
    return Reuse(PARENT, rows) if rows is not None else None


def _from_mount(src: Sources, path: bytes, lst: os.stat_result) -> Reuse | LocalRead | None:
    """The mounted snapshot's answer (mounted.py says how); None: not from there (the parent may still know it)."""
    origin = src.own.origin(path) if src.own is not None else None
    if origin is None or (origin.in_upper and not origin.metacopy):
        return None  # new or copied up: read as usual (or the parent's, if unchanged since)
    mount = origin.layer.mount
    cat = src.mounted.catalog(mount.snapshot) if src.mounted is not None else None
    if cat is None:  # another repository: its chunk ids mean nothing here; read locally where we can
        if not mount.local_complete(origin.cat_path):
            return None
        local = mount.tree_path(origin.cat_path)
        try:
            if os.lstat(local).st_size != lst.st_size:
                return None
        except OSError:
            return None
        return LocalRead(local)
    old = src.mounted.entry(cat, mount.snapshot, origin.cat_path)
    if old is None or not old.is_reg or old.flags & FLAG_CHANGED or old.size != lst.st_size:
        return None
    if not origin.metacopy and old.mtime_ns != lst.st_mtime_ns:
        return None  # not the snapshot's file (the box's own content below the snapshot's)
    rows = src.live(cat.located_extents(old.ino))
    if rows is None:
        return None
    return Reuse(MOUNT, rows, (old.user,) if old.uid == lst.st_uid else None,
                 (old.grp,) if old.gid == lst.st_gid else None)
