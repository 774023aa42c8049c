"""Byte-level encodings shared by every stored object: chunk blobs and envelopes.

Two shapes exist, described in docs/format.md:

* A *blob* is one chunk as stored inside a pack: one codec byte followed by the
  payload.  Codec 0 is raw, 1 is zstd.  The codec byte is the hook for
  authenticated encryption later (a flag bit plus nonce and tag), so readers
  always go through :func:`decode_blob`.
* An *envelope* wraps every other object (catalogs, manifests, indexes):
  the magic ``OGRF``, a version byte, a codec byte, the BLAKE3 digest of the
  plaintext (so a truncated or bit-flipped object is caught), then the payload.

Hashing and compression here are pure functions on immutable bytes, so they are
safe to run in worker threads; zstd and BLAKE3 release the GIL.
"""

from __future__ import annotations

import threading

import blake3
import zstandard

from .errors import CorruptObject

CODEC_RAW = 0
CODEC_ZSTD = 1

ENVELOPE_MAGIC = b"OGRF"
ENVELOPE_VERSION = 1

#: When a probe of the chunk's first bytes does not shrink below this ratio,
#: the chunk is stored raw: zstd on incompressible data (model weights,
#: already-compressed archives) costs ~7 ms per MiB and buys nothing.
_PROBE_BYTES = 64 * 1024
_PROBE_RATIO = 0.97

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # ZstdCompressor objects are not thread-safe; keep one per thread and level.
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    comp = cache.get(level)
    if comp is None:
        comp = cache[level] = zstandard.ZstdCompressor(level=level)
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    dec = getattr(_local, "decompressor", None)
    if dec is None:
        dec = _local.decompressor = zstandard.ZstdDecompressor()
    return dec


def chunk_id(data: bytes | memoryview) -> bytes:
    """The 32-byte BLAKE3 digest that names a chunk."""
    return blake3.blake3(data).digest()


def encode_blob(data: bytes | memoryview, level: int = 3) -> bytes:
    """Compress ``data`` when it pays, and prefix the codec byte."""
    if level > 0 and len(data) >= 64:
        comp = _compressor(level)
        if len(data) > 2 * _PROBE_BYTES:
            probe = comp.compress(data[:_PROBE_BYTES])
            if len(probe) > _PROBE_RATIO * _PROBE_BYTES:
                return bytes([CODEC_RAW]) + bytes(data)
        packed = comp.compress(data)
        if len(packed) < len(data):
            return bytes([CODEC_ZSTD]) + packed
    return bytes([CODEC_RAW]) + bytes(data)


def decode_blob(blob: bytes | memoryview, raw_len: int, expected_id: bytes | None = None) -> bytes:
    """Undo :func:`encode_blob`; with ``expected_id``, verify the plaintext hash.

    Raises CorruptObject instead of ever returning bytes that do not match.
    """
    if len(blob) < 1:
        raise CorruptObject("empty blob")
    codec = blob[0]
    payload = blob[1:]
    if codec == CODEC_RAW:
        data = bytes(payload)
    elif codec == CODEC_ZSTD:
        try:
            data = _decompressor().decompress(payload, max_output_size=raw_len)
        except zstandard.ZstdError as exc:
            raise CorruptObject(f"zstd payload does not decode: {exc}") from None
    else:
        raise CorruptObject(f"unknown blob codec {codec}")
    if len(data) != raw_len:
        raise CorruptObject(f"blob decodes to {len(data)} bytes, expected {raw_len}")
    if expected_id is not None and chunk_id(data) != expected_id:
        raise CorruptObject(f"chunk {expected_id.hex()[:16]} fails BLAKE3 verification")
    return data


def wrap(payload: bytes, compress: bool = True, level: int = 3) -> bytes:
    """Envelope an object's payload (catalog, manifest, index)."""
    digest = blake3.blake3(payload).digest()
    if compress:
        return ENVELOPE_MAGIC + bytes([ENVELOPE_VERSION, CODEC_ZSTD]) + digest + _compressor(level).compress(payload)
    return ENVELOPE_MAGIC + bytes([ENVELOPE_VERSION, CODEC_RAW]) + digest + payload


def unwrap(obj: bytes, what: str = "object") -> bytes:
    """Open an envelope; a bad magic, version or codec is a CorruptObject."""
    if len(obj) < 38 or obj[:4] != ENVELOPE_MAGIC:
        raise CorruptObject(f"{what} is not an ogrefs object (bad magic)")
    version, codec = obj[4], obj[5]
    if version != ENVELOPE_VERSION:
        raise CorruptObject(f"{what} has envelope version {version}, this ogrefs reads {ENVELOPE_VERSION}")
    digest = obj[6:38]
    payload = obj[38:]
    if codec == CODEC_RAW:
        plain = bytes(payload)
    elif codec == CODEC_ZSTD:
        try:
            plain = _decompressor().decompressobj().decompress(payload)
        except zstandard.ZstdError as exc:
            raise CorruptObject(f"{what} does not decompress: {exc}") from None
    else:
        raise CorruptObject(f"{what} has unknown codec {codec}")
    if blake3.blake3(plain).digest() != digest:
        raise CorruptObject(f"{what} fails its BLAKE3 check (truncated or corrupted)")
    return plain
