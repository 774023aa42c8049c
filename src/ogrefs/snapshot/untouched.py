"""Directories of the mounted snapshot that nothing has changed: their entries come from its catalog.

Walking the merged view of a box that runs from an ogrefs mount costs a FUSE
round trip through the overlay for every ``listdir``, ``lstat`` and
``listxattr`` (about 0.2 ms an entry, measured on a 24,000-file box), although most of the box is
the mounted snapshot's, unchanged.  overlayfs makes it sound not to ask:

* an entry with no counterpart in the overlay's upper directory (nor in the
  ``merged`` layer of host files, nor below a ``redirect_dir`` rename, nor at a
  host-owned path: :class:`~ogrefs.snapshot.mounted.Origin` says all of this)
  *is* the lower's entry, and the lower is the mounted snapshot (the lazy
  FUSE view of its catalog, or after ``finalize`` the local copy made from it);
* a directory with no counterpart in upper has exactly the lower's children:
  a child written, copied up or whited out would have made overlayfs create
  the directory in upper first.  When the snapshot is the overlay's lowest
  layer (:data:`~ogrefs.snapshot.mounted.LOWER_ONLY`) those are the catalog's
  children.
* With the box's own directory kept below the snapshot
  (:data:`~ogrefs.snapshot.mounted.LOWER_OVER_OWN`: a resumed box's own /usr
  under the snapshot's), the merged view is the union of two read-only
  layers, and the own one is read directly where the keeper holds it open
  (``/proc/<keeper>/fd/<n>``: mounted.py proves it is the overlay's lowest
  layer, else the walk goes through the mount).  overlayfs' rules, applied
  here: the own directory for a path exists only if every component from
  the own root down is a real directory (lstat: an own symlink ``lib64 ->
  lib`` is not a directory, merging stops at it); a name in both is the
  catalog's (the upper of the two); a directory in both is merged (the
  catalog's attributes and xattrs, the union of children, recursively); a
  catalog directory over an own non-directory is the catalog's alone.  Names
  only in own are recorded through the mount (``_record``: no FUSE round trip
  but a negative lookup).  Where the own layer has the directory too, a
  whiteout as data (a 0/0 character device, in the catalog or the own
  directory) or any ``trusted.overlay.*`` xattr on the own directory: that
  directory is listed through the mount, the kernel decides what it hides.  A catalog whiteout where the
  catalog is the directory's lowest layer (LOWER_ONLY, or no own directory
  there) hides nothing: the kernel lists its name but cannot stat it, so the
  snapshot keeps the catalog's entry, unchanged since A saved it (a docker
  ``overlay2`` tree inside the box keeps its whiteouts through the chain).

So for such a directory the snapshot takes the names, attributes, xattrs and
chunk lists from the catalog (:func:`ogrefs.repo.catalog.listing`,
three queries a directory) and sends nothing through the mount; what is still
checked for each name costs no FUSE request (the mount table, host-owned
paths, excludes).  A directory that is in upper (copied up) is listed through
the mount as before, and each child with no counterpart in upper is taken
from the catalog in the same way.

Used by the snapshot's main thread only.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from ogrefs.repo.catalog import Catalog, Inode, Listed, listing
from ogrefs.snapshot.frommount import MountedSnapshots
from ogrefs.snapshot.mounted import LOWER_ONLY, LOWER_OVER_OWN, Layer, OwnMount

#: The xattrs the FUSE view never lists (lazy/fs/vfs.py OVERLAY_XATTRS) and overlayfs hides from the merged view.
HIDDEN_XATTRS = (b"trusted.overlay.", b"user.overlay.")
#: An own directory with one of these is overlayfs metadata (opaque, redirect, xattr whiteouts): not merged here.
OVERLAY_XATTR_PREFIXES = ("trusted.overlay.", "user.overlay.")
_WHITEOUT = object()  # an own directory holding a whiteout or overlay metadata: list it through the mount


def is_whiteout(node: Inode) -> bool:
    """A 0/0 character device: what overlayfs takes for a whiteout in any layer."""
    return stat.S_ISCHR(node.mode) and node.rdev == 0


@dataclass(frozen=True)
class KnownDir:
    """A directory of the merged view as the mounted snapshot's catalog (and the own layer below it) have it."""

    entries: dict[bytes, Listed]  # the catalog's children, by name (in name order)
    complete: bool  # no counterpart in upper: these (and ``own``) ARE its children, no listdir needed
    snapshot: str
    cat: Catalog
    mount: OwnMount
    cat_path: bytes  # the directory's path in the catalog
    own: dict[bytes, bool] = field(default_factory=dict)  # the own layer's children below it: name -> is a dir
    #: The own layer has a directory here, so a catalog whiteout is a real whiteout hiding one of its names.
    #: Where the catalog's is the lowest layer of the directory, the kernel lists a whiteout but cannot stat
    #: it: the snapshot keeps the catalog's entry (the data A saved, unchanged since), never a gap.
    whiteouts_hide: bool = False
    ino: int = 0  # the directory's inode in ``cat``

    def names(self) -> list[bytes]:
        """The merged directory's names: the catalog's and the own layer's."""
        return sorted(self.entries.keys() | self.own.keys()) if self.own else list(self.entries)


