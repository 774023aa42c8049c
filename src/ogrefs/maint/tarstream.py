"""A POSIX (pax) tar writer that carries extended attributes as raw bytes, for ``ogrefs dump``.

Python's tarfile can write pax records, but only as text: a binary value
(``security.capability``, a POSIX ACL) makes it mark the whole header
``hdrcharset=BINARY``, a keyword GNU tar does not know and warns about on
every such entry. GNU tar, star, restic and borg write ``SCHILY.xattr.NAME``
records whose value is the attribute's bytes as they are, so this module
writes the pax extended header itself and lets tarfile build only the ustar
header that follows it (with the long or non-ASCII fields the pax records
carry replaced by placeholders, as GNU tar does). A name's ``=`` and ``%``
are written ``%3D`` and ``%25``, the escapes GNU tar decodes.

The pax header also carries what ustar cannot: names and link targets of any
length and bytes, user and group names, ids and sizes past ustar's octal
fields, and the mtime to the nanosecond. Single-threaded: a writer belongs
to the caller and writes to the stream it was given.
"""

from __future__ import annotations

import tarfile
from typing import IO, Iterable

from ogrefs.errors import OgrefsError

_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE
#: ustar's numeric fields: uid/gid 7 octal digits, size/mtime 11.
_USTAR_MAX = {"uid": 8 ** 7, "gid": 8 ** 7, "size": 8 ** 11, "mtime": 8 ** 11}


def pax_record(key: bytes, value: bytes) -> bytes:
    """One ``"LEN KEY=VALUE\\n"`` record; LEN counts the whole record, its own digits included."""
    body = b" " + key + b"=" + value + b"\n"
    n = len(body) + len(str(len(body)))
    n = len(body) + len(str(n))  # one more digit when the count itself crossed a power of ten
    return str(n).encode() + body


def xattr_keyword(name: bytes) -> bytes:
    return b"SCHILY.xattr." + name.replace(b"%", b"%25").replace(b"=", b"%3D")


def _exact_time(ns: int) -> bytes:
    sign, (sec, frac) = ("-" if ns < 0 else ""), divmod(abs(ns), 1_000_000_000)
    return f"{sign}{sec}.{frac:09d}".encode()


def _fits_ustar(text: bytes, limit: int) -> bool:
    return len(text) <= limit and text.isascii()


class PaxWriter:
    """Write entries to ``out`` as a pax tar; :meth:`close` ends the archive (two zero blocks, a full record)."""

    def __init__(self, out: IO[bytes]) -> None:
        self._out = out
        self._written = 0

    def _write(self, data: bytes) -> None:
        self._out.write(data)
        self._written += len(data)

    def _pad(self) -> None:
        if self._written % _BLOCK:
            self._write(bytes(_BLOCK - self._written % _BLOCK))

    def add(self, info: tarfile.TarInfo, *, name: bytes, mtime_ns: int, xattrs: Iterable[tuple[bytes, bytes]] = (),
            link: bytes = b"", data: Iterable[bytes] = ()) -> None:
        """One entry: ``info`` holds type, mode, ids, user and group names, size and device numbers;
        ``name`` and ``link`` are the raw path and link target; ``data`` the bytes of a regular file."""
        records = self._records(info, name, mtime_ns, link, xattrs)
        if records:
            self._extended_header(records)
        self._write(self._ustar_header(info, name, link))
        if info.type in (tarfile.REGTYPE, tarfile.AREGTYPE):
            left = info.size
            for piece in data:
                if len(piece) > left:
                    raise OgrefsError(f"{name.decode(errors='replace')}: more data than its size {info.size}")
                self._write(piece)
                left -= len(piece)
            if left:
                raise OgrefsError(f"{name.decode(errors='replace')}: {left} bytes short of its size {info.size}")
            self._pad()

    def _records(self, info: tarfile.TarInfo, name: bytes, mtime_ns: int, link: bytes,
                 xattrs: Iterable[tuple[bytes, bytes]]) -> bytes:
        whole_seconds = mtime_ns % 1_000_000_000 == 0 and 0 <= mtime_ns // 1_000_000_000 < _USTAR_MAX["mtime"]
        out = [] if whole_seconds else [pax_record(b"mtime", _exact_time(mtime_ns))]
        if not _fits_ustar(name, _name_limit(info)):
            out.append(pax_record(b"path", name))
        if link and not _fits_ustar(link, 100):
            out.append(pax_record(b"linkpath", link))
        for field, limit in (("uname", 32), ("gname", 32)):
            if not _fits_ustar(getattr(info, field).encode("utf-8", "surrogateescape"), limit):
                out.append(pax_record(field.encode(), getattr(info, field).encode("utf-8", "surrogateescape")))
        for field in ("uid", "gid", "size"):
            if not 0 <= getattr(info, field) < _USTAR_MAX[field]:
                out.append(pax_record(field.encode(), str(getattr(info, field)).encode()))
        out += [pax_record(xattr_keyword(k), v) for k, v in xattrs]
        return b"".join(out)

    def _extended_header(self, records: bytes) -> None:
        head = tarfile.TarInfo("././@PaxHeader")
        head.type, head.size = tarfile.XHDTYPE, len(records)
        self._write(head.tobuf(tarfile.USTAR_FORMAT, "ascii", "strict"))
        self._write(records)
        self._pad()

    @staticmethod
    def _ustar_header(info: tarfile.TarInfo, name: bytes, link: bytes) -> bytes:
        """The ustar header; fields a pax record carries get a placeholder that fits."""
        h = tarfile.TarInfo(_placeholder(name, _name_limit(info)))  # tarfile adds a directory's "/"
        h.type, h.mode, h.devmajor, h.devminor = info.type, info.mode, info.devmajor, info.devminor
        h.linkname = _placeholder(link, 100) if link else ""
        for field, limit in (("uname", 32), ("gname", 32)):
            raw = getattr(info, field).encode("utf-8", "surrogateescape")
            setattr(h, field, raw.decode() if _fits_ustar(raw, limit) else "")
        for field in ("uid", "gid", "size", "mtime"):
            value = int(getattr(info, field))
            setattr(h, field, value if 0 <= value < _USTAR_MAX[field] else 0)
        return h.tobuf(tarfile.USTAR_FORMAT, "ascii", "strict")

    def close(self) -> None:
        self._write(bytes(2 * _BLOCK))
        if self._written % _RECORD:
            self._write(bytes(_RECORD - self._written % _RECORD))
        self._out.flush()


def _placeholder(raw: bytes, limit: int) -> str:
    """``raw`` itself when ustar can hold it, else an ASCII stand-in (the pax record holds the truth)."""
    if _fits_ustar(raw, limit):
        return raw.decode()
    return raw[-(limit - 1):].decode("ascii", "replace").replace("\ufffd", "_").rstrip("/")[-(limit - 1):]


def _name_limit(info: tarfile.TarInfo) -> int:
    return 99 if info.type == tarfile.DIRTYPE else 100  # room for the "/" tarfile appends to a directory
