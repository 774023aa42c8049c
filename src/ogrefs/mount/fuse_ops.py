"""The pyfuse3 adapter: the only module that imports pyfuse3.

It translates between pyfuse3's types and :class:`~ogrefs.lazy.fs.vfs.SnapshotFS` and
maps exceptions to errnos (through :func:`ogrefs.lazy.fs.types.errno_for`), nothing
else.  pyfuse3 ends the whole mount on any exception that is not a
``FUSEError``, so every handler goes through :func:`_replies_errno`; an
unexpected exception is logged with its traceback and answered with EIO.

Everything here runs on the trio loop that runs :func:`serve`.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from typing import Any, Awaitable, Callable, TypeVar

import pyfuse3

from ogrefs.errors import OgrefsError
from ogrefs.lazy.fetch.fetcher import FetchError
from ogrefs.lazy.fs.types import Attr, FsError, errno_for
from ogrefs.lazy.fs.vfs import CACHE_TIMEOUT, SnapshotFS
from ogrefs.mount.passthrough import Passthrough

log = logging.getLogger(__name__)

ROOT_INODE = pyfuse3.ROOT_INODE
BLKSIZE = 1024 * 1024  # what stat() suggests as an I/O size: one FUSE request

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def _replies_errno(method: F) -> F:
    @functools.wraps(method)
    async def handler(self, *args):
        if self.on_request is not None:
            self.on_request(method.__name__)
        try:
            return await method(self, *args)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:  # noqa: BLE001 - pyfuse3 would end the mount
            if not isinstance(exc, (FsError, FetchError, OgrefsError, OSError)):
                log.exception("unexpected error in %s%r", method.__name__, args)
            raise pyfuse3.FUSEError(errno_for(exc)) from None
    return handler  # type: ignore[return-value]


def _entry(attr: Attr) -> pyfuse3.EntryAttributes:
    n = attr.node
    e = pyfuse3.EntryAttributes()
    e.st_ino = n.ino
    e.generation = 0
    e.entry_timeout = CACHE_TIMEOUT
    e.attr_timeout = CACHE_TIMEOUT
    e.st_mode = n.mode
    e.st_nlink = n.nlink
    e.st_uid = n.uid
    e.st_gid = n.gid
    e.st_rdev = n.rdev
    e.st_size = n.size
    e.st_blksize = BLKSIZE
    e.st_blocks = attr.blocks
    e.st_atime_ns = n.atime_ns
    e.st_mtime_ns = n.mtime_ns
    e.st_ctime_ns = n.ctime_ns
    return e


def _negative_entry() -> pyfuse3.EntryAttributes:
    """A cacheable "no such entry": Python imports probe many names that do not exist."""
    e = pyfuse3.EntryAttributes()
    e.st_ino = 0
    e.entry_timeout = CACHE_TIMEOUT
    return e


class FuseOps(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, fs: SnapshotFS, on_init: Callable[[], None] | None = None,
                 on_request: Callable[[str], None] | None = None, passthrough: Passthrough | None = None) -> None:
        super().__init__()
        self.fs = fs
        self.passthrough = passthrough  # complete local copies served by the kernel (mount/passthrough.py)
        self._on_init = on_init
        self.on_request = on_request  # told each request's operation (mount/loopprofile.py), on the loop

    def init(self) -> None:
        if self._on_init is not None:
            self._on_init()

    @_replies_errno
    async def lookup(self, parent_inode, name, ctx=None):
        try:
            return _entry(await self.fs.lookup(parent_inode, name))
        except FsError as exc:
            if exc.errno == errno.ENOENT:
                return _negative_entry()
            raise

    async def forget(self, inode_list):
        try:
            self.fs.forget(list(inode_list))
        except Exception:  # noqa: BLE001 - forget must never raise
            log.exception("forget failed")

    @_replies_errno
    async def getattr(self, inode, ctx=None):
        return _entry(await self.fs.getattr(inode))

    @_replies_errno
    async def readlink(self, inode, ctx):
        return await self.fs.readlink(inode)

    @_replies_errno
    async def opendir(self, inode, ctx):
        return await self.fs.opendir(inode)

    @_replies_errno
    async def readdir(self, fh, start_id, token):
        await self.fs.readdir(fh, start_id,
                              lambda name, attr, nxt: pyfuse3.readdir_reply(token, name, _entry(attr), nxt))

    @_replies_errno
    async def releasedir(self, fh):
        self.fs.releasedir(fh)

    @_replies_errno
    async def open(self, inode, flags, ctx):
        fh = await self.fs.open(inode, flags)
        pt = self.passthrough
        if pt is not None and (pt.usable or pt.serves(inode)):
            local_fd = None if pt.serves(inode) else await self.fs.verified_copy(inode)
            try:
                # decided and armed with no await before the reply (pyfuse3 sends it as this returns)
                if pt.choose(inode, fh, self.fs.handles_of(inode) - 1, local_fd):
                    pt.arm()
                    return pyfuse3.FileInfo(fh=fh)
            finally:
                if local_fd is not None:
                    os.close(local_fd)  # (the kernel holds the backing file itself)
        # keep_cache: the data never changes, so pages cached by an earlier open stay valid
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    @_replies_errno
    async def read(self, fh, off, size):
        return await self.fs.read(fh, off, size)

    # No flush(): pyfuse3's default answers ENOSYS, on which the kernel stops sending FLUSH
    # at all -- one synchronous round trip less per close() (the layer is read-only).

    @_replies_errno
    async def release(self, fh):
        if self.passthrough is not None:
            self.passthrough.released(fh)
        self.fs.release(fh)

    @_replies_errno
    async def getxattr(self, inode, name, ctx):
        return await self.fs.getxattr(inode, name)

    @_replies_errno
    async def listxattr(self, inode, ctx):
        return await self.fs.listxattr(inode)

    @_replies_errno
    async def statfs(self, ctx):
        s = await self.fs.statfs()
        out = pyfuse3.StatvfsData()
        out.f_bsize = s.bsize
        out.f_frsize = s.bsize
        out.f_blocks = s.blocks
        out.f_bfree = out.f_bavail = 0
        out.f_files = s.files
        out.f_ffree = out.f_favail = 0
        out.f_namemax = s.namemax
        return out


def store_in_page_cache(ino: int, data: bytes) -> None:
    """Put ``data`` into the kernel's page cache as the whole content of ``ino``.

    Call from a worker thread, or from the trio loop only for a file with no
    open handle but the one being opened (lazy/fs/openpush.py): the kernel may
    wait for a READ of the same page that the loop has yet to answer.  Raises
    OSError when the kernel does not know ``ino`` (any more).
    """
    pyfuse3.notify_store(ino, 0, data)


def mount_options(*, allow_other: bool = False) -> set[str]:
    opts = {"fsname=ogrefs", "subtype=ogrefs", "ro", "default_permissions"}
    if allow_other:
        opts.add("allow_other")
    return opts


def fuse_mount(ops: FuseOps, mountpoint: str, options: set[str]) -> None:
    """Mount (the kernel starts queueing requests); :func:`serve` answers them."""
    if ops.passthrough is not None:
        ops.passthrough.ask_at_init(pyfuse3.__file__)
    try:
        pyfuse3.init(ops, mountpoint, options)
    except RuntimeError as exc:
        if ops.passthrough is not None:
            ops.passthrough.abandon()
        raise OSError(errno.EIO, f"the kernel refused the FUSE mount ({exc}); see the log above") from None


async def serve() -> None:
    """Answer FUSE requests until unmounted or :func:`terminate` is called."""
    await pyfuse3.main(min_tasks=4, max_tasks=64)


def terminate() -> None:
    """End :func:`serve` (call from the trio loop)."""
    pyfuse3.terminate()


def fuse_close(unmount: bool = True) -> None:
    """Unmount (lazily when busy, as libfuse does for root) and free the session."""
    pyfuse3.close(unmount=unmount)

