"""Snapshot directories shown exactly: a mask layer between the snapshot and this box's own (issue 47).

``ogrefs run``/``shell`` show the snapshot's ``/`` over this box's ``/`` (one
overlay, this box's root as its lowest layer, for the host-owned paths and,
for a snapshot of a project directory, this box's userland). Without more,
every entry of this box shows where the snapshot has none: inside an old
snapshot's project directory this box's newer ``ckpt_005000.pt`` and
``data/extra3.bin`` (a loop that resumes from the highest-numbered
checkpoint resumed from this box's file), inside its ``/usr`` this box's
libraries of another release. The mask is a lower layer *below* the
snapshot and *above* this box's own directory, on the merged layers' tmpfs,
that overlayfs reads as it reads any lower layer:

* a directory the snapshot has, at or below one of its roots, is *opaque*
  in the mask (``trusted.overlay.opaque``): nothing of this box shows in it;
* a directory that a host-owned rule reaches into (``/etc`` for
  ``/etc/hostname``, ``/usr/lib/x86_64-linux-gnu`` for the driver's
  libraries) is not: there each entry of this box that the snapshot lacks
  and no rule keeps gets a whiteout (a 0/0 character device), a directory
  both have is opaque, and the directories a rule goes through are masked
  the same way one level down.

So this box's entries show where a rule keeps them (identity, network,
logins, the GPU driver, kernel modules) and nowhere else below the
snapshot's roots, while everything above them (``/``, ``/home`` above a
root ``/home/u/proj``) still merges. ``--merge`` leaves the mask out.

A whole box mounted at ``/`` is masked only in the directories it *owns*
(:func:`owned`): the ones its manifest names as its own work (git work
trees, checkpoint run directories, Python environments) and the
conventional data roots (``/workspace``), never a system directory, a home
directory itself, ``/home``/``/opt``/``/srv`` whole, nor what a host-path
rule keeps: this box's own system, logins and disks need their entries
there, and a newer checkpoint of this box in the snapshot's project is what
must not show.

:func:`plan` runs in the mount command before the fork (it reads this box's
tree and the catalog, as hostpaths.plan does); :func:`write` in the keeper,
on the merged layers' tmpfs, before the overlay is mounted. No state.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ogrefs.box import overlay
from ogrefs.repo.catalog import ROOT_INO

OPAQUE_XATTR = "trusted.overlay.opaque"


@dataclass(frozen=True)
class MaskEntry:
    path: str  # absolute, as the overlay shows it
    kind: str  # "opaque", "whiteout" or "dir" (a directory of the mask holding deeper entries)
    mode: int = 0o755
    uid: int = 0
    gid: int = 0


def _parts(path: str) -> list[str]:
    return [c for c in path.split("/") if c]


def _matches(pattern: list[str], comps: list[str]) -> bool:
    return all(fnmatch.fnmatchcase(c, p) for p, c in zip(pattern, comps))


@dataclass(frozen=True)
class _Rules:
    host: list[list[str]]  # every rule's pattern, split
    prefer: list[list[str]]

    def keeps(self, comps: list[str]) -> bool:
        """Whether a rule names this very path (this box's entry shows)."""
        return any(len(p) == len(comps) and _matches(p, comps) for p in self.host)

    def reaches_below(self, comps: list[str]) -> bool:
        """Whether a rule names something below this path."""
        return any(len(p) > len(comps) and _matches(p, comps) for p in self.host)

    def prefers(self, comps: list[str]) -> bool:
        return any(len(p) == len(comps) and _matches(p, comps) for p in self.prefer)


def _node(catalog: Any, comps: list[str]) -> Any:
    """The catalog's entry at ``comps`` (no symlink followed), or None."""
    node = catalog.get(ROOT_INO)
    for c in comps:
        if node is None or not node.is_dir:
            return None
        node = catalog.lookup(node.ino, os.fsencode(c))
    return node


def plan(catalog: Any, rules: Iterable[Any], roots: Iterable[str], host_root: str = "/") -> list[MaskEntry]:
    """The mask over this box's ``host_root`` for a snapshot with ``roots`` (``rules``: hostpaths.Rule)."""
    rs = list(rules)
    # every kind keeps this box's entry where the snapshot has none (a merged file, where both have one,
    # is synthesized above the snapshot and wins): a login key of this box never disappears
    r = _Rules([_parts(x.pattern) for x in rs],
               [_parts(x.pattern) for x in rs if x.kind == "prefer-host"])
    out: list[MaskEntry] = []
    done: list[list[str]] = []
    for root in sorted({"/" + "/".join(_parts(p)) for p in roots}, key=lambda p: (p.count("/"), p)):
        comps = _parts(root)
        if any(comps[:len(d)] == d for d in done):
            continue  # below a root already masked
        node = _node(catalog, comps)
        if node is not None and node.is_dir:
            done.append(comps)
            _mask_dir(catalog, node, comps, host_root, r, out)
    return out


#: Conventional data roots of rented boxes (RunPod's and vast.ai's volume): the snapshot's own where it has one.
DATA_ROOTS = ("/workspace",)
#: Directories that hold more than one owner's things (this box's own disks, tools, users): never one
#: snapshot's wholly, only the directories it owns inside them.
SHARED = ("/home", "/opt", "/srv", "/mnt", "/media")
#: A Python environment of one of these names lies in its project's directory (uv's and poetry's in-project
#: ``.venv``, ``python -m venv venv``): that directory is the snapshot's too.
IN_PROJECT_ENVS = (".venv", "venv")


@dataclass
class Owned:
    """What of a whole box mounted at / is exact (:func:`owned`)."""

    exact: list[str] = field(default_factory=list)  # outermost, each a directory of the snapshot
    left: list[tuple[str, str]] = field(default_factory=list)  # (path, why it stays merged), for the record


def candidates(environment: dict) -> list[str]:
    """The directories a manifest's environment names as the snapshot's own work: git work trees, checkpoint
    run directories, Python environments (what inspect/report.py's format_environment lists) and the project
    directory an in-project environment lies in."""
    env = environment or {}
    runs = [r.get("dir") for r in (env.get("checkpoints") or {}).get("runs") or []]
    envs = [e.get("path") for e in env.get("python_envs") or []]
    found = [*(g.get("path") for g in env.get("git") or []), *runs, *envs,
             *(os.path.dirname(p) for p in envs if isinstance(p, str) and os.path.basename(p) in IN_PROJECT_ENVS)]
    return sorted({overlay.normalized(p) for p in found if isinstance(p, str) and p.startswith("/")})


def owned(manifest: dict, catalog: Any, rules: Iterable[Any], homes: Iterable[str] = (),
          mounts: Iterable[str] = (), runs_from: Iterable[str] = ()) -> Owned:
    """The directories a whole-box snapshot owns at / (exact there), and why each other candidate is not.

    ``homes``: this box's users' home directories (their logins, keys and files stay as they are);
    ``mounts``: this box's mount points (a disk of this box mounted there stays visible); ``runs_from``: the
    directories this box's ogrefs runs from (its environment, its source: never masked under it).
    """
    r = _Rules([_parts(x.pattern) for x in rules], [])
    here = {"homes": {overlay.normalized(h) for h in homes if h and overlay.normalized(h) != "/"},
            "mounts": {overlay.normalized(m) for m in mounts},
            "ogrefs": {overlay.normalized(p) for p in runs_from if p and overlay.normalized(p) != "/"}}
    named = candidates(manifest.get("environment") or {})
    out = Owned()
    for path in sorted({*named, *DATA_ROOTS}):  # a directory sorts before what lies in it
        if any(path.startswith(o + "/") for o in out.exact):
            continue  # inside a directory already exact
        why = _not_owned(path, r, here)
        if why is None:
            node = _node(catalog, _parts(path))
            if node is None or not node.is_dir:
                if path not in named:
                    continue  # a conventional data root the snapshot does not have
                why = "not a directory in the snapshot"
        if why is None:
            out.exact.append(path)
        else:
            out.left.append((path, why))
    return out


def _not_owned(path: str, r: _Rules, here: dict[str, set[str]]) -> str | None:
    """Why ``path`` is not the snapshot's alone at / (kept merged with this box's), or None."""
    comps = _parts(path)
    if not comps:
        return "the whole box"
    if overlay.is_system(path):
        return "a system directory: this box's own system needs its entries"
    if "/" + comps[0] in overlay.NEVER + overlay.PROTECTED:
        return "never overlaid: this box's own"
    if path in SHARED:
        return "shared with this box's own directories"
    if path == "/root" or path in here["homes"] or (len(comps) == 2 and comps[0] == "home"):
        return "a home directory: this box's users keep theirs (only the snapshot's directories in it are exact)"
    inside = sorted(h for h in here["homes"] if h.startswith(path + "/"))
    if inside:
        return f"holds this box's home directory {inside[0]}"
    if path in here["mounts"]:  # (one below it is bound back over the overlay as ever: kept_below)
        return "a file system of this box is mounted there"
    mine = sorted(p for p in here["ogrefs"] if p == path or p.startswith(path + "/") or path.startswith(p + "/"))
    if mine:
        return f"this box's ogrefs runs from {mine[0]}"
    if any(r.keeps(comps[:n]) for n in range(1, len(comps) + 1)):
        return "kept from this box by a host-path rule"
    return None


def _mask_dir(catalog: Any, node: Any, comps: list[str], host_root: str, r: _Rules, out: list[MaskEntry]) -> None:
    """Mask this box's directory at ``comps`` below the snapshot's (``node``: the snapshot's, None if it has none)."""
    path = "/" + "/".join(comps)
    if r.prefers(comps):
        return  # this box's entries replace or join the snapshot's (sudoers.d): nothing masked
    if not r.reaches_below(comps):
        if node is not None:
            out.append(MaskEntry(path, "opaque"))
        return
    mine = _real_entries(os.path.join(host_root, path.lstrip("/")))
    if mine is None:
        return  # this box has no directory here: nothing of it to hide
    st, names = mine
    out.append(MaskEntry(path, "dir", stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid))
    theirs = {os.fsdecode(n): child for n, child in catalog.children(node.ino)} if node is not None else {}
    for name, is_dir in sorted(names.items()):
        child = [*comps, name]
        if r.keeps(child):
            continue  # host-owned: this box's entry shows (the FUSE view hides the snapshot's)
        snap = theirs.get(name)
        if is_dir and r.reaches_below(child) and (snap is None or snap.is_dir):
            _mask_dir(catalog, snap, child, host_root, r, out)
        elif snap is None:
            out.append(MaskEntry(f"{path.rstrip('/')}/{name}", "whiteout"))
        elif is_dir and snap.is_dir:
            _mask_dir(catalog, snap, child, host_root, r, out)  # opaque (or masked where a rule goes on)


def _real_entries(path: str) -> tuple[os.stat_result, dict[str, bool]] | None:
    """This box's directory ``path`` (a symlink not followed): its stat and {name: is a real directory}."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            return None
        with os.scandir(path) as it:
            return st, {e.name: e.is_dir(follow_symlinks=False) for e in it}
    except OSError:
        return None


def below(entries: list[MaskEntry], shows: str) -> list[MaskEntry]:
    """The entries of an overlay that shows the snapshot's ``shows`` (at /: one per root), relative to it."""
    top = shows.rstrip("/")
    return [MaskEntry(e.path[len(top):] or "/", e.kind, e.mode, e.uid, e.gid) for e in entries
            if e.path == (top or "/") or e.path.startswith(top + "/")]


def whole(entries: list[MaskEntry]) -> bool:
    """Whether an overlay's mask hides all of this box's directory (then it needs no own layer)."""
    return any(e.path == "/" and e.kind == "opaque" for e in entries)


def write(entries: list[MaskEntry], layer: Path) -> None:
    """Make the mask in the (empty) directory ``layer``, on a file system that keeps trusted xattrs (tmpfs).

    An opaque entry at ``/`` would be the layer's root, where overlayfs
    ignores it: such an overlay gets no own layer instead (:func:`whole`).
    """
    layer.mkdir(parents=True, exist_ok=True, mode=0o755)
    for e in entries:
        dest = layer / e.path.lstrip("/")
        if e.kind == "whiteout":
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.mknod(dest, stat.S_IFCHR | 0o600, os.makedev(0, 0))
            continue
        dest.mkdir(parents=True, exist_ok=True)
        if e.kind == "opaque":
            os.setxattr(dest, OPAQUE_XATTR, b"y")
        else:  # shown where the snapshot has no such directory: this box's attributes
            os.chown(dest, e.uid, e.gid)
            os.chmod(dest, e.mode)
