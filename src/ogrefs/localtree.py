"""Writing entries into a local tree that a local user may be changing under us.

Restore (often as root, over ``/``) and the materializer both create a tree
of directories, files, symlinks and special files, write data into the files
and then set owners, modes, xattrs and times.  A local user who owns a
directory inside the target (``/home/u`` when a box is restored over ``/``)
can rename anything in it at any moment, e.g. swap a directory restore has
just created for a symlink to ``/etc``.  Every path-based call would then
follow that link: root writes the snapshot's bytes into a root-only file and
chowns it to the user.

So nothing here is done by path.  :class:`LocalTree` holds a file descriptor
of the tree's root (the one path that is trusted: the caller chose it) and
resolves every entry below it with ``openat2(RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`` where the kernel has it
(Linux >= 5.6), else component by component with ``O_NOFOLLOW | O_DIRECTORY``
from the root fd.  A symlink anywhere on the way is ``ELOOP`` (the entry
fails, nothing is followed).  Entries are made relative to their parent's fd
(``mkdirat``, ``openat(O_CREAT|O_EXCL|O_NOFOLLOW)``, ``symlinkat``, ...) and
metadata is set on an open fd (``fchown``, ``fchmod``, ``fsetxattr``,
``futimens``); a symlink gets ``lchown``/``utimensat(AT_SYMLINK_NOFOLLOW)``
relative to its parent's fd, and a FIFO or device node is changed through an
``O_PATH`` fd of it (``/proc/self/fd/N`` names exactly that inode).  A
directory swapped after it was opened keeps receiving its entries wherever
it was moved: the user's own directory, never a file of someone else's.

A name this process created (a restore's temporary file) can still be
renamed over by the user in a directory they can write.  So such a file is
known by its identity, not its name: :meth:`LocalTree.create_file` returns
the :class:`FileId` of the inode it made (``O_CREAT|O_EXCL|O_NOFOLLOW``), and
:meth:`LocalTree.open_own`, and :meth:`LocalTree.rename` and
:meth:`LocalTree.unlink` given that fd or identity, act on the name only
while it is still that inode, owned by us, with one link: a file of the
user's put there is :class:`EntryReplaced`, never written, chowned,
chmodded or renamed.

Threads: a LocalTree is immutable after construction (the root fd is only
read), so any thread may call it; every call opens and closes its own fds.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
from dataclasses import dataclass
from typing import Iterator

from ogrefs.repo.catalog import Inode
from ogrefs.repo.locks import boot_id
from ogrefs.errors import OgrefsError

__all__ = ["LocalTree", "PathConflict", "EntryReplaced", "FileId", "MetadataProblem", "copy_identity", "pwrite_all",
           "split", "syncfs_fd"]

_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(platform.machine())
_RESOLVE = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
#: Metadata errors that only mean "not supported here" and are not worth a report per entry:
#: EPERM (no privilege for trusted.* / security.* as a user), ENOTSUP (no xattrs on this file system).
_XATTR_QUIET = (errno.EPERM, errno.ENOTSUP)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class PathConflict(OgrefsError):
    """An entry of another kind (a non-empty directory where a file goes) is in the way."""


class EntryReplaced(PathConflict):
    """The entry under a name is no longer the inode this process made there (another was renamed over it)."""


@dataclass(frozen=True)
class FileId:
    """Which inode a name held when this process created it: the only proof that a name is still ours."""

    dev: int
    ino: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileId":
        return cls(st.st_dev, st.st_ino)


def _check_same(st: os.stat_result, own: FileId) -> None:
    """Raise :class:`EntryReplaced` unless ``st`` is the inode ``own``."""
    if FileId.of(st) != own:
        raise EntryReplaced("its temporary file was replaced by another file")


def _check_own(st: os.stat_result, own: FileId, *, sole: bool = True) -> None:
    """Raise :class:`EntryReplaced` unless ``st`` is the regular file ``own``, still ours (owner: this
    process's user, so not a file of the user's that got ``own``'s number after ours was removed; ``sole``:
    with one name, so nobody holds a second name of what becomes root's file)."""
    _check_same(st, own)
    if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and (st.st_nlink == 1 or not sole)):
        raise EntryReplaced("its temporary file was replaced by another file")


@dataclass(frozen=True)
class MetadataProblem:
    """Part of an entry's metadata that could not be set (the entry itself is in place)."""

    what: str
    reason: str


