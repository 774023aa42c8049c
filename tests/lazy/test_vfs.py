"""The snapshot as a file system, called directly with trio: no kernel, no mount (tier 4)."""

from __future__ import annotations

import errno
import logging
import os
import random
import secrets
import stat
import threading
from pathlib import Path

import pytest
import trio

from ogrefs.errors import CorruptObject
from ogrefs.lazy.fs import localread, pagepush
from ogrefs.lazy.fs import vfs as vfs_mod
from ogrefs.repo.catalog import ROOT_INO, Catalog
from ogrefs.lazy.fetch.chunkcache import ChunkCache
from ogrefs.lazy.fetch.fetcher import Fetcher
from ogrefs.repo import Repository
from ogrefs.repo.pack import pack_key
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot
from ogrefs.lazy.fs.types import FsError
from ogrefs.lazy.fs.vfs import SnapshotFS

from tests.pagecache import drop_pages, resident_bytes
from tests.treegen import make_fidelity_tree

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


def run_fs(repo: Repository, cat: Catalog, body, cache: ChunkCache | None = None, local=None, **kw) -> Fetcher:
    fetcher = Fetcher(repo.read_pack_range, cache, **kw)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run)
            await body(SnapshotFS(cat, fetcher, local=local))
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


def test_a_large_file_read_front_to_back_is_exact_and_stays_out_of_the_disk_cache(snap, tmp_path, monkeypatch):
    """Issue 49: a streamed large file costs no disk-cache write on a mount without a local copy; a smaller one,
    one read at random, or one a materialization will want, is cached."""
    repo, cat, src = snap
    monkeypatch.setattr(vfs_mod, "STREAM_FILE_MIN", 8 * MiB)  # seq.bin is 9 MiB
    want = (src / "seq.bin").read_bytes()
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    small = max((p for p in src.rglob("*") if p.is_file() and not p.is_symlink()
                 and 0 < p.stat().st_size < 8 * MiB), key=lambda p: p.stat().st_size)

    async def read_all(fs, path, size):
        fh = await fs.open((await walk_to(fs, path)).node.ino, os.O_RDONLY)
        got = bytearray()
        while chunk := await fs.read(fh, len(got), size):
            got += chunk
        fs.release(fh)
        return bytes(got)

    async def body(fs):
        assert await read_all(fs, src / "seq.bin", 1 << 20) == want
        assert await read_all(fs, small, 128 * 1024) == small.read_bytes()

    run_fs(repo, cat, body, cache=cache)

    def extents(path):
        return cat.extents(cat.resolve(os.fsencode(path)).ino)

    assert not any(cache.contains(e.chunk) for e in extents(src / "seq.bin"))
    assert all(cache.contains(e.chunk) for e in extents(small))
    offsets = (5 * MiB, 1 * MiB, 7 * MiB)  # each far from where the previous read ended

    async def at_random(fs):  # not a front-to-back read: its chunks are cached
        fh = await fs.open((await walk_to(fs, src / "seq.bin")).node.ino, os.O_RDONLY)
        for off in offsets:
            assert bytes(await fs.read(fh, off, 4096)) == want[off:off + 4096]

    run_fs(repo, cat, at_random, cache=cache)
    assert all(cache.contains(e.chunk) for e in extents(src / "seq.bin") for off in offsets
               if e.offset <= off < e.end)

    class NothingLocalYet:  # a writable mount whose materialization has not reached the file
        def local_path(self, ino):
            return None

        def tree_path(self, ino):
            return None

        def local_paths(self, inos):
            return {}

        def written_identity(self, ino):
            return None

    cache2 = ChunkCache(tmp_path / "cache2", 1 << 30)
    run_fs(repo, cat, body, cache=cache2, local=NothingLocalYet())
    # its materialization will want every chunk it did not adopt: they stay in the cache, not fetched again
    assert all(cache2.contains(e.chunk) for e in extents(src / "seq.bin"))


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


