"""Pack objects: many chunk blobs in one store object, with a self-describing trailer.

Layout (docs/format.md)::

    blob_0 | blob_1 | ... | blob_n-1 | header | u32 header_len | b"OGRFPK01"

``header`` is a zstd-compressed array of fixed 48-byte entries
``(chunk_id[32], offset u64, stored_len u32, raw_len u32)``.  In an encrypted
repository of format version 2 the header is sealed (``nonce | AES-GCM``,
bound to the pack's name) and the magic is ``OGRFPK02``: without the key the
sizes of the blobs, and so of small files, are not readable.  Readers normally
never touch it (the catalog and the index already hold every location); it
exists so that the index can be rebuilt from packs alone and so that ``check``
can prove a pack is what the index says.
"""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass
from typing import Protocol

import zstandard

from ogrefs.repo.codec import inflate
from ogrefs.errors import CorruptObject

TRAILER_MAGIC = b"OGRFPK01"
SEALED_TRAILER_MAGIC = b"OGRFPK02"
_ENTRY = struct.Struct("<32sQII")
_TAIL = struct.Struct("<I8s")
TAIL_SIZE = _TAIL.size


@dataclass(frozen=True)
class BlobLocation:
    """Where one chunk lives: pack name, byte offset, stored and plaintext sizes."""

    pack: str
    offset: int
    stored_len: int
    raw_len: int


class HeaderSealer(Protocol):
    def seal_pack_header(self, name: str, header: bytes) -> bytes: ...


class PackBuilder:
    """Accumulates blobs for one pack.  Owned by a single thread (the snapshotter).

    With ``sealer`` (an encrypted repository's codec) the header is sealed;
    get builders from ``Repository.new_pack`` so that the choice is the repository's.
    """

    def __init__(self, sealer: HeaderSealer | None = None) -> None:
        self._sealer = sealer
        self._blobs: list[bytes] = []  # joined once at finish: one copy of the pack, not a growing buffer
        self._entries: list[tuple[bytes, int, int, int]] = []
        self.size = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, cid: bytes, blob: bytes, raw_len: int) -> int:
        """Append a blob; returns its offset within the pack."""
        offset = self.size
        self._blobs.append(blob)
        self._entries.append((cid, offset, len(blob), raw_len))
        self.size += len(blob)
        return offset

    def finish(self) -> tuple[str, bytes, list[tuple[bytes, int, int, int]]]:
        """Seal the pack: returns (pack name, bytes, entries).

        The name is random, not a content hash: a pack re-uploaded with the same
        bytes after prune marked the old one must never share its name, or the
        deferred deletion of the old one would delete the new one.
        """
        name = secrets.token_hex(32)
        header = zstandard.ZstdCompressor(level=3).compress(b"".join(_ENTRY.pack(*e) for e in self._entries))
        magic = TRAILER_MAGIC
        if self._sealer is not None:
            header, magic = self._sealer.seal_pack_header(name, header), SEALED_TRAILER_MAGIC
        self._blobs += (header, _TAIL.pack(len(header), magic))
        body = b"".join(self._blobs)
        self._blobs = []
        return name, body, list(self._entries)


def pack_key(name: str) -> str:
    return f"packs/{name[:2]}/{name}"


def parse_trailer_tail(tail: bytes, what: str, pack_size: int | None = None) -> int:
    """From the last TAIL_SIZE bytes, the header length; raises CorruptObject.

    With ``pack_size`` (the whole pack's length), a header length that does
    not fit in the pack is refused here, before anyone slices with it.
    """
    if len(tail) != TAIL_SIZE:
        raise CorruptObject(f"{what}: pack too short")
    header_len, magic = _TAIL.unpack(tail)
    if magic not in (TRAILER_MAGIC, SEALED_TRAILER_MAGIC):
        raise CorruptObject(f"{what}: pack trailer has bad magic")
    if pack_size is not None and header_len > pack_size - TAIL_SIZE:
        raise CorruptObject(f"{what}: pack trailer gives a header longer than the pack")
    return header_len


def parse_header(header: bytes, pack_size: int, what: str) -> list[tuple[bytes, int, int, int]]:
    """Decode a pack header into entries, checking each lies inside the pack body.

    The header is a single zstd frame; it is never inflated beyond what the
    pack could describe (one entry per byte of body at most), so a small
    forged header cannot expand into gigabytes.
    """
    body_end = pack_size - len(header) - TAIL_SIZE
    if body_end < 0:
        raise CorruptObject(f"{what}: pack header is longer than the pack")
    try:
        raw = inflate(header, body_end * _ENTRY.size, f"{what}: pack header")
    except CorruptObject as exc:
        if "bound" in str(exc):
            raise CorruptObject(f"{what}: pack header claims more entries than the pack can hold") from None
        raise
    if len(raw) % _ENTRY.size:
        raise CorruptObject(f"{what}: pack header has a partial entry")
    entries = []
    for i in range(0, len(raw), _ENTRY.size):
        cid, off, slen, rlen = _ENTRY.unpack_from(raw, i)
        if off + slen > body_end or slen < 1:
            raise CorruptObject(f"{what}: pack header entry points outside the pack")
        entries.append((cid, off, slen, rlen))
    return entries


class HeaderOpener(Protocol):
    encrypted: bool

    def open_pack_header(self, name: str, sealed: bytes) -> bytes: ...


def read_header(body: bytes, name: str, opener: HeaderOpener | None, sealed_required: bool = False,
                what: str | None = None) -> list[tuple[bytes, int, int, int]]:
    """The entries of a whole pack's header (sealed or not), each checked to lie inside the pack.

    ``sealed_required`` (an encrypted repository of version 2): a plaintext
    header is refused, so a header cannot be swapped for a forged readable one.
    """
    what = what or pack_key(name)
    header_len = parse_trailer_tail(body[-TAIL_SIZE:], what, len(body))
    header = body[len(body) - TAIL_SIZE - header_len:len(body) - TAIL_SIZE]
    sealed = body[-8:] == SEALED_TRAILER_MAGIC
    if sealed:
        if opener is None or not opener.encrypted:
            raise CorruptObject(f"{what}: pack header is encrypted, unlike this repository")
        inner = opener.open_pack_header(name, header)
        return parse_header(inner, len(body) - len(header) + len(inner), what)
    if sealed_required:
        raise CorruptObject(f"{what}: pack header is not encrypted, unlike this repository (replaced?)")
    return parse_header(header, len(body), what)
