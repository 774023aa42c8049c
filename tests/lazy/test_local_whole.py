"""A complete local copy named whole before the kernel serves it (lazy/fs/localread.name_whole)."""

from __future__ import annotations

import logging
import os

import pytest

from ogrefs.lazy.fs.localread import NAME_PIECE, name_whole
from ogrefs.repo import codec


def _copy(tmp_path, pieces: list[bytes | int]) -> tuple[int, int, tuple]:
    """A file of data pieces and holes (an int: that many bytes of hole); its size and its chunk table."""
    path = tmp_path / "copy"
    chunks, pos = [], 0
    with open(path, "wb") as f:
        for p in pieces:
            if isinstance(p, int):
                pos += p
                continue
            f.seek(pos)
            f.write(p)
            chunks.append((pos, len(p), codec.chunk_id(p)))
            pos += len(p)
        f.truncate(pos)
    return os.open(path, os.O_RDWR), pos, tuple(chunks)


@pytest.mark.parametrize("sizes", [[1], [NAME_PIECE], [NAME_PIECE + 1, 3 * NAME_PIECE - 7, 5]])
def test_a_right_copy_is_named_whole_across_pieces_and_holes(tmp_path, sizes):
    fd, size, chunks = _copy(tmp_path, [os.urandom(n) if i % 2 == 0 else 1 << 20 for i, n in enumerate(sizes)])
    try:
        assert name_whole(fd, size, chunks, codec.chunk_hasher)
    finally:
        os.close(fd)


def test_a_flipped_byte_a_short_copy_or_data_in_a_hole_fails(tmp_path):
    fd, size, chunks = _copy(tmp_path, [os.urandom(NAME_PIECE * 2 + 3), 300_000, os.urandom(70_000)])
    try:
        assert name_whole(fd, size, chunks, codec.chunk_hasher)
        was = os.pread(fd, 1, NAME_PIECE + 5)
        os.pwrite(fd, bytes([was[0] ^ 1]), NAME_PIECE + 5)  # inside the first chunk, in its second piece
        assert not name_whole(fd, size, chunks, codec.chunk_hasher)
        os.pwrite(fd, was, NAME_PIECE + 5)
        assert name_whole(fd, size, chunks, codec.chunk_hasher)
        os.pwrite(fd, b"x", NAME_PIECE * 2 + 3 + 1000)  # in the hole between the chunks: must read as zeros
        assert not name_whole(fd, size, chunks, codec.chunk_hasher)
        os.pwrite(fd, b"\0", NAME_PIECE * 2 + 3 + 1000)
        assert name_whole(fd, size, chunks, codec.chunk_hasher)
        os.ftruncate(fd, size - 1)  # the last chunk short
        assert not name_whole(fd, size, chunks, codec.chunk_hasher)
    finally:
        os.close(fd)


def test_a_keyed_repository_names_in_pieces_as_it_names_whole():
    c = codec.RepoCodec(enc_key=os.urandom(32), id_key=os.urandom(32))
    data = os.urandom(3 * NAME_PIECE + 11)
    h = c.chunk_hasher()
    for at in range(0, len(data), NAME_PIECE):
        h.update(data[at:at + NAME_PIECE])
    assert h.digest() == c.chunk_id(data) != codec.chunk_id(data)


