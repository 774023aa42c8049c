"""Byte-level encodings shared by every stored object: chunk blobs and envelopes.

Two shapes exist, described in docs/format.md:

* A *blob* is one chunk as stored inside a pack: one codec byte followed by the
  payload.  Codec 0 is raw, 1 is zstd (its level chosen per chunk, see
  :func:`encode_blob`); readers always go through :func:`decode_blob`.
  Encrypted repositories seal blob and envelope alike (:class:`RepoCodec`).
* An *envelope* wraps every other object (catalogs, manifests, indexes):
  the magic ``OGRF``, a version byte, a codec byte, the BLAKE3 digest of the
  plaintext (so a truncated or bit-flipped object is caught), then the payload.

Hashing and compression here are pure functions on immutable bytes, so they are
safe to run in worker threads; zstd and BLAKE3 release the GIL.
"""

from __future__ import annotations

import os
import threading

import blake3
import zstandard

from ogrefs.errors import CorruptObject

CODEC_RAW = 0
CODEC_ZSTD = 1

ENVELOPE_MAGIC = b"OGRF"
ENVELOPE_VERSION = 1

#: A chunk's first bytes are compressed at level 1 first (a probe).  When the
#: probe does not shrink below ``_PROBE_RATIO`` the chunk is stored raw: zstd on
#: incompressible data (random bytes, already-compressed archives) costs
#: ~7 ms per MiB and buys nothing.
_PROBE_BYTES = 64 * 1024
_PROBE_RATIO = 0.97
#: When the probe keeps more than ``_FAST_RATIO`` of its bytes, the chunk is
#: compressed at level 1 whatever the configured level: on model weights and
#: optimizer state a higher level gains next to nothing for much more CPU
#: (a torch.save checkpoint of float32 tensors: 0.925 of its size at level 3
#: against 0.924 at level 1, at 319-396 against 500-523 MB/s of one core on
#: the 2-core VM), and CPU is what a snapshot inside a preemption notice is
#: short of.  Data that compresses well (code, text, shared libraries) keeps
#: the configured level: a torch venv grows from 0.286 to 0.312 of its size
#: at level 1.
_FAST_RATIO = 0.80
_FAST_LEVEL = 1

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


#: Default bound on what an envelope may inflate to: zstd can reach ~32,000:1, so a few KB
#: could otherwise claim gigabytes. No real object compresses 64:1 *and* is large.
_DEFAULT_RATIO = 64
_DEFAULT_SLACK = 64 * 1024 * 1024


def default_limit(stored_len: int) -> int:
    """How large an envelope of ``stored_len`` bytes may be once inflated, when its type sets no bound."""
    return _DEFAULT_RATIO * stored_len + _DEFAULT_SLACK


def inflate(payload: bytes | memoryview, limit: int, what: str) -> bytes:
    """Decompress one zstd frame, never producing (or allocating) more than ``limit`` bytes.

    ``ZstdDecompressor.decompress`` trusts the frame's content size and
    allocates it whatever ``max_output_size`` says, so the size is checked
    first; a frame without one is inflated piecewise up to the bound.
    """
    try:
        size = zstandard.frame_content_size(payload)
        if size > limit:
            raise CorruptObject(f"{what} claims to inflate to {size} bytes, more than its bound of {limit}")
        if size >= 0:
            return _decompressor().decompress(payload)
        reader = _decompressor().stream_reader(payload)
        parts, total = [], 0
        while piece := reader.read(min(1 << 20, limit - total + 1)):
            total += len(piece)
            if total > limit:
                raise CorruptObject(f"{what} inflates to more than its bound of {limit} bytes")
            parts.append(piece)
        return b"".join(parts)
    except zstandard.ZstdError as exc:
        raise CorruptObject(f"{what} does not decompress: {exc}") from None


def chunk_id(data: bytes | memoryview) -> bytes:
    """The 32-byte BLAKE3 digest that names a chunk."""
    return blake3.blake3(data).digest()


def chunk_hasher() -> "blake3.blake3":
    """A hasher whose ``digest()`` after ``update``s of a chunk's bytes in pieces is :func:`chunk_id`'s."""
    return blake3.blake3()


_RAW_PREFIX = bytes([CODEC_RAW])


