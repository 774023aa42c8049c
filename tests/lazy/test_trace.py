"""Access traces: recording, storage (plain and encrypted), refinement, replay, and use on a newer snapshot."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import trio

from ogrefs.lazy import trace as trace_mod
from ogrefs.repo.catalog import Catalog
from ogrefs.errors import CorruptObject
from ogrefs.lazy.fetcher import ChunkRef, Fetcher, Priority
from ogrefs.repo import Repository
from ogrefs.repo.keys import Secret
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot
from ogrefs.lazy.trace import Recorder, Replayer, find_trace, load_trace, save_trace, save_when_recorded
from ogrefs.lazy.vfs import SnapshotFS

from tests.resume_box import CallLog, run_trio

MiB = 1024 * 1024


def write_tree(src: Path) -> None:
    (src / "lib").mkdir(parents=True, exist_ok=True)
    (src / "lib" / "f1.bin").write_bytes(os.urandom(5 * MiB))  # more than the largest chunk: 2+ chunks
    (src / "lib" / "f2.bin").write_bytes(os.urandom(2 * MiB))
    (src / "f3.txt").write_bytes(b"three\n")
    (src / "f4.bin").write_bytes(os.urandom(3 * MiB // 2))


def snap(repo: Repository, *paths: Path) -> tuple[dict, Catalog]:
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(p) for p in paths]))
    return m, Catalog(repo.catalog_path(m["id"]))


@pytest.fixture(params=["plain", "encrypted"])
def repo(request, tmp_path) -> Repository:
    secret = Secret(b"pw", "scrypt") if request.param == "encrypted" else None
    return Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache", pack_target_size=2 * MiB,
                           secret=secret)


def ino(cat: Catalog, path: Path) -> int:
    node = cat.resolve(os.fsencode(path))
    assert node is not None
    return node.ino


def test_recorder_keeps_first_touch_order_within_its_window_and_bound(tmp_path):
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    src = tmp_path / "src"
    write_tree(src)
    _, cat = snap(repo, src)
    now = [100.0]
    r = Recorder(cat, window_s=10, max_entries=4, clock=lambda: now[0])
    a, b, c = ino(cat, src / "lib" / "f1.bin"), ino(cat, src / "f3.txt"), ino(cat, src / "f4.bin")
    for key in [(a, MiB), (b, 0), (a, MiB), (a, 0)]:
        r.record(*key)
    assert r.raw() == [(a, MiB), (b, 0), (a, 0)] and r.active
    now[0] = 111.0  # the window is over
    r.record(c, 0)
    assert not r.active and len(r) == 3
    assert r.entries() == [(os.fsencode(src / "lib" / "f1.bin"), MiB), (os.fsencode(src / "f3.txt"), 0),
                           (os.fsencode(src / "lib" / "f1.bin"), 0)]
    bounded = Recorder(cat, max_entries=2)
    for i in range(5):
        bounded.record(a, i)
    assert bounded.raw() == [(a, 0), (a, 1)] and not bounded.active


def test_save_load_and_refine_round_trip(repo, tmp_path):
    src = tmp_path / "src"
    write_tree(src)
    m, cat = snap(repo, src)
    f1, f2, f3 = (os.fsencode(src / p) for p in ("lib/f1.bin", "lib/f2.bin", "f3.txt"))
    assert load_trace(repo, m) == []
    r1 = Recorder(cat)
    r1.record(cat.resolve(f1).ino, 0)
    r1.record(cat.resolve(f2).ino, MiB)
    key1 = save_trace(repo, m["id"], r1, None)
    assert key1.startswith(f"traces/{m['id']}/")
    raw = repo.store.get(key1)
    if repo.codec.encrypted:
        assert b"ogrefs-trace" not in raw and b"f1.bin" not in raw and raw[5] & 0x80
        with pytest.raises(CorruptObject):  # sealed under its own key: moved elsewhere, it fails authentication
            repo.codec.open(f"traces/{m['id']}/other", raw)
    first = load_trace(repo, m)
    assert first == [(f1, 0), (f2, MiB)]
    # a later mount touches f3, then f2: its trace is its own order, then what it did not touch
    r2 = Recorder(cat)
    r2.record(cat.resolve(f3).ino, 0)
    r2.record(cat.resolve(f2).ino, MiB)
    key2 = save_trace(repo, m["id"], r2, first)
    assert key2 > key1
    # a fresh handle (for an encrypted repository: unlocked again) reads the newest one
    again = Repository.open(repo.store.url, cache_root=tmp_path / "cache2",
                            secret=Secret(b"pw", "scrypt") if repo.codec.encrypted else None)
    assert find_trace(again, m) == (key2, [(f3, 0), (f2, MiB), (f1, 0)])
    # a mount that read nothing has nothing to add: no new trace object
    before = sorted(repo.store.list(f"traces/{m['id']}/"))
    assert save_trace(repo, m["id"], Recorder(cat), find_trace(again, m)[1]) is None
    assert sorted(repo.store.list(f"traces/{m['id']}/")) == before


def test_unreadable_traces_are_skipped_for_an_older_good_one(tmp_path, caplog):
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    src = tmp_path / "src"
    write_tree(src)
    m, cat = snap(repo, src)
    r = Recorder(cat)
    r.record(ino(cat, src / "f3.txt"), 0)
    good = save_trace(repo, m["id"], r)
    repo.store.put(f"traces/{m['id']}/zzzz-broken", b"not an object")
    repo.store.put(f"traces/{m['id']}/zzzz-json", repo.codec.seal(f"traces/{m['id']}/zzzz-json", b'{"a": 1}'))
    with caplog.at_level(logging.WARNING, logger="ogrefs"):
        assert find_trace(repo, m) == (good, [(os.fsencode(src / "f3.txt"), 0)])
    assert "zzzz-broken" in caplog.text and "zzzz-json" in caplog.text
    with pytest.raises(CorruptObject):
        trace_mod.decode_trace(b'{"format": "ogrefs-trace", "version": 9, "entries": []}')


def test_an_older_snapshots_trace_serves_a_newer_snapshot_of_the_same_paths(tmp_path, caplog):
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache", pack_target_size=2 * MiB)
    src, other = tmp_path / "src", tmp_path / "other"
    write_tree(src)
    write_tree(other)
    m_old, cat_old = snap(repo, src)
    r = Recorder(cat_old)
    for rel, off in (("lib/f2.bin", 1536 * 1024), ("f3.txt", 0), ("lib/f1.bin", 0), ("f4.bin", MiB)):
        r.record(ino(cat_old, src / rel), off)
    old_key = save_trace(repo, m_old["id"], r)
    # a snapshot of other paths, with a trace of its own, in between: never used for src
    m_other, cat_other = snap(repo, other)
    r_other = Recorder(cat_other)
    r_other.record(ino(cat_other, other / "f4.bin"), 0)
    save_trace(repo, m_other["id"], r_other)
    # the box changed: f2 rewritten (and shorter), f3 deleted, f1 unchanged
    (src / "lib" / "f2.bin").write_bytes(os.urandom(MiB + MiB // 2 + 100))
    (src / "f3.txt").unlink()
    m_new, cat_new = snap(repo, src)
    with caplog.at_level(logging.INFO, logger="ogrefs"):
        key, entries = find_trace(repo, m_new)
    assert key == old_key
    assert f"older snapshot {m_old['id'][:12]}" in caplog.text
    # replayed on the new catalog: paths resolve there, offsets map to its extents, f3 is dropped
    log = CallLog(repo.read_pack_range)
    fetcher = Fetcher(log)
    rep = Replayer(cat_new, fetcher, entries)
    run_trio(fetcher, rep.run)
    assert rep.stats.dropped == 1 and rep.stats.finished
    f2_new = cat_new.extents(ino(cat_new, src / "lib" / "f2.bin"))
    want = [e for e in f2_new if e.offset <= 1536 * 1024 < e.end]
    want += cat_new.extents(ino(cat_new, src / "lib" / "f1.bin"))[:1]
    want += [e for e in cat_new.extents(ino(cat_new, src / "f4.bin")) if e.offset <= MiB < e.end]
    fetched = log.chunks_fetched([ChunkRef.from_extent(e) for e in want])
    assert len(fetched) == len(want) == 3
    assert rep.stats.bytes_done == rep.stats.bytes_total == sum(e.length for e in want)
    assert fetcher.stats.chunks_fetched == 3
    # once the new snapshot has its own trace, that one wins
    r_new = Recorder(cat_new)
    r_new.record(ino(cat_new, src / "f4.bin"), 0)
    new_key = save_trace(repo, m_new["id"], r_new, entries)
    assert find_trace(repo, m_new)[0] == new_key


def test_replay_fetches_in_trace_order_at_trace_priority(tmp_path, monkeypatch):
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache", pack_target_size=2 * MiB)
    src = tmp_path / "src"
    write_tree(src)
    _, cat = snap(repo, src)
    order = [("f4.bin", 0), ("lib/f1.bin", 2 * MiB + 5), ("lib/f2.bin", 0), ("lib/f1.bin", 0), ("lib/f1.bin", 1),
             ("nope", 0)]
    entries = [(os.fsencode(src / rel), off) for rel, off in order]
    want = []
    for path, off in entries[:-1]:
        node = cat.resolve(path)
        e = next(e for e in cat.extents(node.ino) if e.offset <= off < e.end)
        if ChunkRef.from_extent(e) not in want:
            want.append(ChunkRef.from_extent(e))
    log = CallLog(repo.read_pack_range)
    fetcher = Fetcher(log, max_requests=2, reserved_for_read=1)
    priorities = []
    real_request = fetcher.request

    def spy(refs, priority, **kw):
        refs = list(refs)
        priorities.extend([priority] * len(refs))
        return real_request(refs, priority, **kw)

    monkeypatch.setattr(fetcher, "request", spy)
    rep = Replayer(cat, fetcher, entries, window_bytes=1, group_bytes=1)
    run_trio(fetcher, rep.run)
    assert [(r.pack, r.offset, r.stored_len) for r in want] == log.calls
    assert priorities == [Priority.TRACE] * len(want)
    assert rep.stats.dropped == 1 and rep.stats.chunks_done == len(want) >= 3  # f1 has 2 or 3 chunks


def test_the_vfs_reports_first_touches_and_a_finished_window_is_saved(tmp_path):
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache", pack_target_size=2 * MiB)
    src = tmp_path / "src"
    write_tree(src)
    m, cat = snap(repo, src)
    f1, f4 = ino(cat, src / "lib" / "f1.bin"), ino(cat, src / "f4.bin")
    ext1 = cat.extents(f1)
    copy = tmp_path / "copy-of-f4"
    copy.write_bytes((src / "f4.bin").read_bytes())

    class Local:
        def local_path(self, i):
            return os.fsencode(copy) if i == f4 else None

        def chunk_done(self, chunk):
            return False

        def chunk_in_hand(self, chunk):
            return None

        def tree_path(self, i):
            return None

    rec = Recorder(cat, window_s=0.5)
    fetcher = Fetcher(repo.read_pack_range)
    fs = SnapshotFS(cat, fetcher, recorder=rec, local=Local())

    async def body():
        fh = await fs.open(f1, os.O_RDONLY)
        await fs.read(fh, ext1[1].offset + 10, 100)  # inside the second chunk
        await fs.read(fh, 0, ext1[1].offset + 1)  # the first two chunks
        fh4 = await fs.open(f4, os.O_RDONLY)  # served from the local copy
        assert await fs.read(fh4, MiB - 1, 2) == (src / "f4.bin").read_bytes()[MiB - 1:MiB + 1]
        assert fs.stats.local_reads == 1
        with trio.fail_after(5):
            key = await save_when_recorded(repo, m["id"], rec, poll=0.05)
        assert key is not None

    run_trio(fetcher, body)
    assert rec.raw() == [(f1, ext1[1].offset), (f1, 0), (f4, 0), (f4, MiB)]
    assert load_trace(repo, m) == [(os.fsencode(src / "lib" / "f1.bin"), ext1[1].offset),
                                   (os.fsencode(src / "lib" / "f1.bin"), 0),
                                   (os.fsencode(src / "f4.bin"), 0), (os.fsencode(src / "f4.bin"), MiB)]


def test_spare_cpu_waits_while_the_box_is_busy_and_goes_once_cores_are_idle(tmp_path):
    """Background streaming paces itself by the box's idle CPU (/proc/stat: idle + iowait over all)."""
    from ogrefs.lazy.prefetch import SpareCpu

    stat = tmp_path / "stat"
    counters = {"busy": 0, "idle": 0}

    def write() -> None:  # cpu  user nice system idle iowait irq softirq steal
        stat.write_text(f"cpu  {counters['busy']} 0 0 {counters['idle']} 0 0 0 0 0 0\ncpu0 0 0 0 0 0\n")

    write()
    spare = SpareCpu(min_cores=0.5, interval=0.02, path=str(stat))
    spare.cores = 2
    counters["busy"] += 90
    counters["idle"] += 10
    write()
    assert spare.idle_cores() == pytest.approx(0.2)  # 10 % of 2 cores
    assert SpareCpu(path=str(tmp_path / "missing")).idle_cores() is None
    went: list[float] = []

    async def main() -> None:
        async def busy_then_idle() -> None:
            for _ in range(10):  # 0.2 s of a busy box: 90 % busy
                counters["busy"] += 90
                counters["idle"] += 10
                write()
                await trio.sleep(0.02)
            while not went:
                counters["idle"] += 100
                write()
                await trio.sleep(0.02)

        async with trio.open_nursery() as n:
            n.start_soon(busy_then_idle)
            t0 = trio.current_time()
            await spare.wait()
            went.append(trio.current_time() - t0)

    trio.run(main)
    assert went[0] >= 0.18, went  # not while the box was busy
