"""The chunker's windows never move a cut: a file read window by window cuts exactly as the whole file would.

Chunk boundaries are the repository's deduplication: if a change in how the
file is read (the window size, where a window's uncut tail is re-read) moved
a cut, the next snapshot of an unchanged file would store it again.
"""

from __future__ import annotations

import os
import random

import pyfastcdc
import pytest

from ogrefs.repo.config import ChunkerParams
from ogrefs.snapshot import chunker as chunker_mod
from ogrefs.snapshot.chunker import Chunker, data_extents

SMALL = ChunkerParams(min_size=16 << 10, avg_size=64 << 10, max_size=256 << 10)


def _reference(data: bytes, params: ChunkerParams) -> list[tuple[int, bytes]]:
    """FastCDC over the whole file in one buffer, as Chunker configures it."""
    cdc = pyfastcdc.FastCDC(max(256, params.avg_size - params.min_size), min_size=params.min_size,
                            max_size=params.max_size)
    return [(c.offset, bytes(c.data)) for c in cdc.cut_buf(data)]


@pytest.mark.parametrize("window", [SMALL.max_size, 1 << 20, (1 << 20) + 4097, 4 << 20])  # one no larger than a chunk
@pytest.mark.parametrize("size", [0, 1000, 16 << 10, 1 << 20, (3 << 20) + 7, 9 << 20])
def test_windows_cut_where_the_whole_file_cuts(tmp_path, monkeypatch, window, size):
    monkeypatch.setattr(chunker_mod, "WINDOW", window)
    rng = random.Random(size ^ window)
    part = rng.randbytes(max(size // 3, 1))
    data = (part + rng.randbytes(size // 3) + part + part)[:size]  # repeats, as real files have
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = list(Chunker(SMALL).chunks(fd, data_extents(fd, size)))
    finally:
        os.close(fd)
    assert [(off, bytes(d)) for off, d in got] == (_reference(data, SMALL) if size > SMALL.min_size else
                                                   ([(0, data)] if data else []))
    for _, d in got:  # handed to hash threads: never a view of something that can change
        assert isinstance(d, bytes) or (isinstance(d, memoryview) and d.readonly and isinstance(d.obj, bytes))


def test_a_file_that_shrinks_while_read_ends_its_chunks_at_its_new_end(tmp_path, monkeypatch):
    monkeypatch.setattr(chunker_mod, "WINDOW", 1 << 20)
    data = random.Random(7).randbytes(5 << 20)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        out = []
        for off, d in Chunker(SMALL).chunks(fd, [(0, len(data))]):
            out.append((off, bytes(d)))
            if len(out) == 3:
                os.truncate(path, 2 << 20)
    finally:
        os.close(fd)
    joined = b"".join(d for _, d in out)
    assert joined == data[:2 << 20]
    assert [off for off, _ in out] == sorted(off for off, _ in out)


@pytest.mark.timeout(20)  # a window with no real cut looped in place before it was sized
@pytest.mark.parametrize("window", [SMALL.max_size, SMALL.max_size + 1, 1 << 20])
def test_data_without_a_content_cut_is_cut_at_max_size_whatever_the_window(tmp_path, monkeypatch, window):
    """Zeros give FastCDC no cut: every chunk is max_size, and a window no larger than that holds no real cut."""
    monkeypatch.setattr(chunker_mod, "WINDOW", window)
    data = bytes(3 << 20) + random.Random(3).randbytes(100_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = [(off, bytes(d)) for off, d in Chunker(SMALL).chunks(fd, [(0, len(data))])]
    finally:
        os.close(fd)
    assert got == _reference(data, SMALL)
    assert got[0] == (0, bytes(SMALL.max_size))