def encode_blob(data: bytes | memoryview, level: int = 3) -> bytes:
    """Compress ``data`` when it pays, at the level that pays (see ``_FAST_RATIO``), and prefix the codec byte."""
    if level > 0 and len(data) >= 64:
        if len(data) > 2 * _PROBE_BYTES:
            probe = len(_compressor(_FAST_LEVEL).compress(data[:_PROBE_BYTES]))
            if probe > _PROBE_RATIO * _PROBE_BYTES:
                return b"".join((_RAW_PREFIX, data))  # one copy, also of a memoryview
            if probe > _FAST_RATIO * _PROBE_BYTES:
                level = min(level, _FAST_LEVEL)
        packed = _compressor(level).compress(data)
        if len(packed) < len(data):
            return bytes([CODEC_ZSTD]) + packed
    return b"".join((_RAW_PREFIX, data))


def decode_blob(blob: bytes | memoryview, raw_len: int, expected_id: bytes | None = None) -> bytes:
    """Undo :func:`encode_blob`; with ``expected_id``, verify the plaintext hash.

    Raises CorruptObject instead of ever returning bytes that do not match.
    """
    if len(blob) < 1:
        raise CorruptObject("empty blob")
    if not 0 <= raw_len < 2**32:
        raise CorruptObject(f"blob claims an impossible size ({raw_len} bytes)")
    codec = blob[0]
    payload = blob[1:]
    if codec == CODEC_RAW:
        data = bytes(payload)
    elif codec == CODEC_ZSTD:
        data = inflate(payload, raw_len, "zstd payload of a blob")
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


def unwrap(obj: bytes, what: str = "object", limit: int | None = None) -> bytes:
    """Open an envelope; a bad magic, version or codec is a CorruptObject.

    ``limit`` bounds the plaintext (default: :func:`default_limit` of the object's size).
    """
    if len(obj) < 38 or obj[:4] != ENVELOPE_MAGIC:
        raise CorruptObject(f"{what} is not an ogrefs object (bad magic)")
    version, codec = obj[4], obj[5]
    if version != ENVELOPE_VERSION:
        raise CorruptObject(f"{what} has envelope version {version}, this ogrefs reads {ENVELOPE_VERSION}")
    digest = obj[6:38]
    payload = obj[38:]
    bound = default_limit(len(obj)) if limit is None else limit
    if codec == CODEC_RAW:
        if len(payload) > bound:
            raise CorruptObject(f"{what} is larger than its bound of {bound} bytes")
        plain = bytes(payload)
    elif codec == CODEC_ZSTD:
        plain = inflate(payload, bound, what)
    else:
        raise CorruptObject(f"{what} has unknown codec {codec}")
    if blake3.blake3(plain).digest() != digest:
        raise CorruptObject(f"{what} fails its BLAKE3 check (truncated or corrupted)")
    return plain


# -- per-repository codec: the same encodings, optionally encrypted ------------------

ENCRYPTED_FLAG = 0x80
NONCE_LEN = 12
TAG_LEN = 16