def _probe_openat2() -> bool:
    if _SYS_OPENAT2 is None:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        how = _OpenHow(os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE)
        fd = libc.syscall(_SYS_OPENAT2, -100, b".", ctypes.byref(how), ctypes.sizeof(how))  # (beneath the cwd)
    except (OSError, AttributeError):
        return False
    if fd < 0:
        return False
    os.close(fd)
    return True


_libc = ctypes.CDLL(None, use_errno=True)
HAVE_OPENAT2 = _probe_openat2()
_HAVE_PROC_FD = os.path.isdir("/proc/self/fd")


def syncfs_fd(fd: int) -> None:
    """syncfs(2) of the file system holding ``fd``; os.sync() where it is missing.  Raises OSError on errors."""
    try:
        func = _libc.syncfs
    except AttributeError:
        os.sync()
        return
    if func(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


_BOOT_ID = boot_id()  # (set once, at import: constant for the process's life)


def copy_identity(st: os.stat_result) -> str | None:
    """Which file ``st`` is, for as long as nobody changes it: this boot, its device and inode, size, mtime and ctime.

    A write, a truncate, a chmod or a ``utime`` sets the ctime to now, and
    nobody can set it back, so a file whose identity is the same as when it was
    recorded has not been changed through the file system since (below it, a
    raw write to the block device, nothing here can tell).  The boot is part of
    it: across a reboot the disk may have been anywhere.  None where the boot
    cannot be told (no /proc): then no identity matches.
    """
    if not _BOOT_ID:
        return None
    return f"{_BOOT_ID}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def split(rel: bytes) -> tuple[bytes, bytes]:
    """``b"/a/b/c"`` -> ``(b"/a/b", b"c")``."""
    parent, _, name = rel.rpartition(b"/")
    return parent, name


def _components(rel: bytes) -> list[bytes]:
    parts = [p for p in rel.split(b"/") if p]
    for p in parts:
        if p in (b".", b".."):
            raise OSError(errno.EINVAL, f"path component {p!r} refused")
    return parts


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset``: a full disk may accept part of a write and say so only by its count."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]
        offset += n


class LocalTree:
    """A tree rooted at a trusted directory; every entry below it is reached without following a link."""

    def __init__(self, root: bytes, *, create: bool = True) -> None:
        self.root = root
        try:
            if create:
                os.makedirs(root, exist_ok=True)
            self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileExistsError:
            raise OgrefsError(f"{os.fsdecode(root)}: exists and is not a directory") from None
        except OSError as exc:
            raise OgrefsError(f"{os.fsdecode(root)}: cannot be used as a target ({exc.strerror})") from None
        if os.fstatvfs(self.root_fd).f_flag & os.ST_RDONLY:
            os.close(self.root_fd)
            raise OgrefsError(f"{os.fsdecode(root)}: is on a read-only file system")

    def close(self) -> None:
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1

    def __enter__(self) -> "LocalTree":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- resolution -----------------------------------------------------------------------------
    def open(self, rel: bytes, flags: int, mode: int = 0) -> int:
        """An fd of ``rel`` (``b""`` is the root) opened with ``flags``; no symlink on the way or at the end is followed."""
        parts = _components(rel)
        flags |= os.O_CLOEXEC | os.O_NOFOLLOW
        if not parts:
            return os.open(".", flags & ~os.O_NOFOLLOW, dir_fd=self.root_fd)
        if HAVE_OPENAT2:
            how = _OpenHow(flags, mode if flags & os.O_CREAT else 0, _RESOLVE)
            fd = _libc.syscall(_SYS_OPENAT2, self.root_fd, b"/".join(parts), ctypes.byref(how), ctypes.sizeof(how))
            if fd < 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), os.fsdecode(rel))
            return fd
        parent = self._walk(parts[:-1])
        try:
            return os.open(parts[-1], flags, mode, dir_fd=parent)
        finally:
            os.close(parent)

    def _walk(self, parts: list[bytes]) -> int:
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.root_fd)
        try:
            for p in parts:
                nxt = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_dir(self, rel: bytes) -> int:
        return self.open(rel, os.O_RDONLY | os.O_DIRECTORY)

    # -- making entries -----------------------------------------------------------------------
    def make_dir(self, rel: bytes) -> bool:
        """A directory at ``rel``, owner-only until its metadata is set; a non-directory there is replaced.

        Returns True if a directory was there already (it may hold stale temporary files).
        """
        if not rel:
            return True
        parent, name = split(rel)
        pfd = self.open_dir(parent)
        try:
            try:
                os.mkdir(name, 0o700, dir_fd=pfd)
                return False
            except FileExistsError:
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    return True
                os.unlink(name, dir_fd=pfd)
                os.mkdir(name, 0o700, dir_fd=pfd)
                return False
        finally:
            os.close(pfd)

    def clear_for_file(self, rel: bytes) -> None:
        """Make room for a non-directory at ``rel``: an empty directory there goes, a non-empty one is a
        :class:`PathConflict`; anything else stays until the new entry replaces it (rename)."""
        parent, name = split(rel)
        pfd = self.open_dir(parent)
        try:
            _clear_dir(pfd, name)
        finally:
            os.close(pfd)

    def create_file(self, rel: bytes, size: int) -> FileId:
        """An empty owner-only regular file of ``size`` bytes (all hole) at ``rel``, replacing what is there;
        the identity of the inode made (the name may be renamed over later; see :meth:`open_own`)."""
        own, fd = self.create_open(rel, size)
        os.close(fd)
        return own

    def create_open(self, rel: bytes, size: int, *, clear: bytes | None = None) -> tuple[FileId, int]:
        """:meth:`create_file`, and the file left open for writing: what is done through the fd is done to
        the inode made, whatever its name holds later (no name to resolve, nothing to check per write).
        ``clear``: another name in the same directory to make room for first (:meth:`clear_for_file`),
        through the same resolution of the directory."""
        parent, name = split(rel)
        pfd = self.open_dir(parent)
        try:
            if clear is not None:
                _clear_dir(pfd, clear)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(name, flags, 0o600, dir_fd=pfd)
            except FileExistsError:  # something is there (rarely): it goes, whatever it is
                _unlink_nondir(pfd, name)
                fd = os.open(name, flags, 0o600, dir_fd=pfd)
            try:
                if size:
                    os.ftruncate(fd, size)
                own = FileId.of(os.fstat(fd))
            except BaseException:
                os.close(fd)
                raise
        finally:
            os.close(pfd)
        return own, fd

    @staticmethod
    def check_own(fd: int, own: FileId) -> None:
        """:class:`EntryReplaced` unless ``fd`` is still the sole-named file ``own`` this process made: checked
        before a kept fd's file gets its owner and mode (nobody holds a second name of root's file)."""
        _check_own(os.fstat(fd), own)

    def open_own(self, rel: bytes, flags: int, own: FileId) -> int:
        """An fd of ``rel`` only if it is still the file ``own`` that :meth:`create_file` made (else
        :class:`EntryReplaced`): what is done through the fd is done to our inode, whatever the name holds later."""
        fd = self.open(rel, flags | os.O_NONBLOCK)
        try:
            _check_own(os.fstat(fd), own)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def lstat(self, rel: bytes) -> os.stat_result:
        """The entry at ``rel`` itself (a symlink is not followed), reached through its parent's fd."""
        parent, name = split(rel)
        pfd = self.open_dir(parent)
        try:
            return os.stat(name, dir_fd=pfd, follow_symlinks=False)
        finally:
            os.close(pfd)

    def identities(self, rel: bytes, names: list[bytes]) -> list[FileId | None]:
        """:meth:`identity` of each of ``names`` in directory ``rel``, resolved once (None for all when the
        directory cannot be reached)."""
        found = self.lstats(rel, names)
        if found is None:
            return [None] * len(names)
        return [FileId.of(st) if st is not None and stat.S_ISREG(st.st_mode) else None for st in found]

    def lstats(self, rel: bytes, names: list[bytes]) -> list[os.stat_result | None] | None:
        """Each of ``names`` in directory ``rel`` itself (a symlink not followed; None: nothing there), the
        directory resolved once; None when the directory cannot be reached."""
        try:
            pfd = self.open_dir(rel)
        except OSError:
            return None
        try:
            return [_lstat_at(pfd, name) for name in names]
        finally:
            os.close(pfd)

    def create_special(self, rel: bytes, node: Inode) -> bool:
        """A symlink, FIFO or device node at ``rel`` (replacing a non-directory); False for a socket."""
        parent, name = split(rel)
        mode = node.mode
        pfd = self.open_dir(parent)
        try:
            _unlink_nondir(pfd, name)
            if stat.S_ISLNK(mode):
                os.symlink(node.target or b"", name, dir_fd=pfd)
            elif stat.S_ISFIFO(mode):
                os.mkfifo(name, 0o600, dir_fd=pfd)
            elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                os.mknod(name, stat.S_IFMT(mode) | 0o600, node.rdev, dir_fd=pfd)
            else:
                return False
            return True
        finally:
            os.close(pfd)

    def link(self, fd: int, rel: bytes) -> None:
        """A new name ``rel`` for the open file ``fd`` (a hardlink), replacing a non-directory there."""
        parent, name = split(rel)
        pfd = self.open_dir(parent)
        try:
            _unlink_nondir(pfd, name)
            if _HAVE_PROC_FD:
                os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=pfd, follow_symlinks=True)
            else:
                raise OSError(errno.ENOSYS, "hardlinks need /proc/self/fd")
        finally:
            os.close(pfd)

    def link_name(self, src: bytes, rel: bytes) -> None:
        """A hardlink at ``rel`` to the entry at ``src`` (not following it if it is a symlink)."""
        sparent, sname = split(src)
        parent, name = split(rel)
        sfd = self.open_dir(sparent)
        try:
            pfd = self.open_dir(parent)
            try:
                _unlink_nondir(pfd, name)
                os.link(sname, name, src_dir_fd=sfd, dst_dir_fd=pfd, follow_symlinks=False)
            finally:
                os.close(pfd)
        finally:
            os.close(sfd)

    def rename(self, src: bytes, dst: bytes, own_fd: int | None = None) -> None:
        """Move ``src`` to ``dst`` (same directory or not), replacing a non-directory there atomically.

        ``own_fd``: move only the file open as that fd (from :meth:`open_own`; held open, its inode number
        cannot be reused): refused when ``src`` holds another inode, and :class:`EntryReplaced` when another
        was swapped in between the check and the rename (then ``dst`` holds that file, never one we changed).
        """
        mine = None if own_fd is None else FileId.of(os.fstat(own_fd))
        sparent, sname = split(src)
        parent, name = split(dst)
        sfd = self.open_dir(sparent)
        try:
            pfd = sfd if parent == sparent else self.open_dir(parent)
            try:
                if mine is not None:
                    _check_same(os.stat(sname, dir_fd=sfd, follow_symlinks=False), mine)
                os.rename(sname, name, src_dir_fd=sfd, dst_dir_fd=pfd)
                if mine is not None:
                    _check_same(os.stat(name, dir_fd=pfd, follow_symlinks=False), mine)
            finally:
                if pfd != sfd:
                    os.close(pfd)
        finally:
            os.close(sfd)

    def unlink(self, rel: bytes, own: FileId | None = None) -> None:
        """Remove ``rel``; with ``own``, only if it is still our file ``own`` (else :class:`EntryReplaced`:
        a file someone put under the name stays)."""
        parent, name = split(rel)
        pfd = self.open_dir(parent)
        try:
            if own is not None:
                _check_own(os.stat(name, dir_fd=pfd, follow_symlinks=False), own, sole=False)
            os.unlink(name, dir_fd=pfd)
        finally:
            os.close(pfd)

    def names_in(self, rel: bytes) -> Iterator[bytes]:
        """Names in directory ``rel`` (opened without following links)."""
        fd = self.open_dir(rel)
        try:
            with os.scandir(fd) as it:  # scandir closes a dup of fd, not fd
                names = [os.fsencode(e.name) for e in it]
        finally:
            os.close(fd)
        return iter(names)

    # -- metadata -----------------------------------------------------------------------------
    def apply_metadata(self, rel: bytes, node: Inode, xattrs: list[tuple[bytes, bytes]], *,
                       as_root: bool) -> list[MetadataProblem]:
        """Owner, xattrs, mode and times of ``node`` onto the entry at ``rel``; what could not be set.

        Never by path: a file or directory is opened (no links followed) and
        changed through its fd; a symlink relative to its parent's fd.
        """
        if stat.S_ISLNK(node.mode):
            return self._symlink_metadata(rel, node, xattrs, as_root=as_root)
        if stat.S_ISDIR(node.mode) or stat.S_ISREG(node.mode):
            flags = os.O_RDONLY | (os.O_DIRECTORY if stat.S_ISDIR(node.mode) else 0)
            fd = self.open(rel, flags | os.O_NONBLOCK)
            try:
                return apply_fd_metadata(fd, node, xattrs, as_root=as_root)
            finally:
                os.close(fd)
        fd = self.open(rel, os.O_PATH)
        try:
            if stat.S_IFMT(os.fstat(fd).st_mode) != stat.S_IFMT(node.mode):
                raise OSError(errno.EEXIST, "the entry was replaced by another kind")
            if not _HAVE_PROC_FD:
                return [MetadataProblem("metadata", "needs /proc/self/fd for a special file")]
            return _apply_path_metadata(f"/proc/self/fd/{fd}", node, xattrs, as_root=as_root)
        finally:
            os.close(fd)

    def _symlink_metadata(self, rel: bytes, node: Inode, xattrs: list[tuple[bytes, bytes]], *,
                          as_root: bool) -> list[MetadataProblem]:
        parent, name = split(rel)
        pfd = self.open_dir(parent)
        problems: list[MetadataProblem] = []
        try:
            if as_root:
                _quiet(problems, "owner", lambda: os.chown(name, node.uid, node.gid, dir_fd=pfd,
                                                          follow_symlinks=False))
            if xattrs and _HAVE_PROC_FD:
                path = os.fsencode(f"/proc/self/fd/{pfd}/") + name  # the dir by its fd; the link itself is not followed
                for xname, value in xattrs:
                    _xattr(problems, xname, lambda: os.setxattr(path, xname, value, follow_symlinks=False))
            os.utime(name, ns=(node.atime_ns, node.mtime_ns), dir_fd=pfd, follow_symlinks=False)
        finally:
            os.close(pfd)
        return problems


