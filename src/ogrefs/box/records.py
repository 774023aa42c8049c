"""What ogrefs' mounts record on this box, for readers outside the mount.

A mount registers itself under the runtime directory (``/run/ogrefs/mounts/<key>.json``,
its status beside it) and keeps the overlays it mounted in ``<state>/overlays.json``.
``mount/`` writes these records (the daemon writes the registration and status, the
keeper completes the registration once, ``unmount``/``finalize`` update overlays.json);
``snapshot/`` (a box running from a mount), ``agent/`` and ``ogrefs mounts`` only read
them, with one exception: a snapshot of a box running from a writable mount leaves
``<state>/snapshot-started`` (:func:`mark_snapshot_started`), which the daemon's access-trace
recorder reads (``lazy/trace/recorder.py``: a snapshot marks the end of the resume), and
``<state>/snapshot-running.<pid>`` for as long as it runs (:func:`mark_snapshot_running`),
which makes the daemon's background fetches wait (``lazy/background/snapshotgate.py``). So the records'
format lives here, below every layer that reads it, and reading
them needs nothing of the mount machinery. No locks: every write is an atomic rename.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ogrefs.errors import OgrefsError


class MountError(OgrefsError):
    """The mount could not be made, found or undone."""


@dataclass(frozen=True)
class Overlay:
    target: str  # where it is mounted
    lower: str  # the snapshot's directory inside the FUSE mount
    upper: str
    work: str
    keep_existing: bool  # the target's previous content is the lowest layer
    merged: str | None = None  # a layer of host files synthesized for this box (hostpaths.py), topmost
    mask: str | None = None  # with keep_existing: the layer between snapshot and own that hides the own (exact.py)
    binds: tuple = ()  # the box's directories bound back on top of this overlay (submounts, ogrefs' own)
    host_dir: str | None = None  # with keep_existing: this box's directory below the snapshot (default: target)
    #: The keeper's O_PATH descriptor of the box's own directory below this overlay (its lowest layer, or
    #: without one the directory it covers), opened just before this overlay was mounted and held for the
    #: keeper's life, the directory's (st_dev, st_ino), and the overlay's mount id (mountinfo's first field)
    #: right after mount(2). A reader opens ``/proc/<keeper_pid>/fd/<own_fd>`` to see the own layer the
    #: overlay covers (snapshot/mounted.py; only where the options name it), finalize to reach the FUSE
    #: lower mounted below it (mount/client.py).
    own_fd: int | None = None
    own_dev: int | None = None
    own_ino: int | None = None
    mount_id: int | None = None


def unescape_mountinfo(field: str) -> str:
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


# -- registration ------------------------------------------------------------------------------
def runtime_dir() -> Path:
    env = os.environ.get("OGREFS_RUNTIME_DIR")
    candidates = [Path(env)] if env else [Path("/run/ogrefs")]
    if not env:
        if os.environ.get("XDG_RUNTIME_DIR"):
            candidates.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "ogrefs")
        from ogrefs.repo import default_cache_dir

        candidates.append(default_cache_dir() / "run")
    for cand in candidates:
        try:
            (cand / "mounts").mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError:
            continue
        if os.access(cand / "mounts", os.W_OK):
            return cand
    raise MountError(f"no writable runtime directory (tried {', '.join(map(str, candidates))})")


def mountpoint_key(mountpoint: Path) -> str:
    return hashlib.sha256(os.fsencode(os.path.abspath(mountpoint))).hexdigest()[:24]


@dataclass(frozen=True)
class Registration:
    path: Path
    status: Path
    log: Path

    @classmethod
    def for_mountpoint(cls, mountpoint: Path) -> "Registration":
        base = runtime_dir() / "mounts" / mountpoint_key(mountpoint)
        return cls(base.with_suffix(".json"), base.with_suffix(".status.json"), base.with_suffix(".log"))

    def read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def write(self, info: dict[str, Any]) -> None:
        atomic_json(self.path, info)

    def write_status(self, status: dict[str, Any]) -> bool:
        """Rewrite the status file, unless the registration names a daemon other than ``status['pid']``: then
        False, and nothing written. A daemon that outlives its unmount (another mount namespace holds a copy
        of its FUSE mount, so the kernel never ends its session) would otherwise rewrite, every half second,
        the status of a new mount at the same mountpoint, and ``ogrefs status`` would name the old daemon."""
        info = self.read()
        if info is not None and info.get("pid") != status.get("pid"):
            return False
        atomic_json(self.status, status)
        return True

    def remove(self) -> None:
        for p in (self.path, self.status):
            with contextlib.suppress(OSError):
                p.unlink()

    def remove_if_daemon(self, pid: int) -> None:
        """Remove the registration if it is still daemon ``pid``'s: a lazily unmounted daemon that exits
        late must not remove the registration of a new mount at the same mountpoint."""
        info = self.read()
        if info is None or info.get("pid") == pid:
            self.remove()


def registered_mounts() -> list[dict[str, Any]]:
    """Every mount registered on this box (each registration's info, as the daemon or finalize wrote it).

    For readers outside the mount (``ogrefs snapshot`` recognising the box's own
    mounts: see mounted.py); entries may be stale, so callers check what they rely on.
    """
    try:
        paths = sorted((runtime_dir() / "mounts").glob("*.json"))
    except MountError:
        return []
    out = []
    for p in paths:
        if p.name.endswith(".status.json"):
            continue
        info = Registration(p, p.with_suffix(".status.json"), p.with_suffix(".log")).read()
        if isinstance(info, dict):
            out.append(info)
    return out


def writable_state(info: dict[str, Any]) -> dict[str, Any] | None:
    """What a writable mount is made of, for readers outside it (``ogrefs snapshot`` of a box running
    from a mount, ``ogrefs mounts``); ``info`` is one of :func:`registered_mounts`. None if not writable.

    Keys: ``snapshot``, ``repo``, ``target``, ``state_dir``, ``tree`` (the local copy),
    ``finalized``, ``pid`` (daemon), ``keeper_pid``, ``died`` (the daemon was killed; the keeper
    detached the overlays), ``overlays`` (each: ``target``, ``lower``, ``upper``, ``work``,
    ``merged`` — a layer of host files synthesized above the snapshot —, ``binds`` — this box's
    directories bound back on top —, ``host_dir``, and ``own_fd``, ``own_dev``, ``own_ino``,
    ``mount_id``: the keeper's descriptor of the box's own directory below (the lowest layer, or the
    directory covered), its identity, and the overlay's mount id as mounted; None where another process
    mounted it), ``keeper_start`` (the keeper's
    start time, :func:`process_start`: with ``keeper_pid`` it names one process),
    ``host_owned`` (snapshot paths the FUSE view
    hides, so this box's own file shows at that path: never the snapshot's entry), ``skipped``.
    """
    state = info.get("state_dir")
    if not info.get("writable") or not isinstance(state, str):
        return None
    try:
        overlays = load_overlays(Path(state))
    except OgrefsError:
        overlays = []
    kept = info.get("host_kept") or []
    return {"snapshot": info.get("snapshot"), "repo": info.get("repo"), "target": info.get("mountpoint"),
            "state_dir": state, "tree": str(Path(state) / "tree"), "finalized": bool(info.get("finalized")),
            "pid": info.get("pid"), "keeper_pid": info.get("keeper_pid"), "keeper_start": info.get("keeper_start"),
            "died": bool(info.get("died")),
            "overlays": [{"target": o.target, "lower": o.lower, "upper": o.upper, "work": o.work,
                          "merged": o.merged, "binds": list(o.binds), "host_dir": o.host_dir, "own_fd": o.own_fd,
                          "own_dev": o.own_dev, "own_ino": o.own_ino, "mount_id": o.mount_id} for o in overlays],
            "host_owned": [p for p in kept if not p.endswith(" (merged)")], "skipped": info.get("skipped") or []}


def atomic_json(path: Path, obj: Any) -> None:
    _atomic_text(path, json.dumps(obj, sort_keys=True))


def _atomic_text(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never a part (a temporary file renamed over it)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot: with the pid it names one process); None if none lives."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 20 or fields[0] in (b"Z", b"X") or not fields[19].isdigit():
        return None
    return int(fields[19])


def save_overlays(overlays: list[Overlay], state_dir: Path) -> None:
    """Record what is mounted; none is no file, which takes no space: an unmount on a full state disk
    records it too (a half-written temporary file is removed, the old list stays whole)."""
    path = state_dir / "overlays.json"
    if not overlays:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps([asdict(o) for o in overlays], indent=1))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def load_overlays(state_dir: Path) -> list[Overlay]:
    try:
        rows = json.loads((state_dir / "overlays.json").read_text())
        return [Overlay(**{**o, "binds": tuple(o.get("binds") or ())}) for o in rows]
    except FileNotFoundError:
        return []
    except (ValueError, TypeError) as exc:
        raise OgrefsError(f"{state_dir}/overlays.json is damaged ({exc})") from None


SNAPSHOT_STARTED = "snapshot-started"


def mark_snapshot_started(state_dir: Path) -> None:
    """Say in a writable mount's state directory that a snapshot of the box starts now (``time.monotonic()``).

    An OSError (a state directory this process may not write) is the caller's to ignore: the mark only
    helps the mount's access trace.
    """
    _atomic_text(state_dir / SNAPSHOT_STARTED, repr(time.monotonic()))


def snapshot_started(state_dir: Path) -> float | None:
    """When the newest snapshot of the box started (:func:`mark_snapshot_started`), or None. Blocking (a read)."""
    try:
        return float((state_dir / SNAPSHOT_STARTED).read_text())
    except (OSError, ValueError):
        return None


def clear_snapshot_started(state_dir: Path) -> None:
    """A new mount of the state directory: an earlier mount's (or boot's) mark means nothing to it.

    Best effort: a mark left in place is ignored anyway when its time is not within the recording.
    """
    with contextlib.suppress(OSError):
        (state_dir / SNAPSHOT_STARTED).unlink()


def state_base() -> Path:
    """Where writable mounts keep their state directories by default (``ogrefs mounts`` lists them)."""
    return Path(os.environ.get("OGREFS_STATE_DIR") or "/var/lib/ogrefs/mounts")


SNAPSHOT_RUNNING = "snapshot-running."


def mark_snapshot_running(state_dir: Path) -> Path:
    """Say in a writable mount's state directory that this process snapshots the box now; returns the mark.

    The caller removes it when the snapshot ends (:func:`clear_snapshot_running`); a mark left by a
    process that died is ignored (its pid and start time no longer match). OSError is the caller's to
    ignore: the mark only lets the mount's background work give the snapshot the box's CPU and disk.
    A pid alone could be a new process's after the snapshot's died; with its start time it cannot.
    """
    pid = os.getpid()
    mark = state_dir / f"{SNAPSHOT_RUNNING}{pid}"
    _atomic_text(mark, str(process_start(pid)))
    return mark


def clear_snapshot_running(mark: Path) -> None:
    """The snapshot that wrote ``mark`` ended (saved or not). Best effort: a mark left behind is a dead process's."""
    with contextlib.suppress(OSError):
        mark.unlink()


