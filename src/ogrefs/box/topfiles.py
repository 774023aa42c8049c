"""The top-level files of a whole-box snapshot, shown at ``/`` (overlays cover directories only).

``/`` as a whole is never overlaid, so a whole-box snapshot's top-level
non-directories (a ``/README``, a ``/lib64`` symlink on an older layout)
would never appear. The keeper shows each one this box *lacks*: a symlink is
created with the snapshot's target, a regular file appears as a read-only
bind of the snapshot's file (``<state>/lower/<name>``) onto an empty
placeholder. Whatever this box has at that name stays this box's (its
``/vmlinuz``, its ``/swapfile``). ``<state>/top-files.json`` records what was
created, so teardown removes exactly that and nothing of the box.

No locks: the keeper alone calls :func:`show` and :func:`hide` for a running
mount (``unmount`` calls :func:`hide` too, after which there is nothing left).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from ogrefs.box import mountsys
from ogrefs.repo.catalog import ROOT_INO


def planned(catalog: Any) -> list[dict[str, str]]:
    """Top-level regular files and symlinks of the snapshot: ``{"name", "kind", "target"}``."""
    out = []
    for name, node in catalog.children(ROOT_INO):
        if node.is_lnk:
            out.append({"name": os.fsdecode(name), "kind": "symlink", "target": os.fsdecode(node.target or b"")})
        elif node.is_reg:
            out.append({"name": os.fsdecode(name), "kind": "file", "target": ""})
    return out


def show(entries: list[dict[str, str]], lower_root: Path, state_dir: Path, root: str = "/") -> list[str]:
    """Create what this box lacks; records it before each step; returns the paths shown."""
    done: list[dict[str, str]] = []
    shown = []
    for e in entries:
        path = os.path.join(root, e["name"])
        if os.path.lexists(path):
            continue  # this box's own stays
        rec = {**e, "path": path}
        done.append(rec)
        _save(state_dir, done)
        try:
            if e["kind"] == "symlink":
                os.symlink(e["target"], path)
            else:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444))
                mountsys.bind(str(lower_root / e["name"]), path, recursive=False, read_only=True)
        except OSError:
            _undo(rec)
            done.pop()
            _save(state_dir, done)
            continue
        shown.append(path)
    return shown


def hide(state_dir: Path) -> None:
    """Remove exactly what :func:`show` created (a file or link that is no longer ours is left alone)."""
    for rec in reversed(_load(state_dir)):
        _undo(rec)
    with contextlib.suppress(OSError):
        (state_dir / "top-files.json").unlink()


def rebind(state_dir: Path, new_lower: Path) -> None:
    """``finalize``: bind the files from the local copy instead (the FUSE lower is about to go).

    Each file shows the snapshot's bytes throughout, a kill included: the
    local copy's file is moved beneath the FUSE lower's (MOVE_MOUNT_BENEATH)
    before that one is detached; run again, a file rebound already is left,
    one with the local copy's beneath has the old one detached. Without
    MOVE_MOUNT_BENEATH (Linux before 6.5): detached, then bound (the empty
    placeholder shows for that moment).
    """
    beneath = mountsys.can_mount_beneath()
    for rec in _load(state_dir):
        if rec["kind"] == "file":
            with contextlib.suppress(OSError):
                _rebind(rec["path"], str(new_lower / rec["name"]), beneath)


def _rebind(path: str, source: str, beneath: bool) -> None:
    new, now = os.stat(source), os.stat(path)
    if (new.st_dev, new.st_ino) == (now.st_dev, now.st_ino):
        return  # rebound by a finalize that was killed later
    top = mountsys.mount_at(path)
    if top is None or not beneath:
        mountsys.umount(path, lazy=True)
        mountsys.bind(source, path, recursive=False, read_only=True)
        return
    if not any(r.id == top.parent and r.point == top.point for r in mountsys.mount_table()):
        fd = mountsys.clone_tree(source)
        try:
            mountsys.read_only_copy(fd)
            mountsys.move_beneath(fd, path)
        finally:
            os.close(fd)
    mountsys.umount(path, lazy=True)  # the FUSE lower's file: the local copy's shows


def _undo(rec: dict[str, str]) -> None:
    path = rec["path"]
    with contextlib.suppress(OSError):
        if rec["kind"] == "symlink":
            if os.readlink(path) == rec["target"]:
                os.unlink(path)
            return
        mountsys.umount(path, lazy=True)
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_size == 0:
            os.unlink(path)


def _save(state_dir: Path, recs: list[dict[str, str]]) -> None:
    tmp = state_dir / "top-files.json.tmp"
    tmp.write_text(json.dumps(recs))
    os.replace(tmp, state_dir / "top-files.json")


def _load(state_dir: Path) -> list[dict[str, str]]:
    try:
        return json.loads((state_dir / "top-files.json").read_text())
    except (OSError, ValueError):
        return []
