#!/usr/bin/env python3
"""Can FUSE passthrough be switched on for a live ogrefs mount from outside libfuse? (issue 49)

Duplicates the mount daemon's /dev/fuse fd into this process (pidfd_getfd, Linux 5.6+; root) and asks
the kernel for a backing id of a local file with FUSE_DEV_IOC_BACKING_OPEN (Linux 6.9+).  The kernel
answers EPERM unless the daemon's INIT reply negotiated FUSE_PASSTHROUGH (which libfuse 3.14 cannot
send) or the caller lacks CAP_SYS_ADMIN; a backing id means passthrough is on (it is closed again).

Usage: scripts/passthrough_probe.py DAEMON_PID LOCAL_FILE   (DAEMON_PID: `ogrefs status MNT --json`'s pid)
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys

SYS_PIDFD_OPEN, SYS_PIDFD_GETFD = 434, 438  # x86_64 and aarch64 alike
FUSE_DEV_IOC_MAGIC = 229


def _iow(nr: int, size: int) -> int:
    return (1 << 30) | (size << 16) | (FUSE_DEV_IOC_MAGIC << 8) | nr


FUSE_DEV_IOC_BACKING_OPEN = _iow(1, 16)  # struct fuse_backing_map {int32 fd; uint32 flags; uint64 padding}
FUSE_DEV_IOC_BACKING_CLOSE = _iow(2, 4)  # int32 backing id


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    pid, backing = int(sys.argv[1]), sys.argv[2]
    libc = ctypes.CDLL(None, use_errno=True)
    fds = [int(n) for n in os.listdir(f"/proc/{pid}/fd") if os.readlink(f"/proc/{pid}/fd/{n}") == "/dev/fuse"]
    if not fds:
        print(f"passthrough_probe: process {pid} holds no /dev/fuse", file=sys.stderr)
        return 1
    pidfd = libc.syscall(SYS_PIDFD_OPEN, pid, 0)
    fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, fds[0], 0) if pidfd >= 0 else -1
    if fd < 0:
        print(f"passthrough_probe: cannot take the daemon's fd: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 1
    bfd = os.open(backing, os.O_RDONLY)
    arg = ctypes.create_string_buffer(struct.pack("iIQ", bfd, 0, 0), 16)
    backing_id = libc.ioctl(fd, FUSE_DEV_IOC_BACKING_OPEN, arg)
    if backing_id < 0:
        err = ctypes.get_errno()
        print(f"FUSE_DEV_IOC_BACKING_OPEN: {errno.errorcode.get(err, err)} ({os.strerror(err)})")
        return 1
    print(f"FUSE_DEV_IOC_BACKING_OPEN: backing id {backing_id}: passthrough is on for this connection")
    libc.ioctl(fd, FUSE_DEV_IOC_BACKING_CLOSE, ctypes.byref(ctypes.c_int32(backing_id)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