@pytest.mark.expect_log(r"is missing from the repository", level=logging.ERROR, logger="ogrefs.lazy")
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
    from ogrefs.lazy.fetch.fetcher import StoreUnavailable
    from ogrefs.repo.chunkref import ChunkRef
    from ogrefs.lazy.fs.types import errno_for
    from ogrefs.store.base import StoreError

    ref = ChunkRef(b"\0" * 32, "p", 0, 1, 1)
    assert errno_for(FsError(errno.ENOENT)) == errno.ENOENT
    assert errno_for(StoreUnavailable(ref, "down")) == errno.EIO
    assert errno_for(CorruptObject("x")) == errno.EIO
    assert errno_for(StoreError("x")) == errno.EIO
    assert errno_for(PermissionError(errno.EACCES, "x")) == errno.EACCES
    assert errno_for(ZeroDivisionError()) == errno.EIO


# -- page-cache push: small local files of a crawled directory go to the kernel's page cache -------------------
class SourceCopy:
    """A LocalCopy whose complete local copies are the source files themselves (same bytes as the snapshot)."""

    def __init__(self, cat: Catalog, src: Path, missing: set[bytes] = frozenset()) -> None:
        self.paths = {node.ino: path for path, node in cat.walk() if node.is_reg and path.startswith(os.fsencode(src))
                      and os.path.basename(path) not in missing}

    def local_path(self, ino: int) -> bytes | None:
        return self.paths.get(ino)


    def local_paths(self, inos: list[int]) -> dict[int, bytes]:
        return {ino: self.paths[ino] for ino in inos if ino in self.paths}

    def tree_path(self, ino: int) -> bytes | None:
        return None

    def written_identity(self, ino: int) -> str | None:
        return None


def run_pushing_fs(repo: Repository, cat: Catalog, local, body, page_cache=None,
                   open_push: bool = False) -> dict[int, bytes]:
    """Run ``body(fs)`` with pushes on; returns what went to the "page cache" (ino -> bytes), in order.

    ``page_cache``: a store function of the test's own instead (then nothing is returned); ``open_push``:
    the open-time push of small files from memory as well (lazy/fs/openpush.py; these tests are the directory
    pusher's unless they say so).
    """
    pushed: dict[int, bytes] = {}
    lock = threading.Lock()

    def collect(ino: int, data: bytes) -> None:  # called in worker threads, like the adapter's
        with lock:
            assert ino not in pushed, "pushed twice"
            pushed[ino] = bytes(data)

    fetcher = Fetcher(repo.read_pack_range, None)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run)
            fs = SnapshotFS(cat, fetcher, local=local, page_cache=page_cache or collect, open_push=open_push)
            nursery.start_soon(fs.run_pushes)
            await body(fs)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return pushed


async def settle() -> None:
    await trio.sleep(0.3)  # the push runs in a background task and a worker thread


def test_opening_a_listed_small_local_file_pushes_its_listed_neighbours(snap):
    repo, cat, src = snap
    local = SourceCopy(cat, src, missing={b"f00007"})  # one neighbour is not local yet
    seen: dict[str, int] = {}

    async def body(fs):
        d = await walk_to(fs, src / "bigdir")
        listing = await list_dir(fs, d.node.ino)
        first = listing[3][1]
        fh = await fs.open(first, os.O_RDONLY)
        assert await fs.read(fh, 0, 100) == b"3"
        fs.release(fh)
        await settle()
        seen["inos"] = {ino: name for name, ino, _ in listing}
        seen["first"] = first
        # a second open in the same directory pushes nothing more
        fh = await fs.open(listing[5][1], os.O_RDONLY)
        fs.release(fh)
        await settle()
        seen["count"] = fs.stats.page_cache_pushed

    pushed = run_pushing_fs(repo, cat, local, body)
    names = seen["inos"]
    assert seen["first"] not in pushed  # the file being opened is read as usual
    assert names_of(pushed, names) == {n for n in names.values()} - {b"f00003", b"f00007"}
    for ino, data in pushed.items():  # exactly each file's bytes
        assert data == (src / "bigdir" / os.fsdecode(names[ino])).read_bytes()
    assert seen["count"] == len(pushed) == 1298