def snapshot_running(state_dir: Path) -> bool:
    """Whether a live process is snapshotting the box that runs from this state directory. Blocking (a listing)."""
    try:
        names = os.listdir(state_dir)
    except OSError:
        return False
    for name in names:
        if not name.startswith(SNAPSHOT_RUNNING):
            continue
        try:
            pid = int(name[len(SNAPSHOT_RUNNING):])
            ticks = int((state_dir / name).read_text())
        except (OSError, ValueError):
            continue
        if process_start(pid) == ticks:
            return True
    return False


def own_layer_root(ws: dict, o: dict, mount_id: int | None) -> bytes | None:
    """``/proc/<keeper>/fd/<n>``: the box's own directory below overlay ``o``, or None unless all of this holds.

    The keeper opened that descriptor of the own directory immediately before it mounted the overlay and
    holds it for its life (overlay.mount_one ``hold_own``), so it is the directory the overlay's lowest layer
    was resolved to, when: the mount is not finalized (then the lowers are the local copy and the walk
    through the overlay is cheap); the keeper is the same process (pid and start time); the overlay mounted
    at the target now is the one it mounted (``mount_id``); and the descriptor is still that directory
    (``own_dev``/``own_ino``). Anything missing, different or unreadable: None, never a guess.
    """
    pid, start, fd = ws.get("keeper_pid"), ws.get("keeper_start"), o.get("own_fd")
    if ws.get("finalized") or not all(isinstance(v, int) for v in (pid, start, fd, mount_id)):
        return None
    if o.get("mount_id") != mount_id or process_start(pid) != start:
        return None
    root = f"/proc/{pid}/fd/{fd}"
    try:
        st = os.stat(root)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) != (o.get("own_dev"), o.get("own_ino")):
        return None
    if process_start(pid) != start:  # the pid was reused while we looked: its descriptor is not the keeper's
        return None
    return os.fsencode(root)
