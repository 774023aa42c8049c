"""ogrefs' own writable mounts on this box, as a snapshot sees them.

A box resumed with ``ogrefs mount SNAP /`` runs from overlays: each overlay's
lower layer is the mounted snapshot (the lazy FUSE mount, or after
``finalize`` the local copy), its upper directory holds everything written
since.  An entry with nothing in the upper directory is still the snapshot's
own, so a new snapshot can take its catalog entry and chunk list as they are
(snapshot.py), without reading it and without a single fetch.

This module is the one place that depends on the mount's state; what it reads:

* the mount registry, through its documented accessor
  (:func:`ogrefs.box.records.writable_state` of each :func:`~ogrefs.box.records.registered_mounts`):
  ``snapshot``, ``repo``, ``state_dir``, ``finalized``, ``host_owned`` (paths
  where this box's own file shows: never the snapshot's entry) and each
  overlay's ``target``, ``lower``, ``upper`` and ``merged`` (host files shown
  above the snapshot: never the snapshot's);
  the lower is ``<state>/lower<catalog path>`` (``<state>/tree<catalog path>``
  after finalize), so the catalog path shown at the target is the lower's tail;
* ``<state>/tree<catalog path>``: the local copy, and which of its files
  hold all their data, under every name of a hard link (the plan's owner,
  :func:`ogrefs.box.copyplan.complete_paths_at`, reads that; finalized: all of them).

Overlay semantics come from the kernel: the snapshot walks the merged view, so
whiteouts (a 0/0 character device or the xattr form) are simply absent and an
opaque directory shows only what is above it.  What this module answers is,
for a path seen in the merged view, whether the upper directory has it (a new
file, a copy-up, a metadata-only copy-up) and where in the snapshot it came
from.  A directory renamed with overlayfs ``redirect_dir`` makes everything
below it "unknown origin" (read as usual).

No threads, no locks: owned by the snapshotting thread.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field

from ogrefs.box.copyplan import complete_paths_at
from ogrefs.box.records import own_layer_root, registered_mounts, writable_state
from ogrefs.snapshot.walk import mount_table

XATTR_METACOPY = "trusted.overlay.metacopy"
XATTR_REDIRECT = "trusted.overlay.redirect"


@dataclass
class OwnMount:
    """One writable ogrefs mount of this box."""

    snapshot: str
    repo_url: str
    state_dir: bytes
    finalized: bool
    status_path: str | None
    host_owned: frozenset[bytes] = frozenset()  # catalog paths hidden by the mount: this box's own file shows
    layers: list["Layer"] = field(default_factory=list)
    _complete: set[bytes] | None = None

    def is_host_owned(self, cat_path: bytes) -> bool:
        """``cat_path`` or a directory above it is host-owned (a whole ``/lib/modules`` is this box's)."""
        if not self.host_owned:
            return False
        p = cat_path
        while True:
            if p in self.host_owned:
                return True
            if p in (b"/", b""):
                return False
            p = os.path.dirname(p)

    def tree_path(self, cat_path: bytes) -> bytes:
        return self.state_dir + b"/tree" + cat_path

    def local_complete(self, cat_path: bytes) -> bool:
        """Whether the local copy of regular file ``cat_path`` holds all its data."""
        if self._complete is None:
            self._complete = self._load_complete()
        return self.finalized or cat_path in self._complete

    def _load_complete(self) -> set[bytes]:
        return complete_paths_at(os.fsdecode(self.state_dir + b"/materialize.sqlite"))


@dataclass(frozen=True)
class Origin:
    """Where an entry seen at a layer's target comes from."""

    layer: "Layer"
    cat_path: bytes  # its path in the mounted snapshot's catalog
    in_upper: bool  # the upper directory has it (new, copied up, or metadata-only copy-up)
    metacopy: bool  # a metadata-only copy-up: the data is still the snapshot's


@dataclass
class Layer:
    """One overlay of an own mount: ``target`` shows catalog path ``prefix`` over ``upper``."""

    target: bytes
    upper: bytes
    prefix: bytes  # b"" for the catalog's root
    mount: OwnMount
    merged: bytes | None = None  # host files synthesized above the snapshot (hostpaths.py)
    #: What the overlay's lower layers are, as mounted now (:func:`classify_lowers`): ``LOWER_ONLY`` the
    #: snapshot (and ``merged`` above it) only, so a directory with nothing in upper or merged holds exactly
    #: the catalog's children; ``LOWER_OVER_OWN`` the same over the box's own directory, proven to be the one
    #: readable at ``own_root``, so such a directory holds the catalog's children and the own directory's
    #: (snapshot/untouched.py); ``UNKNOWN`` anything else: the walk goes through the mount.
    lowers: str = "unknown"
    #: With ``LOWER_OVER_OWN``: ``/proc/<keeper>/fd/<n>``, the box's own directory below the snapshot's.
    own_root: bytes | None = None
    _redirected: dict[bytes, bool] = field(default_factory=dict)

    @property
    def lower_only(self) -> bool:
        return self.lowers == LOWER_ONLY

    def rel(self, path: bytes) -> bytes | None:
        """``path`` relative to the target (b"" for the target itself, else b"/..."); None if not below it."""
        rel = path[len(self.target):] if self.target != b"/" else path
        if rel == b"/" and self.target == b"/":
            return b""
        return rel if not rel or rel.startswith(b"/") else None

    def origin(self, path: bytes) -> Origin | None:
        """Where ``path`` (below or at ``target``) comes from; None when it cannot be known."""
        rel = self.rel(path)
        if rel is None:
            return None
        if self._below_redirect(os.path.dirname(rel) if rel else b""):
            return None
        cat_path = (self.prefix + rel) or b"/"
        if self.mount.is_host_owned(cat_path):
            return None  # the box's own file shows here, never the snapshot's entry
        if self.merged is not None and os.path.lexists(self.merged + rel):
            return None  # a host file shown above the snapshot's: not the snapshot's entry
        try:
            ust = os.lstat(self.upper + rel)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                return Origin(self, cat_path, False, False)
            return None
        meta = False
        if stat.S_ISREG(ust.st_mode):
            xattrs = _xattr_names(self.upper + rel)
            meta = XATTR_METACOPY in xattrs and XATTR_REDIRECT not in xattrs
        return Origin(self, cat_path, True, meta)

    def _below_redirect(self, rel_dir: bytes) -> bool:
        """Whether a directory at or above ``rel_dir`` was renamed (overlayfs redirect_dir)."""
        if not rel_dir or rel_dir == b"/":
            return False
        hit = self._redirected.get(rel_dir)
        if hit is None:
            hit = (XATTR_REDIRECT in _xattr_names(self.upper + rel_dir)) or self._below_redirect(
                os.path.dirname(rel_dir))
            if len(self._redirected) > 100_000:
                self._redirected.clear()
            self._redirected[rel_dir] = hit
        return hit


def _xattr_names(path: bytes) -> set[str]:
    try:
        return set(os.listxattr(path, follow_symlinks=False))
    except OSError:
        return set()


def own_mounts() -> list[OwnMount]:
    """The writable ogrefs mounts of this box whose overlays are mounted now (in this mount namespace)."""
    table = mount_table()
    out = []
    for info in registered_mounts():
        ws = writable_state(info)
        if ws is None or not isinstance(ws.get("snapshot"), str):
            continue
        m = OwnMount(ws["snapshot"], str(ws.get("repo") or ""), os.fsencode(ws["state_dir"]), ws["finalized"],
                     info.get("status"), host_owned=frozenset(os.fsencode(p) for p in ws.get("host_owned") or []))
        for o in ws["overlays"]:
            target = os.fsencode(os.path.normpath(o["target"]))
            mp = table.get(target)
            if mp is None or mp.fstype != "overlay":
                continue  # not mounted now (a stale registration, or another namespace)
            lower = os.fsencode(o["lower"])
            for root in (m.state_dir + b"/lower", m.state_dir + b"/tree"):
                if lower == root or lower.startswith(root + b"/"):
                    merged = os.fsencode(o["merged"]) if o.get("merged") else None
                    lowers = classify_lowers(mp.options, lower, merged, os.fsencode(o.get("host_dir") or o["target"]),
                                             o.get("own_fd"))
                    own_root = own_layer_root(ws, o, mp.mount_id) if lowers == LOWER_OVER_OWN else None
                    if lowers == LOWER_OVER_OWN and own_root is None:
                        lowers = UNKNOWN  # the own layer cannot be proven readable: walk through the mount
                    m.layers.append(Layer(target, os.fsencode(o["upper"]), lower[len(root):], m, merged,
                                          lowers, own_root))
                    break
        if m.layers:
            out.append(m)
    return out


LOWER_ONLY, LOWER_OVER_OWN, UNKNOWN = "lower_only", "lower_over_own", "unknown"


def classify_lowers(options: str, lower: bytes, merged: bytes | None, own: bytes, own_fd: object = None) -> str:
    """What an overlay's mount options name as its lower layers: exactly ``[merged:]lower`` (LOWER_ONLY),
    exactly ``[merged:]lower:own`` (LOWER_OVER_OWN: the box's own directory lowest; named by the keeper's
    descriptor ``/proc/self/fd/<own_fd>`` where a user controls a step of its path, box/overlay.py), or
    anything else."""
    want = os.fsdecode(lower if merged is None else merged + b":" + lower)
    got = [opt[len("lowerdir="):] for opt in options.split(",") if opt.startswith("lowerdir=")]
    if got == [want]:
        return LOWER_ONLY
    by_fd = isinstance(own_fd, int) and got == [f"{want}:/proc/self/fd/{own_fd}"]
    if got == [want + ":" + os.fsdecode(own)] or by_fd:
        return LOWER_OVER_OWN
    return UNKNOWN


class OwnMounts:
    """The own mounts' layers, by target: which layer a path is under."""

    def __init__(self, mounts: list[OwnMount]) -> None:
        self.mounts = mounts
        self._layers = sorted((la for m in mounts for la in m.layers), key=lambda la: len(la.target),
                              reverse=True)

    @property
    def targets(self) -> frozenset[bytes]:
        return frozenset(la.target for la in self._layers)

    @property
    def state_dirs(self) -> list[bytes]:
        return [m.state_dir for m in self.mounts]

    def origin(self, path: bytes) -> Origin | None:
        la = self.layer_of(path)
        return la.origin(path) if la is not None else None

    def layer_of(self, path: bytes) -> Layer | None:
        """The innermost layer whose target holds ``path``."""
        for la in self._layers:
            if path == la.target or la.target == b"/" or path.startswith(la.target + b"/"):
                return la
        return None

    def covering(self, roots: list[bytes]) -> OwnMount | None:
        """The own mount whose layers hold the most of ``roots`` (the snapshot the box runs from)."""
        best, hits = None, 0
        for m in self.mounts:
            n = sum(1 for r in roots for la in m.layers
                    if r == la.target or r.startswith(la.target.rstrip(b"/") + b"/") or
                    la.target.startswith(r.rstrip(b"/") + b"/"))
            if n > hits:
                best, hits = m, n
        return best
