"""Reaching a directory as root without following anything a less privileged user controls.

A writable mount puts overlays at the snapshot's own paths (``/home/u/proj``)
and binds directories back on top of them. By path, ``mount(2)`` follows
every symlink on the way: a user who makes ``~/proj`` a symlink to ``/etc``
before the mount has root cover ``/etc`` with the user's snapshot content.

So a target is walked from ``/`` one component at a time, each opened
``O_PATH | O_NOFOLLOW | O_DIRECTORY`` relative to its parent's descriptor,
and the mount goes on ``/proc/self/fd/N`` of the descriptor reached: the
directory that was checked, wherever a user moves it afterwards. A symlink
on the way is followed only when no one but root can have put it there (it
is root's, in a directory where only root adds or renames entries); any
other is :class:`Untrusted`, and the caller leaves that path out and says why.

:func:`open_dir` also says whether the whole walk stayed in root-controlled
directories: then the path itself names that directory until root changes
it, and may be handed to the kernel as text (an overlay's lower layer, shown
as is in mountinfo); otherwise only the descriptor may.

No state: every call opens its own descriptors and returns one.
"""

from __future__ import annotations

import errno
import os
import stat

from ogrefs.errors import OgrefsError

#: The kernel's own bound on symlinks in one lookup (MAXSYMLINKS).
MAX_LINKS = 40
_DIR = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


class Untrusted(OgrefsError):
    """A component of a path is a symlink that a user other than root can change."""


def root_controlled(parent: os.stat_result, entry: os.stat_result) -> bool:
    """Whether only root can replace ``entry`` in ``parent``: root owns the directory and nobody else may
    write it (a group-writable directory of group root counts as root's), or it is sticky and root owns
    the entry too (``/tmp``: only an entry's owner or root can rename or remove it)."""
    if parent.st_uid != 0:
        return False
    others = parent.st_mode & stat.S_IWOTH or (parent.st_mode & stat.S_IWGRP and parent.st_gid != 0)
    return not others or bool(parent.st_mode & stat.S_ISVTX and entry.st_uid == 0)


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p and p != "."]


def open_dir(path: str, *, create: bool = False, start: int | None = None,
             follow: bool = True) -> tuple[int, bool]:
    """An ``O_PATH`` descriptor of the directory ``path`` and whether every step was root-controlled.

    ``path`` is absolute (from ``/``), or relative to the directory ``start``
    (a descriptor, not closed here). ``create``: missing directories are
    made (0755, root's). ``follow``: False refuses every symlink, root's too
    (inside a snapshot's tree, where root's symlinks are the snapshot's).
    Raises :class:`Untrusted` for a symlink the rule above does not follow,
    OSError (ENOTDIR, ENOENT, ELOOP) for the rest.
    """
    fd = os.open("/" if start is None else ".", _DIR, dir_fd=start)
    trusted, links, todo, seen = True, 0, _parts(path), ""
    try:
        while todo:
            name = todo.pop(0)
            if name == "..":
                fd = _step(fd, os.open("..", _DIR, dir_fd=fd))
                seen = os.path.dirname(seen)
                continue
            parent = os.fstat(fd)
            st = _entry(fd, name, create)
            if stat.S_ISLNK(st.st_mode):
                shown = f"{seen}/{name}"
                if not follow:
                    raise Untrusted(f"{shown} is a symlink: not followed there")
                if st.st_uid != 0 or not root_controlled(parent, st):
                    who = st.st_uid or parent.st_uid
                    raise Untrusted(f"{shown} is a symlink that {f'user {who}' if who else 'a user other than root'} "
                                    "can change: not followed")
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
                target = os.readlink(name, dir_fd=fd)
                if target.startswith("/"):
                    fd = _step(fd, os.open("/", _DIR))
                    seen = ""
                todo[:0] = _parts(target)
                continue
            nxt = os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=fd)  # a symlink swapped in since: ENOTDIR
            trusted = trusted and root_controlled(parent, os.fstat(nxt))
            fd = _step(fd, nxt)
            seen = f"{seen}/{name}"
    except BaseException:
        os.close(fd)
        raise
    return fd, trusted


def _entry(dir_fd: int, name: str, create: bool) -> os.stat_result:
    """``name`` in ``dir_fd`` itself (a symlink not followed); made as a directory first when missing and ``create``."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(name, 0o755, dir_fd=dir_fd)
    except FileExistsError:
        pass  # made meanwhile: looked at as it is
    return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)


def _step(old: int, new: int) -> int:
    os.close(old)
    return new


def fd_path(fd: int) -> str:
    """The name by which the kernel resolves ``fd`` itself (for mount(2) and overlayfs' options)."""
    return f"/proc/self/fd/{fd}"


def mount_id_of(fd: int) -> int | None:
    """The id of the mount ``fd`` lies on (``/proc/self/fdinfo``), or None when the kernel does not say."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None