def test_a_push_skips_files_whose_bytes_the_kernel_already_read(snap):
    """Files read before their copies were complete (the first training step) are not pushed again at the
    next step's opens: the kernel keeps their pages, and pushing them costs the daemon CPU beside that step."""
    repo, cat, src = snap
    local = SourceCopy(cat, src, missing={b"f00002", b"f00004"})  # not local yet: read through the store
    seen: dict[str, object] = {}

    async def body(fs):
        d = await walk_to(fs, src / "bigdir")
        listing = await list_dir(fs, d.node.ino)
        inos = {name: ino for name, ino, _ in listing}
        for name in (b"f00002", b"f00004"):
            fh = await fs.open(inos[name], os.O_RDONLY)
            assert await fs.read(fh, 0, 100) == name[-1:]
            fs.release(fh)
        local.paths = SourceCopy(cat, src).paths  # now the materializer has finished them too
        fh = await fs.open(inos[b"f00003"], os.O_RDONLY)  # the next step opens a neighbour
        fs.release(fh)
        with trio.fail_after(20):
            while not fs.pushes_idle():
                await trio.sleep(0.01)
        seen["inos"] = {ino: name for name, ino in inos.items()}

    pushed = run_pushing_fs(repo, cat, local, body)
    names = names_of(pushed, seen["inos"])
    assert b"f00002" not in names and b"f00004" not in names and b"f00003" not in names
    assert names == set(seen["inos"].values()) - {b"f00002", b"f00003", b"f00004"}


def names_of(pushed: dict[int, bytes], names: dict[int, bytes]) -> set[bytes]:
    return {names[ino] for ino in pushed}


def test_a_push_skips_files_the_kernel_was_not_told_about(snap):
    repo, cat, src = snap
    local = SourceCopy(cat, src)
    got: dict[str, object] = {}

    async def body(fs):
        d = await walk_to(fs, src / "bigdir")
        # only looked up, never listed: the kernel knows these two and nothing else in the directory
        a = await fs.lookup(d.node.ino, b"f00010")
        b = await fs.lookup(d.node.ino, b"f00011")
        fh = await fs.open(a.node.ino, os.O_RDONLY)
        fs.release(fh)
        await settle()
        got["only"] = b.node.ino

    pushed = run_pushing_fs(repo, cat, local, body)
    assert list(pushed) == [got["only"]]


def test_a_push_stops_at_the_byte_cap_per_directory(snap, monkeypatch):
    repo, cat, src = snap
    monkeypatch.setattr(pagepush, "PUSH_DIR_MAX", 10 * 5)  # room for ten of the 5-byte files f01000...
    got: dict[str, object] = {}

    async def body(fs):
        d = await walk_to(fs, src / "bigdir")
        listing = await list_dir(fs, d.node.ino)
        got["names"] = {i: n for n, i, _ in listing}
        fh = await fs.open(listing[1000][1], os.O_RDONLY)
        fs.release(fh)
        await settle()

    pushed = run_pushing_fs(repo, cat, SourceCopy(cat, src), body)
    sizes = [len(v) for v in pushed.values()]
    assert pushed and sum(sizes) <= 50
    # name order: the first files of the listing (1-4 bytes each) until the next one would not fit
    assert [got["names"][i] for i in pushed] == [b"f%05d" % i for i in range(len(pushed))]