def _lstat_at(pfd: int, name: bytes) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except OSError:
        return None


def _clear_dir(pfd: int, name: bytes, files: bool = False) -> None:
    """An empty directory ``name`` in ``pfd`` goes, a non-empty one is a :class:`PathConflict`; anything else
    stays (``files``: goes too)."""
    try:
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        _rmdir_empty(pfd, name)
    elif files:
        os.unlink(name, dir_fd=pfd)


def _unlink_nondir(pfd: int, name: bytes) -> None:
    """Remove a non-directory ``name`` in ``pfd``; a directory there is a :class:`PathConflict` unless empty."""
    _clear_dir(pfd, name, files=True)


def _rmdir_empty(pfd: int, name: bytes) -> None:
    try:
        os.rmdir(name, dir_fd=pfd)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise PathConflict("a non-empty directory is in the way") from None
        raise


def _quiet(problems: list[MetadataProblem], what: str, fn) -> None:
    try:
        fn()
    except OSError as exc:
        if exc.errno != errno.EPERM:
            problems.append(MetadataProblem(what, exc.strerror or str(exc)))


def _xattr(problems: list[MetadataProblem], name: bytes, fn) -> None:
    try:
        fn()
    except OSError as exc:
        if exc.errno not in _XATTR_QUIET:
            problems.append(MetadataProblem(f"xattr {os.fsdecode(name)}", exc.strerror or str(exc)))


