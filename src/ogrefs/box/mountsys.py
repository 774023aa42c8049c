"""mount(2), umount2(2) and unshare(2) by system call, never by spawning a program; what is mounted where.

Why: once an overlay covers ``/usr``, running ``mount`` or ``umount`` means
resolving ``/usr/bin/mount`` through that overlay, i.e. through the FUSE
lower the daemon serves; a process that must answer that lookup itself (or
that holds the GIL in a vfork child, CPython gh-104372 on Debian's 3.11.2)
hangs the box. A system call resolves only the paths it is given.

Everything here is loaded when the module is imported (libc through ctypes),
so no call needs a file under a covered path. :func:`mounted_fstype` reads
``/proc/self/mountinfo`` only. No state, no locks.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ogrefs.box.records import unescape_mountinfo

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]

_libc.syscall.restype = ctypes.c_long
#: open_tree(2) and move_mount(2) (Linux 5.2): the same numbers on every architecture since 5.1's table.
SYS_OPEN_TREE, SYS_MOVE_MOUNT = 428, 429
OPEN_TREE_CLONE = 1
AT_RECURSIVE = 0x8000
AT_FDCWD = -100
MOVE_MOUNT_F_EMPTY_PATH = 4
MOVE_MOUNT_T_EMPTY_PATH = 0x40
#: move_mount(2) beneath the top mount at the target (Linux 6.5): the path never shows nothing mounted.
MOVE_MOUNT_BENEATH = 0x200

#: mount_setattr(2) (Linux 5.12) and its struct mount_attr.
SYS_MOUNT_SETATTR = 442
MOUNT_ATTR_RDONLY = 1
AT_EMPTY_PATH = 0x1000


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MNT_DETACH = 2
CLONE_NEWNS = 0x00020000


def _enc(value: str | bytes | None) -> bytes | None:
    return None if value is None else os.fsencode(value)


def _check(res: int, what: str) -> None:
    if res != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    _check(_libc.mount(_enc(source), _enc(target), _enc(fstype), flags, _enc(data)), f"mount {target}")


def overlay(target: str, options: str) -> None:
    mount("ogrefs", target, "overlay", 0, options)


def bind(source: str, target: str, recursive: bool = True, read_only: bool = False) -> None:
    """Bind ``source`` (a path, or ``/proc/self/fd/N`` of a directory opened before it was covered)."""
    mount(source, target, None, MS_BIND | (MS_REC if recursive else 0))
    if read_only:
        mount("none", target, None, MS_BIND | MS_REMOUNT | MS_RDONLY)


def bind_private_ro(source: str, target: str) -> None:
    """A read-only bind of ``source``'s own mount (not what is mounted below it), private at once.

    Private before anything else is mounted: on a box whose ``/`` is shared
    (every systemd box) a bind of ``/usr`` joins its peer group, and an
    overlay mounted on ``/usr`` afterwards would propagate onto the bind too.
    """
    bind(source, target, recursive=False)
    try:
        mount("none", target, None, MS_PRIVATE)
        mount("none", target, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    except OSError:
        umount(target, lazy=True)  # never leave a writable or shared bind of the box behind
        raise


def umount(target: str, lazy: bool = False) -> str | None:
    """Unmount; None when done or nothing was mounted there, else the reason (e.g. "busy")."""
    if _libc.umount2(_enc(target), MNT_DETACH if lazy else 0) == 0:
        return None
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more)
        return None
    if err == errno.EBUSY:
        return "target is busy"
    return os.strerror(err)


def clone_tree(path: str) -> int:
    """A detached copy of the mounts at and below ``path``, as a descriptor for :func:`attach_tree`.

    Unlike a bind from ``/proc/self/fd/N``, it can be attached after the
    original was detached (a bind's source must be in this namespace). One
    copy attaches once; closing an unattached one drops it.
    """
    fd = _libc.syscall(SYS_OPEN_TREE, ctypes.c_int(AT_FDCWD), _enc(path),
                       ctypes.c_uint(OPEN_TREE_CLONE | AT_RECURSIVE | os.O_CLOEXEC))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"open_tree {path}: {os.strerror(err)}")
    return int(fd)


def attach_tree(fd: int, target: str | int) -> None:
    """Mount the copy :func:`clone_tree` returned at ``target``: a path, or a directory's descriptor
    (move_mount(2) follows no symlink of its target, ``/proc/self/fd/N`` included)."""
    if isinstance(target, int):
        res = _move_mount(fd, b"", target, b"", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH)
    else:
        res = _move_mount(fd, b"", AT_FDCWD, _enc(target) or b"", MOVE_MOUNT_F_EMPTY_PATH)
    _check(res, f"move_mount {target}")


def _move_mount(from_fd: int, from_path: bytes, to_fd: int, to_path: bytes, flags: int) -> int:
    return int(_libc.syscall(SYS_MOVE_MOUNT, ctypes.c_int(from_fd), from_path, ctypes.c_int(to_fd), to_path,
                             ctypes.c_uint(flags)))


def can_mount_beneath() -> bool:
    """Whether this kernel's move_mount(2) takes MOVE_MOUNT_BENEATH (Linux 6.5), asked with nothing to move:
    the flags are checked before the descriptors, so an older kernel answers EINVAL, a newer one EBADF."""
    empty = MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH
    if _move_mount(-1, b"", -1, b"", MOVE_MOUNT_BENEATH | empty) == 0:
        return True
    return ctypes.get_errno() != errno.EINVAL


def move_beneath(source: str | int, target: str | int) -> None:
    """Move the mount at ``source`` beneath the top mount at ``target`` (each a path, or a descriptor: of a
    detached copy from :func:`clone_tree`, of the top mount's root).

    What is mounted at the target does not change until that top mount is
    detached, after which the moved one (with everything mounted inside it)
    shows: no moment with nothing mounted there. An attached ``source``'s
    parent must not be a shared mount (the kernel refuses to move out of one).
    """
    src_fd, src, f_empty = (source, b"", MOVE_MOUNT_F_EMPTY_PATH) if isinstance(source, int) \
        else (AT_FDCWD, _enc(source) or b"", 0)
    dst_fd, dst, t_empty = (target, b"", MOVE_MOUNT_T_EMPTY_PATH) if isinstance(target, int) \
        else (AT_FDCWD, _enc(target) or b"", 0)
    _check(_move_mount(src_fd, src, dst_fd, dst, f_empty | t_empty | MOVE_MOUNT_BENEATH),
           f"move_mount {source} beneath {target}")


def read_only_copy(fd: int) -> None:
    """Make the detached copy ``fd`` (:func:`clone_tree`) read-only before it is attached (mount_setattr(2),
    Linux 5.12: a detached mount cannot be remounted by path)."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    res = _libc.syscall(SYS_MOUNT_SETATTR, ctypes.c_int(fd), b"", ctypes.c_uint(AT_EMPTY_PATH | AT_RECURSIVE),
                        ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    _check(int(res), "mount_setattr")


def private_tmpfs(target: str, source: str) -> None:
    """A small tmpfs at ``target``, private (nothing mounted inside it propagates; a mount inside it can be moved)."""
    mount(source, target, "tmpfs", 0, "mode=0700,size=1m")
    mount("none", target, None, MS_PRIVATE)


def private_namespace() -> None:
    """Move this process into a mount namespace of its own, a copy of the current view.

    Propagation is made private, so nothing mounted afterwards in the box's
    namespace (overlays, new disks) reaches this one and nothing mounted here
    leaks out. The kernel refuses this in a multi-threaded process
    (CLONE_NEWNS implies CLONE_FS): call it before any thread starts.
    """
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    mount("none", "/", None, MS_REC | MS_PRIVATE)


def enter_namespace(fd: int) -> None:
    """Join the mount namespace of ``fd`` (an open ``/proc/<pid>/ns/mnt``); single-threaded callers only."""
    _check(_libc.setns(fd, CLONE_NEWNS), "setns(CLONE_NEWNS)")


def tune_readahead(mountpoint: "os.PathLike[str] | str", kb: int) -> None:
    """Raise the kernel's read-ahead for this mount (its bdi) so sequential reads arrive as 1 MiB requests."""
    try:
        dev = os.stat(mountpoint).st_dev
        with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb", "w") as fh:
            fh.write(str(kb))
    except OSError as exc:
        log.info("could not raise kernel read-ahead (%s); sequential reads will be slower", exc)


@dataclass(frozen=True)
class MountRow:
    """One line of ``/proc/self/mountinfo``: what it takes to tell whose a mount is."""

    id: int
    point: str
    fstype: str
    source: str
    super_options: tuple[str, ...]
    parent: int = 0  # the mount it is mounted on (a mount moved beneath another is that one's parent)
    dev: str = ""  # the super block's device, "major:minor": the same in every namespace holding the mount

    def option(self, name: str) -> str | None:
        """A super block option's value (``lowerdir``, ``upperdir``), as the kernel shows it, or None."""
        return next((unescape_mountinfo(o[len(name) + 1:]) for o in self.super_options
                     if o.startswith(name + "=")), None)


def mount_table(mountinfo: str = "/proc/self/mountinfo") -> list[MountRow]:
    """This namespace's mounts (or those of ``/proc/PID/mountinfo``'s), in mountinfo's order (a parent before what
    is mounted on or in it); none where it cannot be read."""
    rows = []
    with contextlib.suppress(OSError), open(mountinfo, encoding="utf-8", errors="surrogateescape") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fields, after = left.split(), right.split()
            if len(fields) < 5 or not fields[0].isdigit():
                continue
            rows.append(MountRow(int(fields[0]), unescape_mountinfo(fields[4]), after[0] if after else "?",
                                 unescape_mountinfo(after[1]) if len(after) > 1 else "",
                                 tuple(after[2].split(",")) if len(after) > 2 else (), int(fields[1]), fields[2]))
    return rows


def mount_at(mountpoint: "os.PathLike[str] | str") -> MountRow | None:
    """What is mounted exactly at ``mountpoint`` (the top one: the one no other there is mounted on), or None.

    Not simply the last there in mountinfo: a mount moved beneath another
    (:func:`move_beneath`) is listed after the one now mounted on it.
    """
    target = os.path.abspath(mountpoint)
    here = [r for r in mount_table() if r.point == target]
    under = {r.parent for r in here}
    return next((r for r in reversed(here) if r.id not in under), here[-1] if here else None)


#: mountinfo's (type, source) of what ogrefs mounts that holds a daemon's FUSE session: the FUSE mount
#: itself (``fsname=ogrefs``, ``subtype=ogrefs``; a bind of one of its files shows the same) and the
#: overlays over it (:func:`overlay` names them ``ogrefs``). No other program makes either.
OGREFS_KINDS = (("fuse.ogrefs", "ogrefs"), ("overlay", "ogrefs"))


def is_ogrefs(row: MountRow | None, fstype: str | None = None) -> bool:
    """Whether ``row`` is a mount ogrefs made (of ``fstype`` if given), by what the kernel reports of it.

    The check before every umount2 of a path ogrefs recorded: a path whose top
    mount is the box's own (its root, a disk) is never touched. Not by mount
    id: a mount ogrefs puts up again (an unmount's rollback, ``finalize``)
    gets a new one, and a recursive bind (the keeper binds the state
    directory back over an overlay) shows a copy of the FUSE mount, with an id
    of its own, at the same path.
    """
    return row is not None and (row.fstype, row.source) in OGREFS_KINDS and (fstype is None or row.fstype == fstype)


def detach_ogrefs_mounts(keep: list[str]) -> list[str]:
    """In a namespace of this process's own: detach the copies of ogrefs' mounts; the points detached.

    A mount namespace copied from the box holds a reference to each FUSE mount
    in it: after the box unmounts one (a read-only mount, another writable
    mount's lower), its daemon would never get the kernel's DESTROY and would
    wait for this process's exit. So every ``fuse.ogrefs`` copy goes, and
    every ogrefs overlay over one, except an overlay that covers a path in
    ``keep`` (what this process runs from: its interpreter, state, cache,
    ``/etc``): that mount then waits for this process, which does depend on
    it. Children first (mountinfo's order reversed); a copy with something
    else mounted on top of it stays (umount2 takes a path, and the top there
    is not ours).
    """
    def covers(point: str) -> bool:
        inside = point.rstrip("/") + "/"
        return any(k == point or k.startswith(inside) for k in keep)

    done = []
    for row in reversed(mount_table()):
        if not is_ogrefs(row) or (row.fstype == "overlay" and covers(row.point)):
            continue
        top = mount_at(row.point)
        if top is not None and top.id == row.id and umount(row.point, lazy=True) is None:
            done.append(row.point)
    return done


def super_options(mountpoint: "os.PathLike[str] | str") -> list[str]:
    """The super block options (mountinfo's last field) of what is mounted at ``mountpoint``; [] if nothing.

    overlayfs mounts *read-only* when it cannot use its work directory (an
    immutable or foreign ``work/work``) and says so only in the kernel log:
    the caller asks here whether ``ro`` is among them.
    """
    row = mount_at(mountpoint)
    return list(row.super_options) if row is not None else []


def mount_id(mountpoint: "os.PathLike[str] | str") -> int | None:
    """The mount id (mountinfo's first field) of what is mounted exactly at ``mountpoint`` (the top one), or None."""
    row = mount_at(mountpoint)
    return row.id if row is not None else None


def overlays_with_upper(upper: str) -> list[tuple[int, int, str]]:
    """(mount id, parent mount id, mount point) of each overlay whose upper directory is ``upper``
    (one of ours: each of our overlays has its own)."""
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fields, sb = left.split(), right.split()
            if len(fields) < 5 or len(sb) < 3 or sb[0] != "overlay":
                continue
            if f"upperdir={upper}" in [unescape_mountinfo(o) for o in sb[2].split(",")]:
                found.append((int(fields[0]), int(fields[1]), unescape_mountinfo(fields[4])))
    return found


def mounted_fstype(mountpoint: Path) -> str | None:
    """The file-system type mounted exactly at ``mountpoint`` (from mountinfo, without touching it)."""
    row = mount_at(mountpoint)
    return row.fstype if row is not None else None
