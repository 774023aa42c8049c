"""The local state of mounts, for people: what ``ogrefs mounts`` lists and removes.

A writable mount keeps a state directory (upper dirs with its writes, the
local copy ``tree/``, fetch state) that outlives the mount: mounting again
resumes from it. Read-only mounts have none, only their registration and the
shared chunk cache. This module joins the registry (mount.registered_mounts)
with the state directories found under mount.state_base(), measures them,
and removes a state directory only when nothing uses it: no live daemon, no
mount.lock held, nothing mounted from inside it. Runs in the calling thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ogrefs.box.records import load_overlays, pid_alive, registered_mounts, state_base, unescape_mountinfo
from ogrefs.errors import UsageError


@dataclass
class MountState:
    state: str  # mounted, finalized, unmounted (state kept), or dead (daemon gone, registration left)
    writable: bool
    target: str | None
    snapshot: str | None
    state_dir: str | None
    pid: int | None = None
    sizes: dict[str, int] = field(default_factory=dict)  # bytes on disk: tree, upper, other; cache
    in_place: bool = False  # a no-FUSE mount: the snapshot written onto this box's disk (nothing mounted)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def disk_usage(path: Path) -> int:
    """Bytes allocated below ``path``, on its own file system only (never into the FUSE lower or other mounts)."""
    try:
        root_dev = os.lstat(path).st_dev
    except OSError:
        return 0
    total = 0
    for top, dirs, files in os.walk(path):
        with contextlib.suppress(OSError):
            total += os.lstat(top).st_blocks * 512
        keep = []
        for d in dirs:
            with contextlib.suppress(OSError):
                if os.lstat(os.path.join(top, d)).st_dev == root_dev:
                    keep.append(d)
        dirs[:] = keep
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(top, f)).st_blocks * 512
    return total


def _state_sizes(state: Path) -> dict[str, int]:
    sizes = {"tree": disk_usage(state / "tree"), "upper": disk_usage(state / "upper")}
    sizes["total"] = disk_usage(state)
    return sizes


def _live(info: dict[str, Any]) -> bool:
    return bool(info.get("pid")) and pid_alive(int(info["pid"]))


def list_mounts() -> list[MountState]:
    """Every registered mount and every state directory, each once."""
    out: list[MountState] = []
    seen_states: set[str] = set()
    for info in registered_mounts():
        state_dir = info.get("state_dir")
        state = "finalized" if info.get("finalized") else ("mounted" if _live(info) else "dead")
        if info.get("in_place"):  # nothing is mounted: the copy is complete, going on, or stopped
            state = {"finalized": "in place", "mounted": "copying", "dead": "stopped"}[state]
        ms = MountState(state, bool(info.get("writable")), info.get("mountpoint"), info.get("snapshot"), state_dir,
                        info.get("pid") if state in ("mounted", "copying") else None,
                        in_place=bool(info.get("in_place")))
        if state_dir:
            seen_states.add(os.path.abspath(state_dir))
            ms.sizes = _state_sizes(Path(state_dir))
        if info.get("chunk_cache"):
            ms.sizes["cache"] = disk_usage(Path(info["chunk_cache"]))
        out.append(ms)
    base = state_base()
    with contextlib.suppress(OSError):
        for entry in sorted(base.iterdir()):
            if entry.is_dir() and os.path.abspath(entry) not in seen_states:
                out.append(MountState("unmounted", True, _overlay_target(entry), _snapshot_of(entry), str(entry),
                                      sizes=_state_sizes(entry)))
    return out


def _overlay_target(state: Path) -> str | None:
    try:
        targets = [o.target for o in load_overlays(state)]
    except Exception:  # a damaged overlays.json still leaves a listable state
        return None
    return ", ".join(targets) or None


def _snapshot_of(state: Path) -> str | None:
    """The snapshot id prefix in the default state directory name (``<16 hex>-<target key>``)."""
    head = state.name.split("-", 1)[0]
    return head if len(head) == 16 and all(c in "0123456789abcdef" for c in head) else None


def remove_state(which: str) -> Path:
    """Delete the state directory ``which`` names (its path, or the target of its mount) if nothing uses it."""
    states = [m for m in list_mounts() if m.state_dir]
    path = os.path.abspath(which)
    hits = [m for m in states if os.path.abspath(m.state_dir) == path] or \
        [m for m in states if m.target and path in [os.path.abspath(t.strip()) for t in m.target.split(",")]]
    if not hits:
        raise UsageError(f"{which} is neither a mount state directory nor the target of one (see `ogrefs mounts`)")
    if len({m.state_dir for m in hits}) > 1:
        raise UsageError(f"{which} is the target of several state directories: name one of them")
    m = hits[0]
    state = Path(m.state_dir)
    if m.state in ("mounted", "finalized", "copying"):
        raise UsageError(f"{state} belongs to a live mount at {m.target} ({m.state}); "
                         f"`ogrefs unmount {m.target}` first")
    if _lock_held(state) or _mounted_inside(state):
        raise UsageError(f"{state} is in use (a mount still holds it); `ogrefs unmount {m.target}` first")
    shutil.rmtree(state)
    return state


def _lock_held(state: Path) -> bool:
    try:
        fd = os.open(state / "mount.lock", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _mounted_inside(state: Path) -> bool:
    """Anything mounted inside the state directory, or an overlay whose layers live in it."""
    prefix = os.path.abspath(state) + "/"
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) >= 5 and (unescape_mountinfo(fields[4]) + "/").startswith(prefix):
                return True
            if prefix in right:  # overlayfs options name their upper/work dirs
                return True
    return False
