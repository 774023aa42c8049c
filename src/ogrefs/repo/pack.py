"""Pack objects: many chunk blobs in one store object, with a self-describing trailer.

Layout (docs/format.md)::

    blob_0 | blob_1 | ... | blob_n-1 | header | u32 header_len | b"OGRFPK01"

``header`` is a zstd-compressed array of fixed 48-byte entries
``(chunk_id[32], offset u64, stored_len u32, raw_len u32)``.  Readers normally
never touch it (the catalog and the index already hold every location); it
exists so that the index can be rebuilt from packs alone and so that ``check``
can prove a pack is what the index says.
"""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass

import zstandard

from ..errors import CorruptObject

TRAILER_MAGIC = b"OGRFPK01"
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


class PackBuilder:
    """Accumulates blobs for one pack.  Owned by a single thread (the snapshotter)."""

    def __init__(self) -> None:
        self._body = bytearray()
        self._entries: list[tuple[bytes, int, int, int]] = []
        self.size = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, cid: bytes, blob: bytes, raw_len: int) -> int:
        """Append a blob; returns its offset within the pack."""
        offset = self.size
        self._body += blob
        self._entries.append((cid, offset, len(blob), raw_len))
        self.size += len(blob)
        return offset

    def finish(self) -> tuple[str, bytes, list[tuple[bytes, int, int, int]]]:
        """Seal the pack: returns (pack name, bytes, entries).

        The name is random, not a content hash: a pack re-uploaded with the same
        bytes after prune marked the old one must never share its name, or the
        deferred deletion of the old one would delete the new one.
        """
        header = zstandard.ZstdCompressor(level=3).compress(b"".join(_ENTRY.pack(*e) for e in self._entries))
        self._body += header
        self._body += _TAIL.pack(len(header), TRAILER_MAGIC)
        body = bytes(self._body)
        self._body = bytearray()
        name = secrets.token_hex(32)
        return name, body, list(self._entries)


def pack_key(name: str) -> str:
    return f"packs/{name[:2]}/{name}"


def parse_trailer_tail(tail: bytes, what: str) -> int:
    """From the last TAIL_SIZE bytes, the header length; raises CorruptObject."""
    if len(tail) != TAIL_SIZE:
        raise CorruptObject(f"{what}: pack too short")
    header_len, magic = _TAIL.unpack(tail)
    if magic != TRAILER_MAGIC:
        raise CorruptObject(f"{what}: pack trailer has bad magic")
    return header_len


def parse_header(header: bytes, pack_size: int, what: str) -> list[tuple[bytes, int, int, int]]:
    """Decode a pack header into entries, checking each lies inside the pack body."""
    try:
        raw = zstandard.ZstdDecompressor().decompressobj().decompress(header)
    except zstandard.ZstdError as exc:
        raise CorruptObject(f"{what}: pack header does not decompress ({exc})") from None
    if len(raw) % _ENTRY.size:
        raise CorruptObject(f"{what}: pack header has a partial entry")
    body_end = pack_size - len(header) - TAIL_SIZE
    entries = []
    for i in range(0, len(raw), _ENTRY.size):
        cid, off, slen, rlen = _ENTRY.unpack_from(raw, i)
        if off + slen > body_end or slen < 1:
            raise CorruptObject(f"{what}: pack header entry points outside the pack")
        entries.append((cid, off, slen, rlen))
    return entries
