"""The snapshot as a file system, called directly with trio: no kernel, no mount (tier 4)."""

from __future__ import annotations

import errno
import logging
import os
import random
import secrets
import stat
from pathlib import Path

import pytest
import trio

from ogrefs import vfs as vfs_mod
from ogrefs.catalog import ROOT_INO, Catalog
from ogrefs.fetcher import Fetcher
from ogrefs.repo import Repository
from ogrefs.repo.pack import pack_key
from ogrefs.snapshot import SnapshotOptions, take_snapshot
from ogrefs.vfs import FsError, SnapshotFS

from .treegen import make_fidelity_tree

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def snap(tmp_path_factory):
    """A memory repository holding a snapshot of the fidelity tree plus a big directory."""
    base = tmp_path_factory.mktemp("vfs")
    src = base / "src"
    make_fidelity_tree(src)
    big = src / "bigdir"
    big.mkdir()
    for i in range(1300):  # more than two readdir pages
        (big / f"f{i:05d}").write_bytes(b"%d" % i)
    (src / "seq.bin").write_bytes(os.urandom(9 * MiB + 123))
    repo = Repository.init(f"memory://vfs-{secrets.token_hex(4)}", cache_root=base / "cache",
                           pack_target_size=2 * MiB)
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)]))
    return repo, Catalog(repo.catalog_path(m["id"])), src


def run_fs(repo: Repository, cat: Catalog, body, **kw) -> Fetcher:
    fetcher = Fetcher(repo.read_pack_range, None, **kw)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run)
            await body(SnapshotFS(cat, fetcher))
            nursery.cancel_scope.cancel()

    trio.run(main)
    return fetcher


async def walk_to(fs: SnapshotFS, path: Path) -> vfs_mod.Attr:
    ino = ROOT_INO
    attr = await fs.getattr(ino)
    for part in os.fsencode(path).split(b"/"):
        if part:
            attr = await fs.lookup(ino, part)
            ino = attr.node.ino
    return attr


async def list_dir(fs: SnapshotFS, ino: int, start: int = 0, limit: int | None = None) -> list[tuple[bytes, int, int]]:
    fh = await fs.opendir(ino)
    out: list[tuple[bytes, int, int]] = []

    def emit(name, attr, nxt):
        if limit is not None and len(out) >= limit:
            return False
        out.append((name, attr.node.ino, nxt))
        return True

    pos = start
    while True:
        before = len(out)
        await fs.readdir(fh, pos, emit)
        if len(out) == before or (limit is not None and len(out) >= limit):
            break
        pos = out[-1][2]
    fs.releasedir(fh)
    return out


def test_attributes_match_the_source(snap):
    repo, cat, src = snap

    async def body(fs):
        d = await walk_to(fs, src)
        names = [n for n, _, _ in await list_dir(fs, d.node.ino)]
        assert names == sorted(os.listdir(os.fsencode(src)))
        for name in names:
            st = os.lstat(os.path.join(os.fsencode(src), name))
            a = await fs.lookup(d.node.ino, name)
            n = a.node
            assert (n.mode, n.uid, n.gid, n.mtime_ns) == (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns), name
            if stat.S_ISREG(st.st_mode):
                assert n.size == st.st_size
            if stat.S_ISLNK(st.st_mode):
                assert await fs.readlink(n.ino) == os.readlink(os.path.join(os.fsencode(src), name))
        sparse = await fs.lookup(d.node.ino, b"sparse")
        assert sparse.blocks * 512 < sparse.node.size // 4  # holes take no blocks
        small = await fs.lookup(d.node.ino, b"small.txt")
        link = await walk_to(fs, src / "dir" / "hardlink-to-small")
        assert link.node.ino == small.node.ino and small.node.nlink == 2
        x = await fs.lookup(d.node.ino, b"xattrs")
        assert b"user.comment" in await fs.listxattr(x.node.ino)
        assert await fs.getxattr(x.node.ino, b"user.binary") == bytes(range(256))
        with pytest.raises(FsError) as e:
            await fs.getxattr(x.node.ino, b"user.nope")
        assert e.value.errno == errno.ENODATA
        with pytest.raises(FsError) as e:
            await fs.lookup(d.node.ino, b"no-such-file")
        assert e.value.errno == errno.ENOENT
        with pytest.raises(FsError) as e:
            await fs.lookup(small.node.ino, b"x")
        assert e.value.errno == errno.ENOTDIR
        st = await fs.statfs()
        assert st.files == cat.counts()["inodes"] and st.blocks > 0

    run_fs(repo, cat, body)


def test_readdir_pages_offsets_and_lookup_counts(snap):
    repo, cat, src = snap

    async def body(fs):
        d = await walk_to(fs, src / "bigdir")
        full = await list_dir(fs, d.node.ino)
        assert [n for n, _, _ in full] == [b"f%05d" % i for i in range(1300)]
        assert [nxt for _, _, nxt in full] == list(range(1, 1301))
        # resuming at any offset the kernel was given continues exactly there
        for start in (0, 1, 511, 512, 513, 1024, 1299, 1300):
            part = await list_dir(fs, d.node.ino, start=start, limit=40)
            assert part == full[start:start + 40]
        # every accepted entry is one kernel reference; a refused one is not
        first = full[0][1]
        refs = fs.lookup_count(first)
        fh = await fs.opendir(d.node.ino)
        await fs.readdir(fh, 0, lambda name, attr, nxt: False)
        assert fs.lookup_count(first) == refs
        counts = {ino: fs.lookup_count(ino) for _, ino, _ in full}
        assert min(counts.values()) >= 1
        fs.forget([(ino, c) for ino, c in counts.items()] + [(d.node.ino, fs.lookup_count(d.node.ino))])
        assert all(fs.lookup_count(ino) == 0 for ino in counts)
        fs.forget([(999999, 3)])  # unknown inodes are ignored, never an error

    run_fs(repo, cat, body)