@pytest.mark.expect_log(r"local copy of inode \d+ does not hold", level=logging.ERROR, logger="ogrefs.lazy")
def test_a_copy_is_offered_to_a_bypassing_reader_only_if_right_and_never_read_through_the_mount(
        tmp_path_factory, tmp_path):
    """verified_copy (what FUSE passthrough serves from): a complete, right copy is offered, named once while
    it is unchanged; a damaged one never; nor one of a file the mount has answered READs of (the kernel may
    cache its pages, which serve the next reader at no cost)."""
    from ogrefs.lazy.background.materialize.materializer import Materializer
    from ogrefs.lazy.fetch.fetcher import Fetcher
    from ogrefs.lazy.fs.vfs import SnapshotFS

    from tests.resume_box import make_box, run_trio

    box = make_box(tmp_path_factory.mktemp("wholebox"))
    state = tmp_path / "state"
    fetcher = Fetcher(box.repo.read_pack_range)
    m = Materializer(box.catalog, fetcher, state)
    run_trio(fetcher, m.run)
    assert m.complete
    ino = {rel: box.catalog.resolve(box.path(rel)).ino for rel in ("ckpt/model.bin", "venv/lib/site-packages/torch_like.so")}
    fetcher = Fetcher(box.repo.read_pack_range)
    fs = SnapshotFS(box.catalog, fetcher, local=Materializer(box.catalog, fetcher, state))
    got: dict[str, object] = {}

    async def body():
        for attempt in ("first", "again"):
            fd = await fs.verified_copy(ino["ckpt/model.bin"])
            assert fd is not None
            got[attempt] = os.pread(fd, 8, 0)
            os.close(fd)
        assert fs.stats.local_named_whole == 1  # the second time the unchanged copy was trusted
        local = box.tree_of(state) / "ckpt/model.bin"
        with open(local, "r+b") as f:
            f.seek(4 * 1024 * 1024)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 1]))
        got["damaged"] = await fs.verified_copy(ino["ckpt/model.bin"])
        fh = await fs.open(ino["venv/lib/site-packages/torch_like.so"], os.O_RDONLY)
        await fs.read(fh, 0, 4096)
        fs.release(fh)
        got["read before"] = await fs.verified_copy(ino["venv/lib/site-packages/torch_like.so"])

    run_trio(fetcher, body)
    assert got["first"] == got["again"] == (box.src / "ckpt/model.bin").read_bytes()[:8]
    assert got["damaged"] is None and fs.stats.local_corrupt == 1
    assert got["read before"] is None


@pytest.mark.parametrize("where", ["right", "first part", "last part", "gap between parts"])
def test_a_large_copy_named_in_parts_at_once_fails_wherever_it_is_wrong(tmp_path, monkeypatch, where):
    """Up to one part per core, each whole chunks and the gaps after them: every byte is still checked (nine
    chunks in four parts start at chunks 0, 2, 4 and 6; the gap before chunk 6 ends the third part)."""
    import trio

    from ogrefs.lazy.fs import localread
    from ogrefs.lazy.fs.types import VfsStats

    monkeypatch.setattr(localread, "usable_cpus", lambda: 4)
    monkeypatch.setattr(localread, "NAME_PART_MIN", 64 * 1024)
    pieces: list[bytes | int] = []
    for i in range(9):
        pieces += [os.urandom(50_000 + i), 20_000]  # a chunk, then a hole
    fd, size, chunks = _copy(tmp_path, pieces)
    at = {"first part": 10, "last part": size - 20_000 - 7, "gap between parts": chunks[6][0] - 100}.get(where)
    if at is not None:
        was = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([was[0] ^ 0x40]), at)
    reads = localread.LocalReads(None, codec.chunk_id, VfsStats(), None, codec.chunk_hasher)  # type: ignore[arg-type]
    calls = []
    real = localread.name_whole
    monkeypatch.setattr(localread, "name_whole", lambda *a: calls.append(a[-2:]) or real(*a))
    try:
        ok = trio.run(reads._name_in_parts, fd, size, chunks)
    finally:
        os.close(fd)
    assert ok == (where == "right")
    calls.sort()  # (in the order the parts finished)
    assert len(calls) == 4 and calls[0][0] == 0 and calls[-1][1] == size  # four parts, the file covered
    assert all(a[1] == b[0] for a, b in zip(calls, calls[1:]))


@pytest.mark.expect_log(r"cannot be named \(no such table", level=logging.ERROR, logger="ogrefs.lazy")
def test_a_catalog_that_fails_while_a_copy_is_named_leaves_the_file_to_the_daemon(tmp_path):
    """The open that asked goes on without passthrough (before: the error failed the open with EIO)."""
    import sqlite3

    import trio

    from ogrefs.lazy.fs.localread import LocalReads
    from ogrefs.lazy.fs.types import VfsStats

    class Broken:
        def extents(self, ino):
            raise sqlite3.OperationalError("no such table: extents")

    copy = tmp_path / "copy"
    copy.write_bytes(os.urandom(3 << 20))
    reads = LocalReads(Broken(), codec.chunk_id, VfsStats(), None, codec.chunk_hasher)  # type: ignore[arg-type]
    fds_before = len(os.listdir("/proc/self/fd"))
    assert trio.run(reads.whole, 5, os.fsencode(copy), 3 << 20) is None
    assert len(os.listdir("/proc/self/fd")) == fds_before  # the copy's fd closed