class UntouchedDirs:
    """Answers, per directory of the walk, what the mounted snapshot's catalog knows of it."""

    def __init__(self, own, mounted: MountedSnapshots) -> None:
        self._own = own  # mounted.OwnMounts or None
        self._mounted = mounted
        self._own_dirs: dict[tuple[bytes, bytes], bool] = {}  # (target, rel): a real directory in the own layer
        self._last: tuple[tuple[bytes, int | None], KnownDir | None] | None = None

    def known_dir(self, path: bytes, cat_ino: int | None = None) -> KnownDir | None:
        """The catalog's view of directory ``path`` (``cat_ino``: its catalog inode, when known), or None.

        The last answer is kept: ``--exclude-if-present`` asks for a directory just before the walk lists it.
        """
        if self._last is not None and self._last[0] == (path, cat_ino):
            return self._last[1]
        kd = self._known_dir(path, cat_ino)
        self._last = ((path, cat_ino), kd)
        return kd

    def _known_dir(self, path: bytes, cat_ino: int | None) -> KnownDir | None:
        layer = self._own.layer_of(path) if self._own is not None else None
        if layer is None or layer.lowers not in (LOWER_ONLY, LOWER_OVER_OWN):
            return None  # asked first: the origin costs syscalls on the upper directory
        origin = layer.origin(path)
        if origin is None:
            return None
        snap = origin.layer.mount.snapshot
        cat = self._mounted.catalog(snap)
        if cat is None:
            return None  # another repository: its chunk ids mean nothing here
        if cat_ino is None:
            node = cat.resolve(origin.cat_path)
            if node is None or not node.is_dir:
                return None
            cat_ino = node.ino
        entries = {e.name: e for e in listing(cat, cat_ino)}
        hides = layer.lowers == LOWER_OVER_OWN and self._own_dir_exists(layer, path)
        complete = not origin.in_upper and not (hides and any(is_whiteout(e.node) for e in entries.values()))
        own: dict[bytes, bool] = {}
        if complete and hides:
            listed_own = self._own_children(layer, path)
            if listed_own is _WHITEOUT:
                complete = False  # listed through the mount: the kernel decides what a whiteout hides
            else:
                own = listed_own  # type: ignore[assignment]
        return KnownDir(entries, complete, snap, cat, origin.layer.mount, origin.cat_path, own, hides, cat_ino)

    def _own_dir_exists(self, layer: Layer, path: bytes) -> bool:
        """Whether the own layer has a real directory at ``path`` (every component one, never a symlink)."""
        rel = layer.rel(path)
        return rel is not None and self._own_is_dir(layer, rel)

    def _own_children(self, layer: Layer, path: bytes) -> dict[bytes, bool] | object:
        """The own layer's children of ``path`` (name -> a real directory); {} where it has no directory there."""
        rel = layer.rel(path)
        if rel is None or not self._own_is_dir(layer, rel):
            return {}
        where = layer.own_root + rel  # type: ignore[operator]
        try:
            if any(n.startswith(OVERLAY_XATTR_PREFIXES) for n in os.listxattr(where, follow_symlinks=False)):
                return _WHITEOUT
            out = {}
            with os.scandir(where) as it:
                for e in it:
                    is_dir = e.is_dir(follow_symlinks=False)
                    if not is_dir and not e.is_file(follow_symlinks=False) and not e.is_symlink():
                        st = e.stat(follow_symlinks=False)
                        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                            return _WHITEOUT
                    out[e.name] = is_dir
                    self._remember(layer.target, rel + b"/" + e.name, is_dir)
        except OSError:
            return _WHITEOUT  # unreadable: the mount is asked instead
        return out

    def _own_is_dir(self, layer: Layer, rel: bytes) -> bool:
        """Whether every component of ``rel`` below the own root is a real directory (never a symlink)."""
        if not rel:
            return True  # the root itself: the keeper's descriptor of a directory (records.own_layer_root)
        hit = self._own_dirs.get((layer.target, rel))
        if hit is None:
            hit = self._own_is_dir(layer, os.path.dirname(rel) if os.path.dirname(rel) != b"/" else b"")
            if hit:
                try:
                    hit = stat.S_ISDIR(os.lstat(layer.own_root + rel).st_mode)  # type: ignore[operator]
                except OSError:
                    hit = False
            self._remember(layer.target, rel, hit)
        return hit

    def _remember(self, target: bytes, rel: bytes, is_dir: bool) -> None:
        if len(self._own_dirs) > 200_000:
            self._own_dirs.clear()
        self._own_dirs[(target, rel)] = is_dir

    def entry(self, kd: KnownDir, name: bytes, path: bytes) -> Listed | None:
        """The catalog's entry for child ``name`` (at ``path``) if it is what the merged view shows there."""
        listed = kd.entries.get(name)
        if listed is None or (kd.whiteouts_hide and is_whiteout(listed.node)):
            return None  # only in the own layer, or a whiteout over it: what the merged view shows is the mount's
        if kd.complete:  # nothing in upper or merged below this directory; host-owned paths are per path
            return None if kd.mount.is_host_owned(kd.cat_path.rstrip(b"/") + b"/" + name) else listed
        origin = self._own.origin(path) if self._own is not None else None
        return listed if (origin is not None and not origin.in_upper
                          and origin.layer.lowers in (LOWER_ONLY, LOWER_OVER_OWN)) else None

    def known_names(self, path: bytes, node: Inode, submount: bool) -> frozenset[bytes] | tuple | None:
        """A catalog entry's names for ``--exclude-if-present``, known without asking the mount, or None.

        A non-directory has none; a directory the walk will take whole from the catalog (and the own layer)
        has the names it will list (:meth:`known_dir` keeps that answer for the walk that follows); a mount
        point (``submount``) is its own file system: None.
        """
        if not node.is_dir:
            return ()
        if submount:
            return None
        kd = self.known_dir(path, node.ino)
        return frozenset(kd.names()) if kd is not None and kd.complete else None

    @staticmethod
    def xattrs(listed: Listed) -> list[tuple[bytes, bytes]]:
        return visible_xattrs(listed.xattrs)


def visible_xattrs(items: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A catalog entry's xattrs as the merged view shows them (overlayfs' own hidden)."""
    return [(n, v) for n, v in items if not n.startswith(HIDDEN_XATTRS)]