def apply_fd_metadata(fd: int, node: Inode, xattrs: list[tuple[bytes, bytes]], *,
                      as_root: bool) -> list[MetadataProblem]:
    """Owner (as root), xattrs, mode and times onto an open file or directory, in the order that keeps them all:
    chown first (it clears setuid bits and capabilities), chmod after the xattrs, times last.
    A failing part is returned and the rest still applied (a mode is never left owner-only)."""
    problems: list[MetadataProblem] = []
    if as_root:
        _quiet(problems, "owner", lambda: os.fchown(fd, node.uid, node.gid))
    for name, value in xattrs:
        _xattr(problems, name, lambda: os.setxattr(fd, name, value))
    os.fchmod(fd, stat.S_IMODE(node.mode))
    os.utime(fd, ns=(node.atime_ns, node.mtime_ns))
    return problems


def _apply_path_metadata(path: str, node: Inode, xattrs: list[tuple[bytes, bytes]], *,
                         as_root: bool) -> list[MetadataProblem]:
    """The same through a ``/proc/self/fd/N`` name of an O_PATH fd (FIFOs and device nodes are not opened)."""
    problems: list[MetadataProblem] = []
    if as_root:
        _quiet(problems, "owner", lambda: os.chown(path, node.uid, node.gid))
    for name, value in xattrs:
        _xattr(problems, name, lambda: os.setxattr(path, name, value))
    os.chmod(path, stat.S_IMODE(node.mode))
    os.utime(path, ns=(node.atime_ns, node.mtime_ns))
    return problems