def test_inside_a_crawl_a_subdirectory_is_pushed_when_its_listing_ends_and_again_after_forget(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "other").mkdir()
    for name in ("a", "b", "c", "sub/d", "sub/e", "other/f"):
        (src / name).write_bytes(name.encode() * 10)
    repo = Repository.init(f"memory://vfs-{secrets.token_hex(4)}", cache_root=tmp_path / "cache")
    cat = Catalog(repo.catalog_path(take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)]))["id"]))
    calls: list[bytes] = []
    steps: dict[str, list[bytes]] = {}

    def page_cache(ino: int, data: bytes) -> None:
        calls.append(data)

    async def body(fs):
        other = await walk_to(fs, src / "other")
        await list_dir(fs, other.node.ino)  # listed before any crawl started: nothing is pushed
        top = await walk_to(fs, src)
        top_list = {n: i for n, i, _ in await list_dir(fs, top.node.ino)}
        fh = await fs.open(top_list[b"a"], os.O_RDONLY)  # the crawl starts: a's neighbours are pushed
        fs.release(fh)
        await settle()
        steps["open"] = list(calls)
        await list_dir(fs, top_list[b"sub"])  # listed to its end inside the crawl: pushed, nothing opened
        await settle()
        steps["listing"] = list(calls)
        # the kernel forgot src (and the pages of its files with it): the next open pushes again
        fs.forget([(top.node.ino, fs.lookup_count(top.node.ino))])
        fh = await fs.open(top_list[b"a"], os.O_RDONLY)
        fs.release(fh)
        await settle()
        steps["forget"] = list(calls)

    run_pushing_fs(repo, cat, SourceCopy(cat, src), body, page_cache=page_cache)  # src is pushed twice here
    assert sorted(steps["open"]) == [b"b" * 10, b"c" * 10]
    assert sorted(steps["listing"][2:]) == [b"sub/d" * 10, b"sub/e" * 10]
    assert sorted(steps["forget"][4:]) == [b"b" * 10, b"c" * 10]


