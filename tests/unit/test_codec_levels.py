"""Which encoding a chunk gets: raw, zstd at level 1 (weights-like), or zstd at the configured level."""

from __future__ import annotations

import array
import os
import random

import zstandard

from ogrefs.repo import codec

MiB = 1024 * 1024


def _weights(n_bytes: int) -> bytes:
    """float32 values like a model's weights: random mantissas, a few exponents (~0.93 at any zstd level)."""
    rng = random.Random(7)
    return array.array("f", (rng.gauss(0.0, 0.02) for _ in range(n_bytes // 4))).tobytes()


def _text(n_bytes: int) -> bytes:
    """Source-code-like bytes: compress well, and better at level 3 than at level 1."""
    rng = random.Random(3)
    words = [f"def f{i}(x, y):\n    return x * {i} + y  # {rng.random():.6f}\n".encode() for i in range(4000)]
    out = bytearray()
    while len(out) < n_bytes:
        out += rng.choice(words)
    return bytes(out[:n_bytes])


def _zstd(data: bytes, level: int) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(data)


def test_a_weights_chunk_is_compressed_at_level_one_whatever_the_configured_level():
    data = _weights(1 * MiB)
    assert _zstd(data, 1) != _zstd(data, 3)  # (else this test could not tell the levels apart)
    blob = codec.encode_blob(data, level=3)
    assert blob[0] == codec.CODEC_ZSTD and blob[1:] == _zstd(data, 1)
    assert codec.decode_blob(blob, len(data), codec.chunk_id(data)) == data


def test_a_chunk_that_compresses_well_keeps_the_configured_level():
    data = _text(1 * MiB)
    assert len(_zstd(data, 3)) < len(_zstd(data, 1))
    blob = codec.encode_blob(data, level=3)
    assert blob[0] == codec.CODEC_ZSTD and blob[1:] == _zstd(data, 3)
    assert codec.decode_blob(blob, len(data), codec.chunk_id(data)) == data


def test_random_bytes_are_stored_raw_and_level_zero_never_compresses():
    noise = os.urandom(1 * MiB)
    assert codec.encode_blob(noise, level=3) == bytes([codec.CODEC_RAW]) + noise
    text = _text(256 * 1024)
    assert codec.encode_blob(text, level=0) == bytes([codec.CODEC_RAW]) + text


def test_a_small_chunk_has_no_probe_and_keeps_the_configured_level():
    data = _weights(100 * 1024)  # not over two probes: compressed whole at the configured level
    blob = codec.encode_blob(data, level=3)
    assert blob[0] == codec.CODEC_ZSTD and blob[1:] == _zstd(data, 3)
