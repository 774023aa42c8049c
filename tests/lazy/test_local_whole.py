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


@pytest.fixture(scope="module")
def materialized(tmp_path_factory):
    """A box, and a state directory whose materializer completed its copy (the plan records what it wrote)."""
    from ogrefs.lazy.background.materialize.materializer import Materializer
    from ogrefs.lazy.fetch.fetcher import Fetcher

    from tests.resume_box import make_box, run_trio

    box = make_box(tmp_path_factory.mktemp("wholebox"))
    state = tmp_path_factory.mktemp("wholestate") / "state"
    fetcher = Fetcher(box.repo.read_pack_range)
    m = Materializer(box.catalog, fetcher, state)
    run_trio(fetcher, m.run)
    assert m.complete
    return box, state


def _offer(box, state, body, tmp_path, *, recorder=None):
    """``body(fs, ino, copy_path)`` on a fresh mount's vfs over a copy of the materialized state (its own copy:
    a test may damage it)."""
    import subprocess

    from ogrefs.box.copyplan import Plan
    from ogrefs.lazy.background.materialize.materializer import Materializer
    from ogrefs.localtree import copy_identity
    from ogrefs.lazy.fetch.fetcher import Fetcher
    from ogrefs.lazy.fs.vfs import SnapshotFS

    from tests.resume_box import run_trio

    mine = tmp_path / "state"
    tmp_path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", str(state), str(mine)], check=True, timeout=60)  # (new inodes: the plan's records no longer match them, so:)
    plan = Plan(mine / "materialize.sqlite")
    ckpt, lib = (box.catalog.resolve(box.path(rel)).ino for rel in ("ckpt/model.bin", "venv/lib/site-packages/torch_like.so"))
    assert plan.written(ckpt) is not None and plan.written(lib) is not None  # (both large: the writer recorded them)
    plan.mark_complete([ckpt], {ckpt: copy_identity(os.stat(box.tree_of(mine) / "ckpt/model.bin"))})
    plan.mark_complete([lib])  # complete, without a record (as an older ogrefs left it)
    fetcher = Fetcher(box.repo.read_pack_range)
    fs = SnapshotFS(box.catalog, fetcher, local=Materializer(box.catalog, fetcher, mine), recorder=recorder)
    ino = {rel: box.catalog.resolve(box.path(rel)).ino for rel in ("ckpt/model.bin", "venv/lib/site-packages/torch_like.so")}
    run_trio(fetcher, lambda: body(fs, ino, lambda rel: box.tree_of(mine) / rel))
    return fs


def test_a_copy_its_writer_recorded_is_offered_unread_and_an_unchanged_copy_once_named_again_unread(
        materialized, tmp_path):
    """verified_copy (what FUSE passthrough serves from): a copy the materializer recorded complete, unchanged
    since, is offered without being read (a mount that materializes while the job runs, or a remount in the
    same boot); one without a record is named whole once, then trusted while unchanged."""
    box, state = materialized
    got: dict[str, object] = {}

    async def body(fs, ino, local):
        for attempt in ("recorded", "again"):
            fd = await fs.verified_copy(ino["ckpt/model.bin"])
            assert fd is not None
            got[attempt] = os.pread(fd, 8, 0)
            os.close(fd)
        got["after recorded"] = (fs.stats.local_written_whole, fs.stats.local_named_whole)
        for attempt in ("unrecorded", "unrecorded again"):  # (named, then trusted)
            fd = await fs.verified_copy(ino["venv/lib/site-packages/torch_like.so"])
            assert fd is not None
            os.close(fd)
        got["after unrecorded"] = (fs.stats.local_written_whole, fs.stats.local_named_whole)

    fs = _offer(box, state, body, tmp_path)
    assert got["recorded"] == got["again"] == (box.src / "ckpt/model.bin").read_bytes()[:8]
    assert got["after recorded"] == (1, 0)  # offered as written: not read back, not named
    assert got["after unrecorded"] == (1, 1)  # named once
    assert fs.stats.local_corrupt == 0


@pytest.mark.expect_log(r"local copy of inode \d+ does not hold", level=logging.ERROR, logger="ogrefs.lazy")
@pytest.mark.parametrize("mtime", ["changed", "set back"])
def test_a_recorded_copy_changed_since_is_named_and_a_damaged_one_never_offered(materialized, tmp_path, mtime):
    """A byte flipped through the file system changes the copy's ctime (nobody can set that back), so the record
    no longer vouches for it: it is named, found wrong and never offered."""
    box, state = materialized
    got: dict[str, object] = {}

    async def body(fs, ino, local):
        path = local("ckpt/model.bin")
        st = os.stat(path)
        with open(path, "r+b") as f:
            f.seek(4 * 1024 * 1024)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 1]))
        if mtime == "set back":
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            assert os.stat(path).st_mtime_ns == st.st_mtime_ns
        got["fd"] = await fs.verified_copy(ino["ckpt/model.bin"])

    fs = _offer(box, state, body, tmp_path)
    assert got["fd"] is None and fs.stats.local_corrupt == 1
    assert fs.stats.local_written_whole == 0 and fs.stats.local_named_whole == 0


