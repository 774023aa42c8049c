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


def parse_trailer_tail(tail: bytes, what: str, pack_size: int | None = None) -> int:
    """From the last TAIL_SIZE bytes, the header length; raises CorruptObject.

    With ``pack_size`` (the whole pack's length), a header length that does
    not fit in the pack is refused here, before anyone slices with it.
    """
    if len(tail) != TAIL_SIZE:
        raise CorruptObject(f"{what}: pack too short")
    header_len, magic = _TAIL.unpack(tail)
    if magic != TRAILER_MAGIC:
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
    limit = body_end * _ENTRY.size
    try:
        size = zstandard.frame_content_size(header)
        if size > limit:
            raise CorruptObject(f"{what}: pack header claims more entries than the pack can hold")
        if size >= 0:
            raw = zstandard.ZstdDecompressor().decompress(header, max_output_size=size)
        else:  # a frame without its size: inflate piecewise, no further than the limit
            reader = zstandard.ZstdDecompressor().stream_reader(header)
            parts, total = [], 0
            while piece := reader.read(1 << 20):
                total += len(piece)
                if total > limit:
                    raise CorruptObject(f"{what}: pack header claims more entries than the pack can hold")
                parts.append(piece)
            raw = b"".join(parts)
    except zstandard.ZstdError as exc:
        raise CorruptObject(f"{what}: pack header does not decompress ({exc})") from None
    if len(raw) % _ENTRY.size:
        raise CorruptObject(f"{what}: pack header has a partial entry")
    entries = []
    for i in range(0, len(raw), _ENTRY.size):
        cid, off, slen, rlen = _ENTRY.unpack_from(raw, i)
        if off + slen > body_end or slen < 1:
            raise CorruptObject(f"{what}: pack header entry points outside the pack")
        entries.append((cid, off, slen, rlen))
    return entries
