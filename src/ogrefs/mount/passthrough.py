"""FUSE passthrough (Linux 6.9+) for complete, verified local copies, asked for past libfuse 3.14.

With passthrough the kernel serves an open file's reads (and its mmap) from a
*backing file* the daemon names at the open, without a READ request: a
materialized checkpoint read through the mount costs what reading the local
file costs (docs/benchmarks.md, issue 49).  The kernel needs three things that
libfuse 3.14 and pyfuse3 3.5 cannot send:

1. the INIT reply with ``FUSE_PASSTHROUGH`` (``flags2`` bit 5, with
   ``FUSE_INIT_EXT``) and ``max_stack_depth`` 1: the FUSE mount is then at
   stack depth 1, an overlay over it (a writable mount) at 2, the most the
   kernel allows, and a backing file must lie on a file system of depth 0;
2. per file, ``ioctl(/dev/fuse, FUSE_DEV_IOC_BACKING_OPEN, {fd})`` (root),
   which returns a backing id (the kernel keeps its own reference to the file);
3. the OPEN reply with ``FOPEN_PASSTHROUGH`` and the backing id in
   ``fuse_open_out``.

(1) is written into the reply's bytes on their way out: libfuse's ``writev``
slot (mount/gotslot.py) points at :meth:`Passthrough._writev` from the mount
until the INIT reply has passed, which is the first write on the session's
fd, whose number it learns there.  (3) is sent by :meth:`Passthrough._reply_open`
through ``fuse_reply_buf``: pyfuse3's ``fuse_reply_open`` slot points at it
only from the moment an open that goes through is decided (:meth:`arm`,
the last thing the open handler does) until that reply is sent, which
pyfuse3 does right after the handler returns, in the same step of the same
task, so no other reply passes meanwhile.

Whether the kernel took (1) is known at the first backing open: EPERM (not
negotiated: a kernel before 6.9, or one built without it) or ELOOP (the local
copy is on a stacked file system, such as a container's overlay) turns
passthrough off for the mount, said once in the log; files are then served
by the daemon as before.

The kernel's rule for an inode (fs/fuse/iomode.c): it is in cached mode while
any open without passthrough is live, in passthrough mode while any with it
is, and an open that asks for the other mode fails with EIO.  So an inode
with live passthrough handles (:attr:`_inodes`) has every new open go through
with the same backing id, and one goes through only when the daemon knows no
other handle of it.  The kernel drops an inode's mode at the last close,
before the RELEASE reaches the daemon, so the daemon's count is never below
the kernel's.

Who owns what: a Passthrough belongs to the trio loop of the mount (its
counters, the inode table, the armed reply); the two callbacks run on that
thread too, called by libfuse while pyfuse3 answers a request there.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import struct
from dataclasses import dataclass, field

from ogrefs.mount.gotslot import GotSlot, loaded_path

log = logging.getLogger(__name__)

FUSE_INIT_EXT = 1 << 30
FUSE_PASSTHROUGH_FLAGS2 = 1 << 5  # FUSE_PASSTHROUGH is bit 37: bit 5 of flags2
MAX_STACK_DEPTH = 1
FOPEN_PASSTHROUGH = 1 << 7
_IOC_MAGIC = 229
FUSE_DEV_IOC_BACKING_OPEN = (1 << 30) | (16 << 16) | (_IOC_MAGIC << 8) | 1  # _IOW(229, 1, struct fuse_backing_map)
FUSE_DEV_IOC_BACKING_CLOSE = (1 << 30) | (4 << 16) | (_IOC_MAGIC << 8) | 2  # _IOW(229, 2, uint32_t)
#: fuse_init_out: flags at 12, flags2 at 32, max_stack_depth at 36 (protocol 7.40)
_INIT_FLAGS, _INIT_FLAGS2, _INIT_STACK_DEPTH = 12, 32, 36
_FH_IN_FILE_INFO = 16  # struct fuse_file_info of libfuse 3: int flags, two 32-bit words of bits, then uint64 fh


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_WRITEV = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, use_errno=True)
_REPLY_OPEN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_REPLY_BUF = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t)


@dataclass
class _Backing:
    backing_id: int
    handles: set[int] = field(default_factory=set)


@dataclass
class PassthroughStats:
    opens: int = 0  # opens answered with a backing file
    backing_opens: int = 0  # backing ids asked for (one per inode while it has passthrough handles)
    declined: int = 0  # opens of a complete copy served by the daemon: another handle of the inode was open


class Passthrough:
    """FUSE passthrough for one mount; see the module docstring.  ``state``: ``off`` (not asked), ``asked``
    (the INIT reply carried it), ``on`` (a backing file was accepted), or the reason it is off."""

    def __init__(self) -> None:
        self.state = "off"
        self.stats = PassthroughStats()
        self.dev_fd: int | None = None
        self._inodes: dict[int, _Backing] = {}
        self._fh_inode: dict[int, int] = {}
        self._armed: tuple[int, int] | None = None  # (fh, backing id) of the open whose reply goes through
        self._writev_slot: GotSlot | None = None
        self._open_slot: GotSlot | None = None
        self._real_writev = None
        self._real_reply_open = None
        self._reply_buf = None
        self._callbacks = (_WRITEV(self._writev), _REPLY_OPEN(self._reply_open))  # kept alive as long as we are

    # -- INIT ----------------------------------------------------------------------------------------------
    def ask_at_init(self, binding: str) -> None:
        """Before the mount: have the INIT reply ask for passthrough.  ``binding``: the path of pyfuse3's
        extension module.  Leaves ``state`` saying why not."""
        try:
            libfuse = loaded_path("libfuse3.so")
            self._writev_slot = GotSlot(libfuse, "writev")
            self._open_slot = GotSlot(os.path.realpath(binding), "fuse_reply_open", provider=libfuse)
            lib = ctypes.CDLL(libfuse)
            self._reply_buf = _REPLY_BUF(("fuse_reply_buf", lib))
        except OSError as exc:
            self.state = f"not available: {exc}"
            return
        self._real_writev = _WRITEV(self._writev_slot.original)
        self._real_reply_open = _REPLY_OPEN(self._open_slot.original)
        self._writev_slot.point_at(ctypes.cast(self._callbacks[0], ctypes.c_void_p).value)
        self.state = "asking"

    def _writev(self, fd: int, iov: int, count: int) -> int:
        """libfuse's first write on the session: the INIT reply; its flags amended, then the slot let go."""
        try:
            vecs = (_Iovec * count).from_address(iov)
            header = ctypes.string_at(vecs[0].base, 16) if count and vecs[0].len >= 16 else b""
            if header and struct.unpack_from("<i", header, 4)[0] == 0 and count > 1 and vecs[1].len > _INIT_STACK_DEPTH:
                body = vecs[1].base
                flags = ctypes.c_uint32.from_address(body + _INIT_FLAGS)
                flags2 = ctypes.c_uint32.from_address(body + _INIT_FLAGS2)
                flags.value |= FUSE_INIT_EXT
                flags2.value |= FUSE_PASSTHROUGH_FLAGS2
                ctypes.c_uint32.from_address(body + _INIT_STACK_DEPTH).value = MAX_STACK_DEPTH
                self.dev_fd = fd
                self.state = "asked"
            else:
                self.state = "not available: libfuse's INIT reply was not the first write"
        except Exception:  # noqa: BLE001 - an exception must not cross into C; the reply goes out unchanged
            log.exception("passthrough: the INIT reply could not be amended")
            self.state = "not available: the INIT reply could not be amended"
        finally:
            assert self._writev_slot is not None
            self._writev_slot.restore()
        return self._real_writev(fd, iov, count)

    def abandon(self) -> None:
        """The mount failed or ends before INIT: give libfuse its writev back."""
        if self._writev_slot is not None and self._writev_slot.redirected:
            self._writev_slot.restore()
        if self._open_slot is not None and self._open_slot.redirected:
            self._open_slot.restore()

    # -- per open ------------------------------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        return self.state in ("asked", "on")

    def serves(self, ino: int) -> bool:
        """Whether ``ino`` has passthrough handles now (every new open of it must be one too)."""
        return ino in self._inodes

    def choose(self, ino: int, fh: int, other_handles: int, local_fd: int | None) -> bool:
        """Whether the open ``fh`` of ``ino`` goes through (then :meth:`arm` it last); ``local_fd``: a verified
        complete local copy (the caller's: closed by the caller), ``other_handles``: the daemon's other open
        handles of the inode.  Decided synchronously, right before the reply (see the module docstring)."""
        b = self._inodes.get(ino)
        if b is None:
            if local_fd is None or not self.usable:
                return False
            if other_handles:
                self.stats.declined += 1
                return False
            backing_id = self._backing_open(local_fd)
            if backing_id is None:
                return False
            b = self._inodes[ino] = _Backing(backing_id)
        b.handles.add(fh)
        self._fh_inode[fh] = ino
        self._armed = (fh, b.backing_id)
        return True

    def arm(self) -> None:
        """Point pyfuse3's ``fuse_reply_open`` at :meth:`_reply_open` for the open :meth:`choose` took."""
        assert self._open_slot is not None and self._armed is not None
        self._open_slot.point_at(ctypes.cast(self._callbacks[1], ctypes.c_void_p).value)

    def _reply_open(self, req: int, fi: int) -> int:
        assert self._open_slot is not None and self._real_reply_open is not None and self._reply_buf is not None
        self._open_slot.restore()
        armed, self._armed = self._armed, None
        fh = ctypes.c_uint64.from_address(fi + _FH_IN_FILE_INFO).value
        if armed is None or armed[0] != fh:  # not the open that was armed: cannot happen (see the docstring)
            log.error("passthrough: an open reply for handle %d came while %r was armed", fh, armed)
            if armed is not None:
                self.released(armed[0])
            return self._real_reply_open(req, fi)
        # only FOPEN_PASSTHROUGH: the kernel refuses it beside any flag but DIRECT_IO, PARALLEL_DIRECT_WRITES
        # and NOFLUSH (FOPEN_PASSTHROUGH_MASK, fs/fuse/iomode.c), keep_cache included
        out = struct.pack("<QIi", fh, FOPEN_PASSTHROUGH, armed[1])
        res = self._reply_buf(req, out, len(out))
        if res == 0:
            self.stats.opens += 1
        else:  # the open is gone (interrupted): no RELEASE will come for it
            self.released(fh)
        return res

    def released(self, fh: int) -> None:
        """A handle's RELEASE: the backing id is closed with the inode's last passthrough handle."""
        ino = self._fh_inode.pop(fh, None)
        if ino is None:
            return
        b = self._inodes[ino]
        b.handles.discard(fh)
        if not b.handles:
            del self._inodes[ino]
            self._backing_close(b.backing_id)

    @property
    def inodes(self) -> int:
        """Inodes served by the kernel from a backing file now."""
        return len(self._inodes)

    # -- the ioctls ----------------------------------------------------------------------------------------
    def _backing_open(self, fd: int) -> int | None:
        assert self.dev_fd is not None
        arg = bytearray(struct.pack("<iIQ", fd, 0, 0))
        try:
            backing_id = fcntl.ioctl(self.dev_fd, FUSE_DEV_IOC_BACKING_OPEN, arg, True)
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.ELOOP, errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL):
                why = {errno.EPERM: "the kernel did not take it at INIT (Linux 6.9+ with CONFIG_FUSE_PASSTHROUGH, "
                                    "and root, are needed)",
                       errno.ELOOP: "the local copies lie on a stacked file system (an overlay)"}.get(
                           exc.errno, f"the kernel refused a backing file ({exc.strerror})")
                self.state = f"off: {why}"
                log.warning("FUSE passthrough is off for this mount: %s; the daemon serves every read", why)
            else:
                log.warning("FUSE passthrough: a backing file was refused (%s); the daemon serves it", exc.strerror)
            return None
        if self.state == "asked":
            self.state = "on"
            log.info("FUSE passthrough is on: complete local copies are read by the kernel")
        self.stats.backing_opens += 1
        return backing_id

    def _backing_close(self, backing_id: int) -> None:
        assert self.dev_fd is not None
        try:
            fcntl.ioctl(self.dev_fd, FUSE_DEV_IOC_BACKING_CLOSE, bytearray(struct.pack("<i", backing_id)), True)
        except OSError as exc:
            log.warning("FUSE passthrough: backing id %d could not be closed: %s", backing_id, exc.strerror)
