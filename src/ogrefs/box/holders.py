"""Who keeps a mount busy: the processes whose working directory, root, program or open files are on it.

``umount(2)`` without MNT_DETACH fails with EBUSY while any process has a
reference into the mount. On a whole box mounted at ``/``, every program
started after the mount runs from the ``/usr`` overlay, including the shell
that types ``ogrefs unmount /`` and the ``ogrefs`` CLI itself, so a plain
unmount from inside the box would always be busy. ``unmount`` and
``finalize`` therefore ask first who holds the overlays (this module) and
tell apart the caller's own ancestry (its shell, ``sudo``, ``ssh``'s
session: they only go away after the command returns, so they are detached
lazily and the daemon serves them until they exit) from every other process
(then nothing is touched and the one-line error names them).

References are matched by mount id, not by path (a lazily detached mount
keeps its id: the registration remembers them, so ``mount`` can name what
still holds the old tree): a process started before
the mount runs this box's own ``/usr/bin/bash``, at the same path but below
the overlay, and does not keep the overlay busy. Other processes' memory
mappings are not counted (they keep the FUSE lower's superblock alive, which
is what a lazily detached daemon serves); the caller's own are (:func:`in_use`).
No state, no locks.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from ogrefs.box import mountsys
from ogrefs.box.records import unescape_mountinfo as _unescape_mountinfo


@dataclass(frozen=True)
class Holder:
    pid: int
    comm: str
    what: str  # "cwd /opt/project", "program /usr/bin/bash", "file /root/notes.txt"

    def __str__(self) -> str:
        return f"{self.pid} {self.comm} ({self.what})"


def mount_ids(targets: list[str], fstype: str = "overlay") -> set[int]:
    """Mount ids (mountinfo's first field) of the ``fstype`` mounts at ``targets`` in this namespace."""
    want = set(targets)
    ids = set()
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
            for line in fh:
                fields = line.split()
                if "-" not in fields:
                    continue
                kind = fields[fields.index("-") + 1]
                if kind == fstype and _unescape_mountinfo(fields[4]) in want:
                    ids.add(int(fields[0]))
    except OSError:
        pass
    return ids


def _fdinfo(path: str) -> tuple[int, int | None]:
    """(flags, mount id) of an open file, from its ``/proc/<pid>/fdinfo/<fd>``; (0, None) if unreadable."""
    flags, mid = 0, None
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith("flags:"):
                    flags = int(line.split()[1], 8)
                elif line.startswith("mnt_id:"):
                    mid = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return 0, None
    return flags, mid


def _mnt_id_of_fdinfo(path: str) -> int | None:
    return _fdinfo(path)[1]


def _mnt_id_of_link(link: str) -> int | None:
    """The mount id of what a /proc magic link (cwd, root, exe, fd/N) points at."""
    try:
        fd = os.open(link, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _mnt_id_of_fdinfo(f"/proc/self/fdinfo/{fd}")
    finally:
        os.close(fd)


def _holds(pid: str, ids: dict[int, str], maps: bool = False) -> str | None:
    """What of ``pid`` is on one of the mounts ``ids``, or None; with ``maps``, its memory mappings too.

    ``ids`` maps each mount id to the path to show before the link's text: "" for a mount attached
    here (the kernel's text is the full path), its old target for a detached one (text from its root).
    """
    for name, label in (("cwd", "cwd"), ("root", "root"), ("exe", "program")):
        if (mid := _mnt_id_of_link(f"/proc/{pid}/{name}")) in ids:
            return f"{label} {_shown(ids[mid], f'/proc/{pid}/{name}')}"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        if (mid := _mnt_id_of_fdinfo(f"/proc/{pid}/fdinfo/{fd}")) in ids:
            return f"file {_shown(ids[mid], f'/proc/{pid}/fd/{fd}')}"
    return _maps(pid, ids) if maps else None


def _shown(root: str, link: str) -> str:
    text = _readlink(link)
    return (root.rstrip("/") + text if text != "/" else root) if root else text


def _maps(pid: str, ids: dict[int, str]) -> str | None:
    """A file ``pid`` has mapped (a library) from one of the mounts ``ids`` (root only: map_files)."""
    try:
        entries = os.listdir(f"/proc/{pid}/map_files")
    except OSError:
        return None
    for entry in entries:
        if (mid := _mnt_id_of_link(f"/proc/{pid}/map_files/{entry}")) in ids:
            return f"mapped {_shown(ids[mid], f'/proc/{pid}/map_files/{entry}')}"
    return None


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def holders(targets: list[str], exclude: set[int] | None = None) -> list[Holder]:
    """Processes holding one of the overlays mounted at ``targets`` (this namespace), but not ``exclude``."""
    return holders_of({i: "" for i in mount_ids(targets)}, exclude)


def holders_of(ids: dict[int, str], exclude: set[int] | None = None, maps: bool = False) -> list[Holder]:
    """Processes holding one of the mounts ``ids``, attached or detached (a lazy unmount keeps their ids).

    ``ids``: mount id -> "" if attached here, else the path it was mounted at (for the message).
    """
    if not ids:
        return []
    skip = exclude or set()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip:
            continue
        what = _holds(entry, ids, maps)
        if what is not None:
            out.append(Holder(int(entry), _comm(int(entry)), what))
    return sorted(out, key=lambda h: h.pid)


def writers(targets: list[str], exclude: set[int] | None = None) -> list[str]:
    """Processes with a file open for writing on one of the overlays at ``targets`` ("pid name: file").

    Judged by the mount the open file is on (fdinfo's ``mnt_id``), not by
    its path: a file under ``/var`` that a process opened on this box's own
    disk before the mount (journald's journal), or through a mount bound back
    on top of an overlay, is not written through the overlay, and a
    ``finalize /`` of a booted box refused on it (issue 47). ``exclude``: the
    mount's own daemon and keeper.
    """
    ids = mount_ids(targets)
    skip = exclude or set()
    out = []
    for entry in os.listdir("/proc") if ids else []:
        if not entry.isdigit() or int(entry) in skip:
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            flags, mid = _fdinfo(f"/proc/{entry}/fdinfo/{fd}")
            if mid in ids and flags & (os.O_WRONLY | os.O_RDWR):
                out.append(f"{entry} {_comm(int(entry))}: {_readlink(f'/proc/{entry}/fd/{fd}')}")
    return out


def other_namespaces(dev: str, fstype: str, exclude: set[int] | None = None) -> list[Holder]:
    """One process of each other mount namespace that has a ``fstype`` mount of super block ``dev``
    ("major:minor", :attr:`~ogrefs.box.mountsys.MountRow.dev`); ``what`` is where it is mounted there.

    A namespace cloned while a FUSE mount existed (``unshare --mount``, a container or a service with a private
    ``/tmp`` started then) holds a copy of it: once it is unmounted here the kernel keeps the connection for that
    copy, the daemon serves it, and it exits only when the copy goes. ``exclude``: processes whose namespace
    does not count (the mount's own daemon)."""
    if not dev:
        return []
    seen = {_readlink("/proc/self/ns/mnt")} | {_readlink(f"/proc/{p}/ns/mnt") for p in exclude or ()}
    out = []
    for entry in sorted(os.listdir("/proc"), key=lambda e: int(e) if e.isdigit() else 0):
        if not entry.isdigit():
            continue
        ns = _readlink(f"/proc/{entry}/ns/mnt")
        if ns == "?" or ns in seen:
            continue
        seen.add(ns)
        point = next((r.point for r in mountsys.mount_table(f"/proc/{entry}/mountinfo")
                      if r.dev == dev and r.fstype == fstype), None)
        if point is not None:
            out.append(Holder(int(entry), _comm(int(entry)), point))
    return out


def _comm(pid: int, proc: Path = Path("/proc")) -> str:
    try:
        return (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


def _parent(pid: int, proc: Path = Path("/proc")) -> int:
    """``pid``'s parent; 0 when it is gone (OSError) or has none."""
    status = (proc / str(pid) / "status").read_text()
    return next((int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("PPid:")), 0)


def unstarted(proc: Path = Path("/proc")) -> list[Holder]:
    """The processes systemd (PID 1) has forked for a unit but that have not run the unit's program yet.

    A ``Type=idle`` service (every getty) is forked when its unit starts, then
    holds its ``execve`` until the boot's jobs are done, or 5 s (plus up to
    1 s for PID 1 to answer) have passed; a unit still starting, such as the
    one that mounts the box, keeps the jobs from being done. Such a process
    runs whatever its program's path holds when it finally execs: after the
    overlays are up, the snapshot's, and it then holds the old tree. It is
    told apart by its executable, which is still PID 1's own (or systemd's
    executor, from systemd 255 on), not by its name: the child renames itself
    "(agetty)" only once it first runs, which under load comes after a scan
    that a name would miss. A user's service manager (``user@UID.service``)
    runs systemd's binary as PID 1's child too and is not counted. Empty
    where PID 1 is not systemd.
    """
    if _comm(1, proc) != "systemd":
        return []
    try:
        init_exe = os.readlink(proc / "1/exe")
    except OSError:
        return []
    skip = {"1", str(os.getpid())}
    out = []
    for entry in os.listdir(proc):
        if not entry.isdigit() or entry in skip:
            continue
        try:
            if _parent(int(entry), proc) != 1:
                continue
            exe = os.readlink(proc / entry / "exe")
            if exe != init_exe and os.path.basename(exe) != "systemd-executor":
                continue
            if "/user@" in (proc / entry / "cgroup").read_text():
                continue
        except (OSError, ValueError):
            continue  # gone meanwhile, or exec'd and not ours to read: started either way
        out.append(Holder(int(entry), _comm(int(entry), proc), "forked by systemd, its program not started yet"))
    return out


def wait_started(timeout: float, poll: float = 0.05, proc: Path = Path("/proc")) -> tuple[list[Holder], list[Holder]]:
    """Wait (at most ``timeout`` seconds) until no process is :func:`unstarted`; (those waited for, those left)."""
    first = unstarted(proc)
    left = first
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        time.sleep(poll)
        left = unstarted(proc)
    return first, left


def ancestry(pid: int | None = None) -> set[int]:
    """``pid`` (default: this process) and its parents up to, not including, PID 1."""
    out = set()
    cur = os.getpid() if pid is None else pid
    while cur > 1 and cur not in out:
        out.add(cur)
        try:
            cur = _parent(cur)
        except OSError:
            break
    return out


@dataclass(frozen=True)
class InUse:
    """Who holds a mount's overlays: the caller's own ancestry, and everything else."""
    callers: list[Holder]
    others: list[Holder]

    def refusal(self, what: str) -> str:
        """One line: why ``what`` (unmount, finalize) touched nothing, and what to do."""
        names = ", ".join(str(h) for h in self.others[:3]) + (f" and {len(self.others) - 3} more"
                                                                if len(self.others) > 3 else "")
        return (f"cannot {what}: in use by {names}; nothing was changed; stop them, "
                "or use `ogrefs unmount --lazy` (they keep the snapshot's files until they exit)")


def in_use(targets: list[str], exclude: set[int] | None = None) -> InUse:
    """Who holds ``targets``. The caller's own ancestry counts its memory mappings too: a command whose
    Python modules lie under an overlay it takes down (ogrefs in /opt/ogrefs/venv, `mount --data-only`
    over /opt) maps their compiled extensions from it, and on this kernel (6.18) such a mapping keeps
    the overlay busy (issue 47's lab: `unmount /` refused with "target is busy", no holder named); only
    the caller's own, since it lets go when it exits."""
    mine = ancestry()
    ids = {i: "" for i in mount_ids(targets)}
    found = holders_of(ids, exclude)
    callers = [h for h in found if h.pid in mine]
    skip = exclude or set()
    for pid in sorted(mine - {h.pid for h in callers} - skip):
        if what := _maps(str(pid), ids):
            callers.append(Holder(pid, _comm(pid), what))
    return InUse(callers, [h for h in found if h.pid not in mine])


def callers_or_refuse(what: str, targets: list[str], info: dict) -> list[Holder]:
    """The caller's own processes holding ``targets``; MountError (nothing touched) when others hold them.

    ``info``: the mount's registration (its daemon and keeper do not count).
    """
    from ogrefs.box.records import MountError

    ours = {p for p in (info.get("pid"), info.get("keeper_pid")) if p}
    found = in_use(targets, exclude=ours)
    if found.others:
        raise MountError(found.refusal(what))
    return found.callers


__all__ = ["Holder", "InUse", "holders", "holders_of", "in_use", "ancestry", "mount_ids", "callers_or_refuse",
           "writers"]