def test_a_record_of_another_boot_is_not_trusted(materialized, tmp_path, monkeypatch):
    """Across a reboot the disk may have been anywhere: the copy is named again (and offered, being right)."""
    from ogrefs import localtree

    box, state = materialized
    got: dict[str, object] = {}

    async def body(fs, ino, local):
        monkeypatch.setattr(localtree, "_BOOT_ID", "another-boot")
        got["fd"] = await fs.verified_copy(ino["ckpt/model.bin"])

    fs = _offer(box, state, body, tmp_path)
    assert got["fd"] is not None
    os.close(got["fd"])
    assert (fs.stats.local_written_whole, fs.stats.local_named_whole, fs.stats.local_corrupt) == (0, 1, 0)


def test_no_copy_is_offered_while_a_trace_is_recorded_nor_of_a_file_read_through_the_mount(materialized, tmp_path):
    """While a trace is recorded the daemon must see the reads it is made of; a file the mount has answered READs
    of may have its pages in the kernel's cache, which serves the next reader at no cost."""
    from ogrefs.lazy.trace.recorder import Recorder

    box, state = materialized
    got: dict[str, object] = {}

    async def recording(fs, ino, local):
        got["recording"] = await fs.verified_copy(ino["ckpt/model.bin"])

    recorder = Recorder(box.catalog)
    assert recorder.active
    _offer(box, state, recording, tmp_path / "a", recorder=recorder)
    assert got["recording"] is None
    recorder.stop()
    fd = None

    async def stopped(fs, ino, local):
        nonlocal fd
        fd = await fs.verified_copy(ino["ckpt/model.bin"])
        fh = await fs.open(ino["venv/lib/site-packages/torch_like.so"], os.O_RDONLY)
        await fs.read(fh, 0, 4096)
        fs.release(fh)
        got["read before"] = await fs.verified_copy(ino["venv/lib/site-packages/torch_like.so"])

    _offer(box, state, stopped, tmp_path / "b", recorder=recorder)
    assert fd is not None  # (the recording over: offered)
    os.close(fd)
    assert got["read before"] is None


def test_a_large_copy_without_a_record_is_left_to_the_daemon_not_named_at_its_open(materialized, tmp_path,
                                                                                    monkeypatch):
    """Naming it would make the open wait for the whole file to be read and hashed (a reader of a few pages of
    a 50 GB file); the daemon names only what is read."""
    from ogrefs.lazy.fs import localread

    box, state = materialized
    monkeypatch.setattr(localread, "NAME_AT_OPEN_MAX", 1 << 20)
    got: dict[str, object] = {}

    async def body(fs, ino, local):
        got["recorded"] = await fs.verified_copy(ino["ckpt/model.bin"])
        got["unrecorded"] = await fs.verified_copy(ino["venv/lib/site-packages/torch_like.so"])

    fs = _offer(box, state, body, tmp_path)
    assert got["recorded"] is not None  # recorded: no naming, whatever its size
    os.close(got["recorded"])
    assert got["unrecorded"] is None
    assert (fs.stats.local_too_large_to_name, fs.stats.local_named_whole) == (1, 0)


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


def test_the_writer_records_what_each_large_file_became_and_a_plan_of_an_older_ogrefs_opens(materialized, tmp_path):
    """Recorded complete, a file over RECORD_WRITTEN_ABOVE carries its identity once its metadata is set (what it
    still is: nothing changed it since); a small one costs no stat.  A plan made before the record existed gets
    the column and reads as "not recorded"."""
    import sqlite3

    from ogrefs.box.copyplan import Plan
    from ogrefs.lazy.background.materialize.writer import RECORD_WRITTEN_ABOVE
    from ogrefs.lazy.fs.vfs import KERNEL_PAGES_MAX
    from ogrefs.localtree import copy_identity

    assert RECORD_WRITTEN_ABOVE <= KERNEL_PAGES_MAX  # every file passthrough may serve is recorded
    box, state = materialized
    plan = Plan(state / "materialize.sqlite")
    large = small = 0
    for path, node in box.catalog.walk(1):
        if not node.is_reg:
            continue
        recorded = plan.written(node.ino)
        if node.size > RECORD_WRITTEN_ABOVE:
            large += 1
            assert recorded == copy_identity(os.stat(state / "tree" / os.fsdecode(path).lstrip("/"))), path
        else:
            small += 1
            assert recorded is None, path
    assert large >= 2 and small >= 10

    old = tmp_path / "old.sqlite"
    with sqlite3.connect(old) as db:
        db.execute("CREATE TABLE files (ino INTEGER PRIMARY KEY, path BLOB NOT NULL, pending INTEGER NOT NULL DEFAULT 0,"
                   " complete INTEGER NOT NULL DEFAULT 0)")
        db.execute("INSERT INTO files VALUES (7, x'2f61', 0, 1)")
    db.close()
    plan = Plan(old)
    assert plan.open("snap") == "snap"
    assert plan.written(7) is None and plan.complete_inos() == frozenset({7})
    plan.mark_complete([7], {7: "boot:1:2:3:4:5"})
    assert plan.written(7) == "boot:1:2:3:4:5"
