"""Where one chunk is stored and how to check it: a catalog extent's location, validated.

A :class:`ChunkRef` is what every reader of a chunk needs (the fetcher, the
materializer's plan, a replayed trace): the chunk's id (BLAKE3-256 of its
plaintext, which verifies it), its pack, the blob's offset and stored length
in that pack, and its plaintext length.  It is an immutable value: safe to
hand to worker threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ogrefs.repo.catalog import Extent


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """Everything needed to fetch and verify one chunk; well-formed or it does not exist.

    The fields come from a catalog, which may be forged: a location of the
    wrong type (text where an offset belongs) would break the fetcher's
    bookkeeping far from its cause, so it is refused here (ValueError).
    """

    chunk: bytes  # BLAKE3-256 of the plaintext
    pack: str
    offset: int  # of the blob in the pack
    stored_len: int
    raw_len: int

    def __post_init__(self) -> None:
        if not (type(self.chunk) is bytes and type(self.pack) is str and type(self.offset) is int
                and type(self.stored_len) is int and type(self.raw_len) is int
                and self.offset >= 0 and self.stored_len >= 0 and self.raw_len >= 0):
            raise ValueError(f"malformed chunk location {self.pack!r} at {self.offset!r}")

    @classmethod
    def from_extent(cls, ext: "Extent") -> "ChunkRef":
        """The chunk behind a catalog extent (an extent is always one whole chunk)."""
        return cls(ext.chunk, ext.pack, ext.pack_offset, ext.stored_len, ext.length)
