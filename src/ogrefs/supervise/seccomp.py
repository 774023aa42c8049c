"""The kernel's seccomp user notification, through ctypes: the filter, its installation, the listener.

Why seccomp and not an LD_PRELOAD shim: docs/mount.md, "A supervised job on
a box without FUSE" (the dynamic loader's own opens, static binaries and
raw system calls never reach a shim; the kernel sees them all).

The filter looks at the system call number and the architecture only, so
the kernel's per-call cache (Linux 5.11) lets every other system call run
without even evaluating it; the one exception is the ``AT_EMPTY_PATH`` flag
of ``newfstatat``/``statx``, which glibc's ``fstat`` uses 2,300 times in an
``import torch`` with an empty path: those are let through in the filter.

No state, no locks: :class:`Listener` is a file descriptor and the buffers
of one receiving thread (``recv``); ``answer`` and ``valid`` may be called
from any thread (each builds its own argument).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import struct
from dataclasses import dataclass
from typing import NamedTuple

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_GET_CHILD_SUBREAPER = 37
PR_SET_CHILD_SUBREAPER = 36
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_USER_NOTIF = 0x7FC00000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1
SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP = 1
AT_EMPTY_PATH = 0x1000
AT_FDCWD = -100
O_CREAT = 0o100
O_PATH = 0o10000000


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (ord("!") << 8) | nr


#: struct seccomp_notif: id, pid, flags, then seccomp_data (nr, arch, instruction pointer, six arguments).
NOTIF = struct.Struct("=QIIiIQ6Q")
#: struct seccomp_notif_resp: id, val, error, flags.
RESP = struct.Struct("=QqiI")
IOCTL_RECV = _ioc(3, 0, NOTIF.size)
IOCTL_SEND = _ioc(3, 1, RESP.size)
IOCTL_ID_VALID = _ioc(1, 2, 8)
IOCTL_SET_FLAGS = _ioc(1, 4, 8)

#: What a path argument is to the supervisor: read (it must be in place), create (it may be new: its parent must
#: be in place), exec (read, and the interpreter the kernel opens itself).
READ, CREATE, EXEC = "read", "create", "exec"


@dataclass(frozen=True)
class Call:
    """One intercepted system call: which arguments are paths, and the directory descriptor of each."""

    name: str
    paths: tuple[tuple[int, int | None, str], ...]  # (path argument, dirfd argument or None, READ/CREATE/EXEC)
    flags_arg: int | None = None  # an open's flags (openat2 keeps them in its open_how: None)
    opens: bool = False


def _calls(table: dict[str, int]) -> dict[int, Call]:
    """The calls of this architecture's ``table`` (name -> number) that take a path, by number."""
    one, at = ((0, None, READ),), ((1, 0, READ),)
    shapes: dict[str, Call] = {
        "open": Call("open", ((0, None, READ),), flags_arg=1, opens=True),
        "creat": Call("creat", ((0, None, CREATE),)),
        "openat": Call("openat", ((1, 0, READ),), flags_arg=2, opens=True),
        "openat2": Call("openat2", ((1, 0, READ),), opens=True),
        "execve": Call("execve", ((0, None, EXEC),)), "execveat": Call("execveat", ((1, 0, EXEC),)),
        "mkdir": Call("mkdir", ((0, None, CREATE),)), "mkdirat": Call("mkdirat", ((1, 0, CREATE),)),
        "mknod": Call("mknod", ((0, None, CREATE),)), "mknodat": Call("mknodat", ((1, 0, CREATE),)),
        "symlink": Call("symlink", ((1, None, CREATE),)), "symlinkat": Call("symlinkat", ((2, 1, CREATE),)),
        "link": Call("link", ((0, None, READ), (1, None, CREATE))),
        "linkat": Call("linkat", ((1, 0, READ), (3, 2, CREATE))),
        "rename": Call("rename", ((0, None, READ), (1, None, CREATE))),
        "renameat": Call("renameat", ((1, 0, READ), (3, 2, CREATE))),
        "renameat2": Call("renameat2", ((1, 0, READ), (3, 2, CREATE))),
    }
    for name in ("stat", "lstat", "access", "readlink", "chdir", "statfs", "truncate", "unlink", "rmdir", "chmod",
                 "chown", "lchown", "utime", "utimes", "getxattr", "lgetxattr", "listxattr", "llistxattr", "setxattr",
                 "lsetxattr", "removexattr", "lremovexattr"):
        shapes[name] = Call(name, one)
    for name in ("newfstatat", "statx", "faccessat", "faccessat2", "readlinkat", "unlinkat", "fchmodat",
                 "fchmodat2", "fchownat", "futimesat", "utimensat", "inotify_add_watch"):
        shapes[name] = Call(name, at if name != "inotify_add_watch" else ((1, None, READ),))
    return {number: shapes[name] for name, number in table.items()}