def test_a_snapshot_without_extended_attributes_answers_enosys(tmp_path):
    """The kernel stops asking after ENOSYS (overlayfs asks every lower file for trusted.overlay.metacopy)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"a")
    repo = Repository.init(f"memory://vfs-{secrets.token_hex(4)}", cache_root=tmp_path / "cache")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)]))
    cat = Catalog(repo.catalog_path(m["id"]))

    async def body(fs):
        a = await walk_to(fs, src / "a")
        with pytest.raises(FsError) as e:
            await fs.getxattr(a.node.ino, b"trusted.overlay.metacopy")
        assert e.value.errno == errno.ENOSYS
        assert await fs.listxattr(a.node.ino) == []

    run_fs(repo, cat, body)


def test_without_cachestat_the_inline_read_still_answers(tmp_path, monkeypatch):
    """A kernel before 6.5 (or a seccomp filter) answers ENOSYS: the read falls back to RWF_NOWAIT alone."""
    path = tmp_path / "local-copy"
    data = os.urandom(256 * 1024)
    path.write_bytes(data)
    monkeypatch.setattr(localread, "_SYS_CACHESTAT", 1 << 20)  # no such system call
    monkeypatch.setattr(localread, "_cachestat", True)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, len(data), 0)
        assert localread._cached_pages(fd, 65536, 65536) is None and localread._cachestat is False
        assert localread.pread_if_cached(fd, 65536, 65536) in (None, data[65536:131072])
        assert trio.run(localread.pread, fd, 65536, 65536) == data[65536:131072]
    finally:
        os.close(fd)


def test_an_inline_local_read_never_waits_for_the_disk(tmp_path):
    """pread_if_cached answers from the page cache only: a read that would go to the disk is left to a thread."""
    path = tmp_path / "local-copy"
    data = secrets.token_bytes(256 * 1024)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        try:
            os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
        except OSError as exc:
            if exc.errno == errno.EOPNOTSUPP:
                pytest.skip("the test directory's file system has no RWF_NOWAIT (tmpfs)")
        # Five probes of dropped pages. With cachestat(2) each is refused without starting any I/O: the cache
        # stays empty. Where the kernel lacks it, RWF_NOWAIT alone may answer one, since the readahead it
        # starts can finish inside the call (tests/pagecache.py).
        probes, started = [], []
        for _ in range(5):
            drop_pages(path)
            probes.append(localread.pread_if_cached(fd, 65536, 65536))
            started.append(resident_bytes(path))
        assert all(p in (None, data[65536:131072]) for p in probes)  # never wrong bytes
        if localread._cachestat:
            assert probes == [None] * 5, "dropped pages were read inline"
            assert started == [0] * 5, "asking whether pages are cached read them in"
        else:
            assert None in probes, "dropped pages were read inline in every probe"
        assert os.pread(fd, len(data), 0) == data  # a plain read brings them back ...
        assert localread.pread_if_cached(fd, 65536, 65536) == data[65536:131072]  # ... and then it answers
        assert localread.pread_if_cached(fd, 65536, len(data) - 100) is None  # short (end of file): the thread's job
        got = trio.run(localread.pread, fd, 65536, 65536)
        assert got == data[65536:131072]
    finally:
        os.close(fd)


class CountingCatalog:
    """The catalog, counting the per-name questions a lookup asks (everything else passes through)."""

    def __init__(self, cat: Catalog) -> None:
        self._cat = cat
        self.asked: list[str] = []
        self.damaged = False  # children() raises as for a malformed row

    def lookup(self, parent, name):
        self.asked.append("lookup")
        return self._cat.lookup(parent, name)

    def data_bytes(self, ino):
        self.asked.append("data_bytes")
        return self._cat.data_bytes(ino)

    def children(self, parent, after=None, limit=-1):
        self.asked.append("children")
        if self.damaged:
            raise CorruptObject("catalog x is damaged (a malformed row)")
        return self._cat.children(parent, after=after, limit=limit)

    def __getattr__(self, name):
        return getattr(self._cat, name)


def test_a_directory_looked_up_in_twice_answers_from_memory(snap):
    """A cold import probes many names, present or not, in one directory: from its second lookup on, none is a
    query (each query releases the GIL, and winning it back behind the fetch threads takes milliseconds)."""
    repo, cat, src = snap
    counting = CountingCatalog(cat)
    names = sorted(os.listdir(os.fsencode(src)))

    async def body(fs):
        d = await walk_to(fs, src)
        counting.asked.clear()
        got = {}
        for name in names + [b"no-such-file", b"x" * 300]:
            try:
                got[name] = await fs.lookup(d.node.ino, name)
            except FsError as e:
                got[name] = e.errno
        # the first lookup asks for its name; the second reads the directory whole, once; the rest ask nothing
        assert counting.asked.count("lookup") == 1 and counting.asked.count("children") == 1
        assert counting.asked.count("data_bytes") <= 1
        assert got[b"no-such-file"] == errno.ENOENT and got[b"x" * 300] == errno.ENOENT
        for name in names:  # the same answers the catalog gives name by name
            node = cat.lookup(d.node.ino, name)
            assert got[name].node == node, name
            blocks = (cat.data_bytes(node.ino) + 511) // 512 if stat.S_ISREG(node.mode) else got[name].blocks
            assert got[name].blocks == blocks, name
        assert fs.lookup_count(got[names[0]].node.ino) == 1  # each answer still counts a kernel reference
        # the open after a lookup asks no row: the lookup's is remembered
        counting.asked.clear()
        small = got[b"small.txt"].node.ino
        fs.release(await fs.open(small, os.O_RDONLY))
        assert counting.asked == []

    run_fs(repo, counting, body)


def test_a_directory_over_the_bound_goes_on_asking_name_by_name(snap, monkeypatch):
    """A dataset's shard directory is not read whole for a lookup: 1,300 entries, the bound set to 1,000."""
    from ogrefs.lazy.fs import metacache
    monkeypatch.setattr(metacache, "DIR_INDEX_MAX", 1000)
    repo, cat, src = snap
    counting = CountingCatalog(cat)

    async def body(fs):
        d = await walk_to(fs, src / "bigdir")
        counting.asked.clear()
        for i in range(0, 1300, 100):
            a = await fs.lookup(d.node.ino, b"f%05d" % i)
            assert a.node.size == len(b"%d" % i)
        with pytest.raises(FsError) as e:
            await fs.lookup(d.node.ino, b"f99999")
        assert e.value.errno == errno.ENOENT
        # one listing, found too big (and remembered so), then a query per name
        assert counting.asked.count("children") == 1 and counting.asked.count("lookup") == 14

    run_fs(repo, counting, body)