def test_reads_at_random_offsets_and_holes(snap):
    repo, cat, src = snap
    want = (src / "seq.bin").read_bytes()
    sparse = (src / "sparse").read_bytes()
    rng = random.Random(7)

    async def body(fs):
        a = await walk_to(fs, src / "seq.bin")
        fh = await fs.open(a.node.ino, os.O_RDONLY)
        for _ in range(60):
            off = rng.randrange(0, len(want) + 100)
            size = rng.choice([1, 4096, 131072, 1 << 20, 3 << 20])
            assert bytes(await fs.read(fh, off, size)) == want[off:off + size]
        fs.release(fh)
        s = await walk_to(fs, src / "sparse")
        fh = await fs.open(s.node.ino, os.O_RDONLY)
        for off in (0, 10 * MiB - 3, 10 * MiB + 4090, 20 * MiB, 30 * MiB - 1, 30 * MiB + 2, 40 * MiB):
            assert bytes(await fs.read(fh, off, 1 << 20)) == sparse[off:off + (1 << 20)]
        with pytest.raises(FsError) as e:
            await fs.open(s.node.ino, os.O_RDWR)
        assert e.value.errno == errno.EROFS
        with pytest.raises(FsError) as e:
            await fs.open(ROOT_INO, os.O_RDONLY)
        assert e.value.errno == errno.EISDIR
        assert fs.open_files == 1

    run_fs(repo, cat, body)


def test_sequential_reads_fetch_ahead_in_few_requests(snap):
    repo, cat, src = snap
    want = (src / "seq.bin").read_bytes()

    async def body(fs):
        a = await walk_to(fs, src / "seq.bin")
        fh = await fs.open(a.node.ino, os.O_RDONLY)
        got = bytearray()
        while chunk := await fs.read(fh, len(got), 128 * 1024):
            got += chunk
        assert got == want

    f = run_fs(repo, cat, body)
    chunks = len(cat.extents(cat.resolve(os.fsencode(src / "seq.bin")).ino))
    assert f.stats.chunks_fetched == chunks
    # read-ahead queues whole windows, which coalesce: far fewer requests than chunks
    assert f.stats.requests <= chunks // 2 + 2
    assert f.stats.hits_memory > 0


def test_small_files_of_a_directory_come_in_a_few_requests(snap):
    """Directory read-ahead: opening one small file brings its small neighbours in the same GET(s)."""
    repo, cat, src = snap
    names = [f"f{i:05d}" for i in range(0, 500, 5)]  # 100 files among the first 500 (the read-ahead's reach)

    async def body(fs):
        for name in names:
            a = await walk_to(fs, src / "bigdir" / name)
            fh = await fs.open(a.node.ino, os.O_RDONLY)
            assert await fs.read(fh, 0, 100) == b"%d" % int(name[1:])
            fs.release(fh)

    f = run_fs(repo, cat, body)
    assert f.stats.requests <= 4  # one round trip per file would be 100


def test_lost_pack_fails_only_its_files_with_eio(snap, caplog):
    repo, cat, src = snap
    victim = cat.resolve(os.fsencode(src / "seq.bin"))
    packs = {e.pack for e in cat.extents(victim.ino)}
    candidates = [(n, cat.resolve(os.fsencode(src / n))) for n in ("random.bin", "small.txt", "private")]
    other_name, other = next((n, o) for n, o in candidates if not packs & {e.pack for e in cat.extents(o.ino)})
    saved = {p: repo.store.get(pack_key(p)) for p in packs}
    for p in packs:
        repo.store.delete(pack_key(p))
    try:
        async def body(fs):
            fh = await fs.open(victim.ino, os.O_RDONLY)
            with pytest.raises(FsError) as e:
                await fs.read(fh, 0, 4096)
            assert e.value.errno == errno.EIO
            fh2 = await fs.open(other.ino, os.O_RDONLY)
            assert bytes(await fs.read(fh2, 0, other.size)) == (src / other_name).read_bytes()
            assert fs.stats.read_errors == 1

        with caplog.at_level(logging.ERROR, logger="ogrefs"):
            run_fs(repo, cat, body)
    finally:
        for p, body_ in saved.items():
            repo.store.put(pack_key(p), body_)
    assert any(f"read of {src / 'seq.bin'} at offset 0 failed" in r.getMessage() for r in caplog.records)


def test_errno_mapping_is_total():
    from ogrefs.errors import CorruptObject
    from ogrefs.fetcher import ChunkRef, StoreUnavailable
    from ogrefs.store.base import StoreError

    ref = ChunkRef(b"\0" * 32, "p", 0, 1, 1)
    assert vfs_mod.errno_for(FsError(errno.ENOENT)) == errno.ENOENT
    assert vfs_mod.errno_for(StoreUnavailable(ref, "down")) == errno.EIO
    assert vfs_mod.errno_for(CorruptObject("x")) == errno.EIO
    assert vfs_mod.errno_for(StoreError("x")) == errno.EIO
    assert vfs_mod.errno_for(PermissionError(errno.EACCES, "x")) == errno.EACCES
    assert vfs_mod.errno_for(ZeroDivisionError()) == errno.EIO