#: x86_64 (arch/x86/entry/syscalls/syscall_64.tbl).
X86_64 = {
    "open": 2, "stat": 4, "lstat": 6, "access": 21, "execve": 59, "truncate": 76, "chdir": 80, "rename": 82,
    "mkdir": 83, "rmdir": 84, "creat": 85, "link": 86, "unlink": 87, "symlink": 88, "readlink": 89, "chmod": 90,
    "chown": 92, "lchown": 94, "utime": 132, "mknod": 133, "statfs": 137, "setxattr": 188, "lsetxattr": 189,
    "getxattr": 191, "lgetxattr": 192, "listxattr": 194, "llistxattr": 195, "removexattr": 197,
    "lremovexattr": 198, "utimes": 235, "inotify_add_watch": 254, "openat": 257, "mkdirat": 258, "mknodat": 259,
    "fchownat": 260, "futimesat": 261, "newfstatat": 262, "unlinkat": 263, "renameat": 264, "linkat": 265,
    "symlinkat": 266, "readlinkat": 267, "fchmodat": 268, "faccessat": 269, "utimensat": 280, "renameat2": 316,
    "execveat": 322, "statx": 332, "openat2": 437, "faccessat2": 439, "fchmodat2": 452,
}
#: aarch64 (include/uapi/asm-generic/unistd.h: only the *at forms exist).
AARCH64 = {
    "setxattr": 5, "lsetxattr": 6, "getxattr": 8, "lgetxattr": 9, "listxattr": 11, "llistxattr": 12,
    "removexattr": 14, "lremovexattr": 15, "inotify_add_watch": 27, "mknodat": 33, "mkdirat": 34, "unlinkat": 35,
    "symlinkat": 36, "linkat": 37, "renameat": 38, "statfs": 43, "truncate": 45, "faccessat": 48, "chdir": 49,
    "fchmodat": 53, "fchownat": 54, "openat": 56, "readlinkat": 78, "newfstatat": 79, "utimensat": 88,
    "execve": 221, "renameat2": 276, "execveat": 281, "statx": 291, "openat2": 437, "faccessat2": 439,
    "fchmodat2": 452,
}


@dataclass(frozen=True)
class Arch:
    audit: int  # AUDIT_ARCH_* as seccomp_data.arch carries it
    seccomp_nr: int  # seccomp(2)
    calls: dict[int, Call]
    empty_path_flag_arg: dict[int, int]  # newfstatat/statx: the flags argument where AT_EMPTY_PATH lets it through


ARCHES = {
    "x86_64": Arch(0xC000003E, 317, _calls(X86_64), {262: 3, 332: 2}),
    "aarch64": Arch(0xC00000B7, 277, _calls(AARCH64), {79: 3, 291: 2}),
}


def this_arch() -> Arch | None:
    return ARCHES.get(platform.machine())


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


_LD_W_ABS, _JEQ, _JSET, _JGE, _RET = 0x20, 0x15, 0x45, 0x35, 0x06


def program(arch: Arch, io_uring_enosys: bool = True) -> bytes:
    """The classic BPF program: notify on the path calls of ``arch``, let everything else through.

    Other ABIs (i386 ``int 0x80``, x32's numbers from 0x40000000) are let
    through: docs/mount.md lists them among what escapes. ``io_uring_setup``
    answers ENOSYS, as Docker's default profile does since 25.0, so a program
    falls back to system calls the filter sees (an io_uring open is not one).
    """
    out = [_ins(_LD_W_ABS, 4), _ins(_JEQ, arch.audit, 1, 0), _ins(_RET, SECCOMP_RET_ALLOW), _ins(_LD_W_ABS, 0),
           _ins(_JGE, 0x40000000, 0, 1), _ins(_RET, SECCOMP_RET_ALLOW)]
    if io_uring_enosys:
        out += [_ins(_JEQ, 425, 0, 1), _ins(_RET, SECCOMP_RET_ERRNO | errno.ENOSYS)]
    for nr, flags_arg in sorted(arch.empty_path_flag_arg.items()):
        # nr == this: load the low word of the flags argument; AT_EMPTY_PATH set -> allow, else notify
        out += [_ins(_JEQ, nr, 0, 4), _ins(_LD_W_ABS, 16 + 8 * flags_arg), _ins(_JSET, AT_EMPTY_PATH, 0, 1),
                _ins(_RET, SECCOMP_RET_ALLOW), _ins(_RET, SECCOMP_RET_USER_NOTIF)]
    numbers = sorted(nr for nr in arch.calls if nr not in arch.empty_path_flag_arg)
    for i, nr in enumerate(numbers):
        out.append(_ins(_JEQ, nr, len(numbers) - i, 0))  # jump to the notify at the end
    out += [_ins(_RET, SECCOMP_RET_ALLOW), _ins(_RET, SECCOMP_RET_USER_NOTIF)]
    return b"".join(out)