class RepoCodec:
    """Encodes and decodes a repository's blobs and envelopes, with or without encryption.

    Unencrypted, it is exactly the module functions above.  Encrypted
    (AES-256-GCM), a blob is ``nonce | AESGCM(codec byte + payload)`` bound to
    its chunk id, an envelope is ``OGRF | version | codec|0x80 | nonce |
    AESGCM(payload)`` bound to its object key, so a swapped or tampered object
    fails authentication instead of decrypting into wrong data.  Chunk ids
    become keyed BLAKE3, so ids reveal nothing about content.

    Immutable after construction and thread-safe (AESGCM objects are).
    """

    def __init__(self, level: int = 3, enc_key: bytes | None = None, id_key: bytes | None = None) -> None:
        self.level = level
        self.encrypted = enc_key is not None
        self._id_key = id_key
        self._aead = None
        if enc_key is not None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            if id_key is None or len(id_key) != 32 or len(enc_key) != 32:
                raise ValueError("encryption needs a 32-byte key and a 32-byte id key")
            self._aead = AESGCM(enc_key)

    def cache_key(self) -> bytes | None:
        """A key for encrypting the local chunk cache, derived from the master key (None if unencrypted)."""
        if self._id_key is None:
            return None
        return blake3.blake3(self._id_key, derive_key_context="ogrefs 2026 local chunk cache key").digest()

    def local_key(self, context: str) -> bytes | None:
        """A key for authenticating local cache state, derived from the master key (None if unencrypted)."""
        if self._id_key is None:
            return None
        return blake3.blake3(self._id_key, derive_key_context=context).digest()

    def chunk_id(self, data: bytes | memoryview) -> bytes:
        if self._id_key is None:
            return chunk_id(data)
        return blake3.blake3(data, key=self._id_key).digest()

    def chunk_hasher(self) -> "blake3.blake3":
        """:func:`chunk_hasher` for this repository (keyed when encrypted): :meth:`chunk_id` in pieces."""
        return chunk_hasher() if self._id_key is None else blake3.blake3(key=self._id_key)

    def _seal(self, plain: bytes, aad: bytes) -> bytes:
        nonce = os.urandom(NONCE_LEN)
        return nonce + self._aead.encrypt(nonce, plain, aad)

    def _open(self, sealed: bytes | memoryview, aad: bytes, what: str) -> bytes:
        from cryptography.exceptions import InvalidTag

        if len(sealed) < NONCE_LEN + TAG_LEN:
            raise CorruptObject(f"{what}: encrypted object too short")
        try:
            return self._aead.decrypt(bytes(sealed[:NONCE_LEN]), bytes(sealed[NONCE_LEN:]), aad)
        except InvalidTag:
            raise CorruptObject(f"{what}: authentication failed (tampered, swapped or wrong key)") from None

    def encode_blob(self, cid: bytes, data: bytes | memoryview) -> bytes:
        blob = encode_blob(data, self.level)
        return self._seal(blob, cid) if self._aead else blob

    def decode_blob(self, blob: bytes | memoryview, raw_len: int, expected_id: bytes) -> bytes:
        if self._aead:
            blob = self._open(blob, expected_id, f"chunk {expected_id.hex()[:16]}")
            data = decode_blob(blob, raw_len, None)
            if self.chunk_id(data) != expected_id:
                raise CorruptObject(f"chunk {expected_id.hex()[:16]} fails keyed BLAKE3 verification")
            return data
        return decode_blob(blob, raw_len, expected_id)

    def seal_pack_header(self, name: str, header: bytes) -> bytes:
        """A pack header sealed to its pack's name (format version 2): blob sizes stay private."""
        return self._seal(header, b"OGRFPK02" + name.encode())

    def open_pack_header(self, name: str, sealed: bytes) -> bytes:
        return self._open(sealed, b"OGRFPK02" + name.encode(), f"pack {name[:16]} header")

    def seal(self, name: str, payload: bytes, compress: bool = True) -> bytes:
        """Envelope for the object stored under key ``name``."""
        if not self._aead:
            return wrap(payload, compress, self.level)
        inner = _compressor(self.level).compress(payload) if compress else payload
        codec = (CODEC_ZSTD if compress else CODEC_RAW) | ENCRYPTED_FLAG
        header = ENVELOPE_MAGIC + bytes([ENVELOPE_VERSION, codec])
        return header + self._seal(inner, header + name.encode())

    def open(self, name: str, obj: bytes, limit: int | None = None) -> bytes:
        """Open the envelope stored under ``name``; ``limit`` bounds the plaintext (see :func:`unwrap`)."""
        if len(obj) < 6 or obj[:4] != ENVELOPE_MAGIC:
            raise CorruptObject(f"{name} is not an ogrefs object (bad magic)")
        encrypted = bool(obj[5] & ENCRYPTED_FLAG)
        if encrypted != bool(self._aead):
            state = "encrypted" if encrypted else "not encrypted"
            raise CorruptObject(f"{name} is {state}, unlike this repository (replaced object?)")
        if not self._aead:
            return unwrap(obj, name, limit)
        if obj[4] != ENVELOPE_VERSION:
            raise CorruptObject(f"{name} has envelope version {obj[4]}, this ogrefs reads {ENVELOPE_VERSION}")
        bound = default_limit(len(obj)) if limit is None else limit
        inner = self._open(memoryview(obj)[6:], bytes(obj[:6]) + name.encode(), name)
        if obj[5] & ~ENCRYPTED_FLAG == CODEC_ZSTD:
            return inflate(inner, bound, name)
        if len(inner) > bound:
            raise CorruptObject(f"{name} is larger than its bound of {bound} bytes")
        return inner
