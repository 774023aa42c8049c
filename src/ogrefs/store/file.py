"""A store in a local (or network-mounted) directory: one file per key.

Why it looks the way it does:

* ``put`` writes a ``.tmp-*`` file in the destination directory, fsyncs it,
  renames it over the key and fsyncs the directory.  A reader therefore
  sees the old object or the new one, never a torn one, and a crash leaves
  at most a stray temp file, which ``list`` never shows (keys cannot start
  with ``.``, see :func:`validate_key`).  Directories we create are fsynced
  into their parents, so an acknowledged put survives power loss.
* Files are never modified after the rename, so a reader holding an open
  descriptor reads one consistent version even while the key is overwritten.
* Objects are created 0600 and directories 0700: a repository holds whole
  machines (keys, tokens, /etc/shadow), so it is private unless the operator
  deliberately opens it up.
* OSErrors are translated into the store's error classes in one place
  (:meth:`FileStore._error`), so callers never see errno.

Concurrency: a FileStore has no mutable state after construction; every
call opens its own descriptors and picks a random temp name, so any number
of threads may call it at once without a lock.  Two concurrent puts of one
key both succeed and the last rename wins, which is fine for
content-addressed objects.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import time
from collections.abc import Iterator

from ogrefs.store.base import (
    NotFound,
    PermissionDenied,
    ShortRead,
    Store,
    StoreError,
    TransientError,
    check_range,
    validate_key,
    validate_prefix,
)

__all__ = ["FileStore", "TMP_PREFIX"]

#: Name prefix of in-flight temp files; ``list`` skips every name starting with ``.``.
TMP_PREFIX = ".tmp-"

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_FILE_MODE = 0o600
_DIR_MODE = 0o700

#: errnos a network file system (NFS, SMB, FUSE) returns while it recovers.
_TRANSIENT_ERRNOS = frozenset(e for e in (
    getattr(errno, "ETIMEDOUT", None), getattr(errno, "ESTALE", None),
    getattr(errno, "ECONNRESET", None), getattr(errno, "ECONNABORTED", None),
    getattr(errno, "EAGAIN", None), getattr(errno, "EHOSTDOWN", None),
    getattr(errno, "ENETDOWN", None), getattr(errno, "ENETUNREACH", None),
) if e is not None)


class FileStore(Store):
    """Keys are paths below ``root``; see the module docstring for guarantees."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        # The root need not exist yet: the first put creates it.  Opening a
        # mistyped path for reading must not create directories.
        self.root = os.path.abspath(os.fspath(root))
        self.url = "file://" + self.root

    # -- helpers ----------------------------------------------------------

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def _error(self, exc: OSError, key: str, op: str, *, missing_is_notfound: bool = True) -> StoreError:
        """Translate an OSError from ``op`` on ``key`` into the store's error classes."""
        where = f"{self.url}/{key}" if key else self.url
        code = exc.errno
        if code in (errno.ENOENT, errno.ENOTDIR) and missing_is_notfound:
            return NotFound(f"{where}: no such object")
        if code in (errno.EACCES, errno.EPERM):
            return PermissionDenied(f"{where}: {op}: permission denied on {exc.filename or where}")
        if code in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            return StoreError(f"{where}: {op}: no space left on device (or quota exceeded)")
        if code == errno.EIO:
            return StoreError(f"{where}: {op}: I/O error from the device or network file system")
        if code == errno.EROFS:
            return StoreError(f"{where}: {op}: the file system is read-only")
        if code in _TRANSIENT_ERRNOS:
            return TransientError(f"{where}: {op}: {exc.strerror or exc}")
        return StoreError(f"{where}: {op}: {exc.strerror or exc}")

    def _open_regular(self, key: str, op: str) -> tuple[int, int]:
        """Open ``key`` for reading; return (fd, size).  A directory is not a key."""
        path = self._path(key)
        try:
            # O_NONBLOCK: a FIFO planted at a key would block open() until a writer came (for ever); a
            # regular file's reads ignore it, and anything not regular is refused below
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _O_CLOEXEC)
        except IsADirectoryError:
            raise NotFound(f"{self.url}/{key}: no such object") from None
        except OSError as exc:
            raise self._error(exc, key, op) from exc
        try:
            st = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            raise self._error(exc, key, op) from exc
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise NotFound(f"{self.url}/{key}: no such object (not a regular file)")
        return fd, st.st_size

    def _pread_exact(self, fd: int, key: str, offset: int, length: int) -> bytes:
        """Read exactly ``length`` bytes at ``offset`` or raise ShortRead.

        One pread is enough for a regular file in practice; the loop covers
        signals and odd network file systems.
        """
        first = os.pread(fd, length, offset)
        if len(first) == length:
            return first
        parts = [first]
        got = len(first)
        while got < length:
            more = os.pread(fd, length - got, offset + got)
            if not more:
                raise ShortRead(f"{self.url}/{key}: object ended after {offset + got} bytes, "
                                f"wanted {length} bytes at offset {offset}")
            parts.append(more)
            got += len(more)
        return b"".join(parts)

    def _fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _makedirs(self, path: str) -> None:
        """Create ``path`` and missing parents, fsyncing each new entry into its parent."""
        if os.path.isdir(path):
            return
        parent = os.path.dirname(path)
        if parent and parent != path:
            self._makedirs(parent)
        try:
            os.mkdir(path, _DIR_MODE)
        except FileExistsError:
            return  # another thread won the race; if it is a file, the open below says so
        self._fsync_dir(parent)

    # -- the interface ----------------------------------------------------

    def get(self, key: str) -> bytes:
        validate_key(key)
        fd, size = self._open_regular(key, "get")
        try:
            data = self._pread_exact(fd, key, 0, size)
        except OSError as exc:
            raise self._error(exc, key, "get") from exc
        finally:
            os.close(fd)
        return data

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        validate_key(key)
        check_range(offset, length)
        fd, size = self._open_regular(key, "get_range")
        try:
            if offset + length > size:
                raise ShortRead(f"{self.url}/{key}: range {offset}+{length} is past the end "
                                f"of the object ({size} bytes)")
            if length == 0:
                return b""
            return self._pread_exact(fd, key, offset, length)
        except OSError as exc:
            raise self._error(exc, key, "get_range") from exc
        finally:
            os.close(fd)

    def put(self, key: str, data: bytes) -> None:
        validate_key(key)
        path = self._path(key)
        dirname = os.path.dirname(path)
        tmp: str | None = None
        try:
            self._makedirs(dirname)
            tmp = os.path.join(dirname, TMP_PREFIX + secrets.token_hex(8))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, _FILE_MODE)
            try:
                view = memoryview(data).cast("B")
                written = 0
                while written < len(view):
                    written += os.write(fd, view[written:])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            tmp = None
            self._fsync_dir(dirname)
        except IsADirectoryError as exc:
            raise StoreError(f"{self.url}/{key}: put: a directory is in the way") from exc
        except OSError as exc:
            raise self._error(exc, key, "put", missing_is_notfound=False) from exc
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass  # best effort; list() never shows temp files anyway

    def modified(self, key: str) -> float:
        fd, _size = self._open_regular(validate_key(key), "modified")
        try:
            return os.fstat(fd).st_mtime
        finally:
            os.close(fd)

    def exists(self, key: str) -> bool:
        validate_key(key)
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise self._error(exc, key, "exists") from exc
        return stat.S_ISREG(st.st_mode)

    def list(self, prefix: str = "") -> Iterator[str]:
        validate_prefix(prefix)
        # Start at the deepest directory the prefix names, so that listing
        # "packs/ab" does not walk "snapshots/".
        dir_part, _, name_part = prefix.rpartition("/")
        start = os.path.join(self.root, dir_part) if dir_part else self.root
        return self._walk(start, dir_part, name_part)

    def _walk(self, start: str, start_rel: str, first_name_prefix: str) -> Iterator[str]:
        stack: list[tuple[str, str, str]] = [(start, start_rel, first_name_prefix)]
        while stack:
            dirpath, rel, name_prefix = stack.pop()
            try:
                with os.scandir(dirpath) as it:
                    entries = list(it)
            except (FileNotFoundError, NotADirectoryError):
                continue  # nothing stored there (yet)
            except OSError as exc:
                raise self._error(exc, rel, "list") from exc
            for entry in entries:
                name = entry.name
                if name.startswith(".") or not name.startswith(name_prefix):
                    continue  # temp files, hidden files, other prefixes
                key = f"{rel}/{name}" if rel else name
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append((entry.path, key, ""))
                        continue
                    if not entry.is_file():
                        continue
                except OSError as exc:
                    raise self._error(exc, key, "list") from exc
                try:
                    validate_key(key)
                except ValueError:
                    continue  # a stray file no put could have made (lost+found, editor backups)
                yield key

    def remove_stale_temporaries(self, older_than_s: float, dry_run: bool = False) -> tuple[int, int]:
        """The ``.tmp-*`` files of puts a killed process never finished, unmodified for ``older_than_s``.

        A put writes its temporary file in one go and renames it at once, so
        one that old belongs to a process that died. Were it a put that hung
        that long (a network file system), its rename fails and the put
        raises: the caller stores the object again, nothing is lost.
        """
        cutoff = time.time() - older_than_s
        count = size = 0
        stack = [self.root]
        while stack:
            try:
                with os.scandir(stack.pop()) as it:
                    entries = list(it)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                raise self._error(exc, "", "list temporary files") from exc
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.name.startswith(TMP_PREFIX) and entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        if st.st_mtime < cutoff:
                            if not dry_run:
                                os.unlink(entry.path)
                            count, size = count + 1, size + st.st_size
                except FileNotFoundError:
                    continue  # renamed into place or removed meanwhile
                except OSError as exc:
                    raise self._error(exc, "", f"remove {entry.path}") from exc
        return count, size

    def delete(self, key: str) -> None:
        validate_key(key)
        # Not fsynced: a delete that is lost in a crash is redone by the next
        # prune, while an fsync per delete would make prune crawl.
        try:
            os.unlink(self._path(key))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return
        except OSError as exc:
            raise self._error(exc, key, "delete") from exc