def test_a_directory_that_cannot_be_read_whole_is_still_looked_up_name_by_name(snap):
    """A malformed row fails the listing; the lookups of the names that are fine must not fail with it."""
    repo, cat, src = snap
    counting = CountingCatalog(cat)
    counting.damaged = True
    names = sorted(os.listdir(os.fsencode(src)))[:6]

    async def body(fs):
        d = await walk_to(fs, src)
        for name in names:
            assert (await fs.lookup(d.node.ino, name)).node == cat.lookup(d.node.ino, name)
        # tried once, then not again: the other names were asked one by one
        assert counting.asked.count("children") == 1 and counting.asked.count("lookup") >= len(names)

    run_fs(repo, counting, body)


class ListRecorder:
    """An access recorder that keeps every (inode, offset, length) it is told, in order."""

    active = True

    def __init__(self) -> None:
        self.touched: list[tuple[int, int, int]] = []

    def record(self, ino: int, offset: int, length: int = 0) -> None:
        self.touched.append((ino, offset, length))


def test_an_open_pushes_a_small_file_memory_holds_whole_and_records_it_as_read(snap):
    """lazy/fs/openpush.py through the vfs: the push is in the page cache before the open returns, on the loop when
    no other handle of the file is open (else in a worker thread); a file memory does not hold, or a large one, is
    read as usual."""
    repo, cat, src = snap
    pushed: list[tuple[int, bytes]] = []
    threads: list[bool] = []  # each store: on the loop's thread?
    loop_thread = threading.get_ident()

    def store(ino: int, data: bytes) -> None:
        threads.append(threading.get_ident() == loop_thread)
        pushed.append((ino, data))

    fetcher = Fetcher(repo.read_pack_range, None)
    recorder = ListRecorder()
    seen: dict[str, object] = {}

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run)
            fs = SnapshotFS(cat, fetcher, recorder=recorder, page_cache=store)
            nursery.start_soon(fs.run_pushes)
            await trio.sleep(0.01)
            d = await walk_to(fs, src / "bigdir")
            inos = {name: ino for name, ino, _ in await list_dir(fs, d.node.ino)}
            kept = await fs.open(inos[b"f00009"], os.O_RDONLY)  # not in memory yet: nothing pushed, left open
            # f00001 is read through the store; its small neighbours come along (directory read-ahead)
            fh = await fs.open(inos[b"f00001"], os.O_RDONLY)
            assert await fs.read(fh, 0, 100) == b"1"
            fs.release(fh)
            with trio.fail_after(10):
                while not fetcher.residency.in_memory(vfs_mod.ChunkRef.from_extent(
                        cat.extents(inos[b"f00002"])[0]).chunk):
                    await trio.sleep(0.01)
            recorder.touched.clear()
            reads = fs.stats.reads
            fh = await fs.open(inos[b"f00002"], os.O_RDONLY)
            seen["pushed_at_open"] = list(pushed)
            seen["recorded"] = list(recorder.touched)
            assert await fs.read(fh, 0, 100) == b"2"  # a read that comes anyway is served as ever
            fs.release(fh)
            fh = await fs.open(inos[b"f00002"], os.O_RDONLY)  # the kernel has it: not again
            fs.release(fh)
            seq = await walk_to(fs, src / "seq.bin")  # 9 MiB: never pushed at its open
            fh = await fs.open(seq.node.ino, os.O_RDONLY)
            await fs.read(fh, 0, 4096)
            fs.release(fh)
            fh = await fs.open(seq.node.ino, os.O_RDONLY)
            fs.release(fh)
            fh = await fs.open(inos[b"f00009"], os.O_RDONLY)  # another handle is open: pushed from a thread
            fs.release(fh)
            fs.release(kept)
            seen["inos"] = inos
            seen["reads"] = fs.stats.reads - reads
            seen["open_pushed"] = fs.stats.open_pushed
            nursery.cancel_scope.cancel()

    trio.run(main)
    f2, f9 = seen["inos"][b"f00002"], seen["inos"][b"f00009"]
    assert seen["pushed_at_open"] == [(f2, b"2")] and pushed == [(f2, b"2"), (f9, b"9")]
    assert threads == [True, False]
    assert seen["recorded"] == [(f2, 0, 1)]
    assert seen["open_pushed"] == 2 and seen["reads"] == 2