def _errno_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def install(arch: Arch) -> int:
    """Install the filter in this process (it is inherited by every child); returns the listener's fd.

    Without CAP_SYS_ADMIN the kernel wants no_new_privs first (a set-uid
    program then runs with the caller's rights): it is set only when the
    plain attempt is refused, so a root job on a VM keeps its sudo.
    """
    code = program(arch)
    buf = ctypes.create_string_buffer(code, len(code))
    prog = struct.pack("=HxxxxxxQ", len(code) // 8, ctypes.addressof(buf))
    fprog = ctypes.create_string_buffer(prog, len(prog))
    flags = SECCOMP_FILTER_FLAG_NEW_LISTENER
    fd = _libc.syscall(arch.seccomp_nr, SECCOMP_SET_MODE_FILTER, flags, fprog)
    if fd < 0 and ctypes.get_errno() == errno.EACCES:
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise _errno_error("prctl(PR_SET_NO_NEW_PRIVS)")
        fd = _libc.syscall(arch.seccomp_nr, SECCOMP_SET_MODE_FILTER, flags, fprog)
    if fd < 0:
        raise _errno_error("seccomp(SECCOMP_FILTER_FLAG_NEW_LISTENER)")
    return fd


def prctl(option: int, value: int) -> None:
    if _libc.prctl(option, value, 0, 0, 0) != 0:
        raise _errno_error(f"prctl({option})")


def child_subreaper() -> int:
    value = ctypes.c_int(0)
    _libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.addressof(value), 0, 0, 0)
    return value.value


class Notification(NamedTuple):
    """One stopped call (a tuple: built for every call the supervisor looks at, a frozen dataclass costs more)."""

    id: int
    pid: int  # the calling thread's id in this pid namespace
    nr: int
    args: tuple[int, ...]


class Listener:
    """The supervisor's end: receive one notification at a time, answer each once."""

    def __init__(self, fd: int):
        self.fd = fd
        self._buf = bytearray(NOTIF.size)
        self._zero = bytes(NOTIF.size)

    def sync_wake_up(self) -> bool:
        """Ask the kernel to wake the supervisor and the job on one CPU (Linux 6.6); False where it cannot."""
        try:
            fcntl.ioctl(self.fd, IOCTL_SET_FLAGS, SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP)  # the value, not a pointer
        except OSError:
            return False
        return True

    def recv(self) -> Notification | None:
        """The next notification; None where the one announced has gone (its caller was killed: ENOENT)."""
        buf = self._buf
        buf[:] = self._zero  # the kernel refuses a buffer that is not zeroed
        try:
            fcntl.ioctl(self.fd, IOCTL_RECV, buf, True)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.EINTR):
                return None
            raise
        nid, pid, _flags, nr, _arch, _ip, *args = NOTIF.unpack(buf)
        return Notification(nid, pid, nr, tuple(args))

    def pass_next(self) -> None:
        """Receive one notification and let its call go on: the settled path, no object built (docs/mount.md)."""
        buf = self._buf
        buf[:] = self._zero
        try:
            fcntl.ioctl(self.fd, IOCTL_RECV, buf, True)
            fcntl.ioctl(self.fd, IOCTL_SEND, RESP.pack(int.from_bytes(buf[:8], "little"), 0, 0,
                                                       SECCOMP_USER_NOTIF_FLAG_CONTINUE))
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EINTR):
                raise

    def answer(self, nid: int, error: int = 0) -> None:
        """Let the call run (``error`` 0) or fail it with ``error``; a caller that has gone is no error."""
        resp = RESP.pack(nid, 0, -error if error else 0, 0 if error else SECCOMP_USER_NOTIF_FLAG_CONTINUE)
        try:
            fcntl.ioctl(self.fd, IOCTL_SEND, resp)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise

    def valid(self, nid: int) -> bool:
        """Whether the caller of ``nid`` still waits (its memory read a moment ago was its own, not a reused pid's)."""
        try:
            fcntl.ioctl(self.fd, IOCTL_ID_VALID, struct.pack("=Q", nid))
        except OSError:
            return False
        return True

    def close(self) -> None:
        os.close(self.fd)
