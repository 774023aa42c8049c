"""A stopped caller's path argument, read and resolved as the kernel will resolve it.

The caller is stopped in its system call while these run, so its memory,
its working directory and its descriptors hold still (but for another
thread of it: docs/mount.md says what that race can and cannot do). A path
is read from ``/proc/TID/mem``, made absolute against ``/proc/TID/cwd`` or
``/proc/TID/fd/N``, and then walked here one component at a time
(:func:`resolve`) so that a symlink on this box (``/lib -> usr/lib``)
leads where the kernel will go: ``needs`` is asked about the path as
spelled and, where that differs, as this box's symlinks resolve it.
:class:`Memory` keeps descriptors (its owner is named there); the rest has
no state.
"""

from __future__ import annotations

import os
import posixpath
import stat
import struct

PATH_MAX = 4096
PAGE = os.sysconf("SC_PAGE_SIZE")
FIRST_READ = 256
#: Symlinks followed in one walk, as the kernel's MAXSYMLINKS.
MAX_LINKS = 40
AT_FDCWD = -100


class Memory:
    """Reads of the stopped callers' memory through ``/proc/TID/mem``, one descriptor kept per recent thread.

    Owned by the serving thread alone. A kept descriptor holds the memory of
    the process it was opened on: once that process has exec'd or exited
    (and its thread id may be another process's now) a read of it returns
    nothing, and the descriptor is opened again, so a read never returns
    another process's bytes.
    """

    def __init__(self, keep: int = 64):
        self.keep = keep
        self._fds: dict[int, int] = {}

    def read(self, tid: int, address: int, size: int) -> bytes:
        fd = self._fds.get(tid)
        data = self._pread(fd, size, address) if fd is not None else b""
        if not data:
            fd = self._reopen(tid)
            data = self._pread(fd, size, address) if fd is not None else b""
        return data

    @staticmethod
    def _pread(fd: int, size: int, address: int) -> bytes:
        try:
            return os.pread(fd, size, address)
        except (OSError, OverflowError):
            return b""

    def _reopen(self, tid: int) -> int | None:
        old = self._fds.pop(tid, None)
        if old is not None:
            os.close(old)
        try:
            fd = os.open(f"/proc/{tid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None  # gone, or not ours to read (a process that made itself non-dumpable): docs/mount.md
        if len(self._fds) >= self.keep:
            os.close(self._fds.pop(next(iter(self._fds))))
        self._fds[tid] = fd
        return fd

    def string(self, tid: int, address: int) -> bytes | None:
        """The NUL-terminated string at ``address``; None where it cannot be read (the call's EFAULT to give)."""
        if address == 0:
            return None
        # most paths are short: a first read of 256 bytes (never past the end of the page: the next one may be
        # unmapped), then the rest up to PATH_MAX
        data = self.read(tid, address, min(FIRST_READ, PAGE - address % PAGE))
        end = data.find(b"\0")
        while end < 0 and data and len(data) < PATH_MAX:
            more = self.read(tid, address + len(data), min(PATH_MAX - len(data), PAGE - (address + len(data)) % PAGE))
            if not more:
                break
            data += more
            end = data.find(b"\0")
        return data[:end] if end >= 0 else None

    def u64(self, tid: int, address: int) -> int | None:
        """An 8-byte word (openat2's ``open_how.flags``)."""
        data = self.read(tid, address, 8)
        return struct.unpack("=Q", data)[0] if len(data) == 8 else None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def absolute(tid: int, dirfd: int | None, path: bytes) -> str | None:
    """``path`` as an absolute path of this box; None where its directory cannot be known (the call will fail)."""
    name = os.fsdecode(path)
    if name.startswith("/"):
        return name
    fd = _signed32(dirfd) if dirfd is not None else AT_FDCWD
    try:
        base = os.readlink(f"/proc/{tid}/cwd" if fd == AT_FDCWD else f"/proc/{tid}/fd/{fd}")
    except OSError:
        return None
    if not base.startswith("/"):
        return None  # a descriptor of a pipe, a socket, an anonymous inode: not a directory
    return base.rstrip("/") + "/" + name


def _signed32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def lexical(path: str) -> str:
    """``path`` without ``.``, ``..`` and repeated slashes, as a set of paths spells it."""
    if ("//" not in path and "/./" not in path and "/../" not in path and not path.endswith(("/.", "/..", "/"))
            or path == "/"):
        return path  # already so (most paths, `/.venv/` included): normpath costs more than the call it checks
    norm = posixpath.normpath(path)
    return "/" + norm.lstrip("/") if norm.startswith("//") else norm


def in_place(path: str) -> bool | None:
    """True: ``path`` is here and not a directory; False: here, a directory; None: not here (or not reachable)."""
    try:
        return not stat.S_ISDIR(os.stat(path).st_mode)
    except (OSError, ValueError):
        return None


def resolve(path: str) -> str:
    """``path`` as the kernel will walk it on this box: through the symlinks that are here, lexical past them.

    From ``/``, one component at a time, following every symlink of this box
    (the last component's too: at worst a no-follow call waits for a link's
    target it did not need); from the first component that is not here on,
    the rest is joined as it is spelled (``..`` taken lexically there: what
    is not here has no symlink to climb out of). A symlink of the snapshot
    that is not here yet is the snapshot's to follow: ``needs`` does that.
    """
    parts = path.split("/")[::-1]
    here, links = "/", 0
    while parts:
        name = parts.pop()
        if name in ("", "."):
            continue
        if name == "..":
            here = posixpath.dirname(here)
            continue
        step = posixpath.join(here, name)
        try:
            mode = os.lstat(step).st_mode
        except (OSError, ValueError):
            return lexical(posixpath.join(step, *parts[::-1]))
        if stat.S_ISLNK(mode) and links < MAX_LINKS:
            links += 1
            try:
                target = os.readlink(step)
            except OSError:
                return lexical(posixpath.join(step, *parts[::-1]))
            here = "/" if target.startswith("/") else here
            parts.extend(target.split("/")[::-1])
            continue
        here = step
    return here


def interpreter(path: str) -> str | None:
    """The program the kernel opens itself to run ``path``: a ``#!`` line's, or an ELF file's ``PT_INTERP``."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
            if head.startswith(b"#!"):
                words = head[2:].split(b"\n", 1)[0].split()
                return os.fsdecode(words[0]) if words else None
            if head.startswith(b"\x7fELF") and head[4:5] == b"\x02" and head[5:6] == b"\x01":
                return _elf_interp(f, head)
    except OSError:
        return None
    return None


def _elf_interp(f, head: bytes) -> str | None:
    """PT_INTERP of a 64-bit little-endian ELF file (the architectures this package supports)."""
    phoff, = struct.unpack_from("=Q", head, 32)
    phentsize, phnum = struct.unpack_from("=HH", head, 54)
    for i in range(min(phnum, 64)):
        f.seek(phoff + i * phentsize)
        ph = f.read(56)
        if len(ph) < 56:
            return None
        p_type, _flags, p_offset, _vaddr, _paddr, p_filesz = struct.unpack_from("=IIQQQQ", ph)
        if p_type == 3:  # PT_INTERP
            f.seek(p_offset)
            name = f.read(min(p_filesz, PATH_MAX)).split(b"\0", 1)[0]
            return os.fsdecode(name) if name.startswith(b"/") else None
    return None
