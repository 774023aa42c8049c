"""Access traces: recording, storage (plain and encrypted), refinement, replay, and use on a newer snapshot."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import trio

from ogrefs.repo.catalog import Catalog
from ogrefs.errors import CorruptObject
from ogrefs.lazy.fetch.fetcher import Fetcher, Priority
from ogrefs.repo.chunkref import ChunkRef
from ogrefs.repo import Repository
from ogrefs.repo.keys import Secret
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot
from ogrefs.lazy.trace.recorder import Recorder, save_trace, save_when_recorded
from ogrefs.lazy.trace.replay import Replayer
from ogrefs.lazy.trace.resolve import load_trace
from ogrefs.repo.traces import decode_trace, find_trace
from ogrefs.lazy.fs.vfs import SnapshotFS

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


def _three_files(tmp_path: Path) -> tuple[Catalog, tuple[int, int, int]]:
    """A snapshot of write_tree's tree: its catalog and the inodes of lib/f1.bin, f3.txt and f4.bin."""
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    src = tmp_path / "src"
    write_tree(src)
    _, cat = snap(repo, src)
    return cat, (ino(cat, src / "lib" / "f1.bin"), ino(cat, src / "f3.txt"), ino(cat, src / "f4.bin"))


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
    assert load_trace(repo, m, cat) == []
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
    first = load_trace(repo, m, cat)
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
    found = find_trace(again, m)
    assert (found.key, found.entries, found.recorded_on["id"]) == (key2, [(f3, 0), (f2, MiB), (f1, 0)], m["id"])
    # a mount that read nothing has nothing to add: no new trace object
    before = sorted(repo.store.list(f"traces/{m['id']}/"))
    assert save_trace(repo, m["id"], Recorder(cat), find_trace(again, m).entries) is None
    assert sorted(repo.store.list(f"traces/{m['id']}/")) == before


@pytest.mark.expect_log(r"skipping access trace")
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
        found = find_trace(repo, m)
        assert (found.key, found.entries) == (good, [(os.fsencode(src / "f3.txt"), 0)])
    assert "zzzz-broken" in caplog.text and "zzzz-json" in caplog.text
    with pytest.raises(CorruptObject):
        decode_trace(b'{"format": "ogrefs-trace", "version": 9, "entries": []}')


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
        found = find_trace(repo, m_new)
    key, entries = found.key, found.entries
    assert key == old_key and found.recorded_on["id"] == m_old["id"]
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
    assert find_trace(repo, m_new).key == new_key


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


        def tree_path(self, i):
            return None

        def written_identity(self, i):
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
    assert load_trace(repo, m, cat) == [(os.fsencode(src / "lib" / "f1.bin"), ext1[1].offset),
                                   (os.fsencode(src / "lib" / "f1.bin"), 0),
                                   (os.fsencode(src / "f4.bin"), 0), (os.fsencode(src / "f4.bin"), MiB)]


def test_spare_cpu_waits_while_the_box_is_busy_and_goes_once_cores_are_idle(tmp_path):
    """Background streaming paces itself by the box's idle CPU (/proc/stat: idle + iowait over all)."""
    from ogrefs.lazy.background.boxcpu import SpareCpu

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


# -- a trace that read a stale checkpoint (issue 13: box C resumes from B's snapshot with A's trace) ------
def _safetensors(path: Path, nbytes: int) -> None:
    import json
    import struct

    header = json.dumps({"w": {"dtype": "F32", "shape": [nbytes // 4], "data_offsets": [0, nbytes]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + os.urandom(nbytes))


def _hf_checkpoint(run: Path, step: int) -> Path:
    """A Hugging Face style checkpoint directory of multi-chunk files (random bytes: no chunk is shared)."""
    import io
    import json

    import torch

    d = run / f"checkpoint-{step}"
    d.mkdir(parents=True)
    _safetensors(d / "model.safetensors", 3 * MiB)
    buf = io.BytesIO()
    torch.save({"state": {0: {"step": step, "exp_avg": torch.rand(MiB // 2)}}, "param_groups": [{"lr": 0.1}]}, buf)
    (d / "optimizer.pt").write_bytes(buf.getvalue())
    torch.save({"cpu": torch.random.get_rng_state()}, d / "rng_state.pth")  # the Trainer saves it with the optimizer
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "epoch": step / 100}))
    return d


def _snap_with_probe(repo: Repository, src: Path) -> tuple[dict, Catalog]:
    from ogrefs.inspect.probe import EnvironmentProbe

    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], observers=[EnvironmentProbe()]))
    return m, Catalog(repo.catalog_path(m["id"]))


def _refs(cat: Catalog, path: Path) -> list[ChunkRef]:
    return [ChunkRef.from_extent(e) for e in cat.extents(ino(cat, path))]


@pytest.fixture
def spot_loop(tmp_path):
    """A trains from checkpoint-100 (its mount's trace reads it); B writes checkpoint-200 and is snapshotted."""
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache", pack_target_size=2 * MiB)
    src = tmp_path / "box"
    write_tree(src)
    run = src / "run"
    old = _hf_checkpoint(run, 100)
    m_a, cat_a = _snap_with_probe(repo, src)
    rec = Recorder(cat_a)  # A's start-up: a library, then the whole checkpoint it resumes from
    for path in (src / "lib" / "f1.bin", old / "trainer_state.json", old / "model.safetensors", old / "optimizer.pt"):
        for e in cat_a.extents(ino(cat_a, path)):
            rec.record(ino(cat_a, path), e.offset)
    save_trace(repo, m_a["id"], rec)
    new = _hf_checkpoint(run, 200)
    m_b, cat_b = _snap_with_probe(repo, src)
    latest = m_b["environment"]["checkpoints"]["latest_coherent"]
    assert latest["id"] == str(new) and latest["coherent"]  # what the capture knows, not made up by the test
    stale = [r for f in ("trainer_state.json", "model.safetensors", "optimizer.pt") for r in _refs(cat_b, old / f)]
    fresh = [r for f in ("trainer_state.json", "model.safetensors", "optimizer.pt") for r in _refs(cat_b, new / f)]
    assert not {r.chunk for r in stale} & {r.chunk for r in fresh}
    return repo, src, m_b, cat_b, stale, fresh


def _requests(fetcher: Fetcher, monkeypatch) -> list[tuple[Priority, ChunkRef]]:
    """Every chunk asked of ``fetcher``, with its priority, in order."""
    asked: list[tuple[Priority, ChunkRef]] = []
    real = fetcher.request

    def spy(refs, priority, **kw):
        refs = list(refs)
        asked.extend((priority, r) for r in refs)
        return real(refs, priority, **kw)

    monkeypatch.setattr(fetcher, "request", spy)
    return asked


def test_a_trace_of_an_older_checkpoint_replays_the_snapshots_newest_coherent_one(spot_loop, monkeypatch):
    repo, src, m_b, cat_b, stale, fresh = spot_loop
    entries = load_trace(repo, m_b, cat_b)  # A's trace (B's snapshot has none yet), checkpoint-100 replaced
    assert not any(b"checkpoint-100" in p for p, _off in entries)
    log = CallLog(repo.read_pack_range)
    fetcher = Fetcher(log)
    asked = _requests(fetcher, monkeypatch)
    rep = Replayer(cat_b, fetcher, entries)
    run_trio(fetcher, rep.run)
    lib = _refs(cat_b, src / "lib" / "f1.bin")
    assert [r for _p, r in asked] == lib + fresh  # the library, then all of checkpoint-200, in the traced order
    assert {p for p, _r in asked} == {Priority.TRACE}
    assert log.chunks_fetched(stale) == [] and log.chunks_fetched(fresh) == fresh
    assert rep.stats.dropped == 0 and rep.stats.chunks_done == len(lib) + len(fresh)


def _manifest(*runs: tuple[str, str | None, list[dict]]) -> dict:
    """A manifest whose environment capture found ``runs``: (dir, id of the latest coherent, checkpoints)."""
    return {"environment": {"checkpoints": {"runs": [{"dir": d, "latest_coherent": best, "checkpoints": cks}
                                                     for d, best, cks in runs]}}}


def _ck(path: str, step: int | None, files: dict[str, int], *, coherent: bool = True, mtime: float = 0.0) -> dict:
    return {"id": path, "path": path, "step": step, "epoch": None, "coherent": coherent, "mtime": mtime,
            "files": [{"path": f, "size": n} for f, n in files.items()]}


def test_stale_checkpoint_reads_map_to_the_corresponding_files_of_the_newest_coherent_one():
    from ogrefs.lazy.trace.newer_checkpoint import replace_stale_checkpoints

    old = _ck("/r", 100, {"/r/model_step100.pt": 10 * MiB, "/r/mp_rank_00_step100.pt": 4 * MiB,
                          "/r/extra_step100.bin": MiB})
    old["id"] = "/r#step 100"
    new = _ck("/r", 200, {"/r/model_step200.pt": 12 * MiB, "/r/mp_rank_00_step200.pt": 4 * MiB})
    new["id"] = "/r#step 200"
    mounted = _manifest(("/r", new["id"], [new, old]))
    chunks = {b"/r/model_step200.pt": [0, 3 * MiB, 7 * MiB, 11 * MiB], b"/r/mp_rank_00_step200.pt": [0, 2 * MiB],
              b"/r/model_step100.pt": [0, 4 * MiB, 9 * MiB], b"/r/mp_rank_00_step100.pt": [0, 2 * MiB]}
    entries = [(b"/venv/x.py", 0), (b"/r/mp_rank_00_step100.pt", 0), (b"/r/model_step100.pt", 0),
               (b"/r/extra_step100.bin", 0), (b"/r/model_step100.pt", 5 * MiB), (b"/r/model_step100.pt", 9 * MiB),
               (b"/venv/y.py", 0)]
    notes: list[str] = []
    out = replace_stale_checkpoints(entries, mounted, None, lambda p: chunks.get(p, []), notes)
    assert notes == ["trace: reads of checkpoint /r#step 100 replayed as reads of /r#step 200, the newest coherent "
                     "checkpoint of run /r (3 files; 1 without a counterpart there not replayed)"]
    assert out == [(b"/venv/x.py", 0), (b"/r/mp_rank_00_step200.pt", 0),  # a prefix, chunk by chunk ...
                   (b"/r/model_step200.pt", 0), (b"/r/model_step200.pt", 3 * MiB),
                   # ... and read to its end (9 MiB is in its last chunk): the newer file to its own end
                   (b"/r/model_step200.pt", 7 * MiB), (b"/r/model_step200.pt", 11 * MiB), (b"/venv/y.py", 0)]
    # (extra has no counterpart: dropped; mp_rank_00's "00" is no step number: the files still correspond)
    # the stale file's chunks unknown (not in the mounted snapshot): a read within a chunk of its end is to its end
    del chunks[b"/r/mp_rank_00_step100.pt"]
    out = replace_stale_checkpoints(entries[1:2], mounted, None, lambda p: chunks.get(p, []))
    assert out == [(b"/r/mp_rank_00_step200.pt", 0), (b"/r/mp_rank_00_step200.pt", 2 * MiB)]
    # nothing changes when the trace read the newest coherent checkpoint, or one ahead of it (torn here) ...
    newest = [(b"/r/model_step200.pt", 0)]
    assert replace_stale_checkpoints(newest, mounted, None, lambda p: chunks.get(p, [])) == newest
    torn = _ck("/r", 300, {"/r/model_step300.pt": 10 * MiB}, coherent=False)
    torn["id"] = "/r#step 300"
    ahead = [(b"/r/model_step300.pt", 0)]
    assert replace_stale_checkpoints(ahead, _manifest(("/r", new["id"], [torn, new])), None, chunks.get) == ahead
    # ... or when the mounted snapshot knows no coherent checkpoint of the run (only the trace's snapshot does)
    assert replace_stale_checkpoints(entries, _manifest(("/r", None, [])), mounted, chunks.get) == entries


def test_replay_of_a_trace_recorded_on_a_stale_checkpoint_never_requests_it_ahead_of_what_the_run_reads(
        spot_loop, monkeypatch, tmp_path):
    """Issue 17's rule (the trace never loses), on a workload where a naive replay loses: A's trace read
    checkpoint-100, C resumes from B's snapshot and reads checkpoint-200.  Replayed as recorded, the trace
    fetches all of checkpoint-100 at trace priority and checkpoint-200 only with the hints, after it; replayed
    by ogrefs, checkpoint-200 goes at trace priority and checkpoint-100 is never asked for ahead of it."""
    from ogrefs.lazy.background.materialize.materializer import Materializer
    from ogrefs.lazy.background.prefetch import Prefetch

    repo, _src, m_b, cat_b, stale, fresh = spot_loop
    stale_ids, fresh_ids = {r.chunk for r in stale}, {r.chunk for r in fresh}

    def prefetch(entries, materialize: bool) -> list[tuple[Priority, ChunkRef]]:
        fetcher = Fetcher(repo.read_pack_range)
        asked = _requests(fetcher, monkeypatch)
        m = Materializer(cat_b, fetcher, tmp_path / f"state-{len(os.listdir(tmp_path))}") if materialize else None
        pf = Prefetch(cat_b, fetcher, trace_entries=entries, materializer=m)
        run_trio(fetcher, pf.run)
        assert m is None or m.complete
        return asked

    def first_request(asked, ids) -> dict[bytes, tuple[int, Priority]]:
        first: dict[bytes, tuple[int, Priority]] = {}
        for i, (prio, ref) in enumerate(asked):
            if ref.chunk in ids:
                first.setdefault(ref.chunk, (i, prio))
        return first

    naive = prefetch(find_trace(repo, m_b).entries, materialize=False)  # the workload where naive replay loses
    assert {p for p, r in naive if r.chunk in stale_ids} == {Priority.TRACE}
    assert {p for p, r in naive if r.chunk in fresh_ids} == {Priority.HINT}  # after all of the stale checkpoint

    for materialize in (False, True):
        asked = prefetch(load_trace(repo, m_b, cat_b), materialize)
        fresh_first = first_request(asked, fresh_ids)
        assert set(fresh_first) == fresh_ids and {p for _i, p in fresh_first.values()} == {Priority.TRACE}
        stale_asked = [(i, p) for i, (p, r) in enumerate(asked) if r.chunk in stale_ids]
        if not materialize:
            assert stale_asked == []  # into the chunk cache: trace, then hints; the stale checkpoint is neither
        else:  # the local copy holds everything, the stale checkpoint too: in the background, after the run's reads
            assert stale_asked and {p for _i, p in stale_asked} == {Priority.BACKGROUND}
            assert min(i for i, _p in stale_asked) > max(i for i, _p in fresh_first.values())


def test_recording_ends_at_the_first_quiet_period_of_the_resume(tmp_path):
    """The resume's reads, then a pause, then a bulk reader of every file: only the resume is recorded.

    A pause before the resume has read ``resume_bytes`` (a login before the job) does not end it; re-reads
    of chunks already recorded are not new first touches and do not keep it going.
    """
    cat, (a, b, c) = _three_files(tmp_path)
    now = [0.0]
    r = Recorder(cat, quiet_s=5, resume_bytes=3 * MiB, clock=lambda: now[0])
    r.record(b, 0, 4096)  # a login reads a little, then nothing for a minute
    now[0] = 60.0
    assert not r.expired() and r.active
    r.record(a, 0, 2 * MiB)  # the job starts
    now[0] = 61.0
    r.record(a, 2 * MiB, 2 * MiB)
    now[0] = 64.0
    r.record(a, 0, 2 * MiB)  # a re-read: not a new first touch
    assert r.active and r.bytes == 4 * MiB + 4096
    now[0] = 66.5  # 5.5 s since the last new first touch
    r.record(c, 0, MiB)  # the backup starts
    assert not r.active and r.ended == "quiet" and r.complete
    assert r.raw() == [(b, 0), (a, 0), (a, 2 * MiB)]
    polled = Recorder(cat, quiet_s=5, resume_bytes=0, clock=lambda: now[0])
    polled.record(a, 0, 1)
    now[0] += 6
    assert polled.expired() and polled.ended == "quiet"  # no read needed to notice it (the daemon polls)
    stopped = Recorder(cat, quiet_s=5, resume_bytes=0, clock=lambda: now[0])
    stopped.record(a, 0, 1)
    stopped.stop()
    assert stopped.ended == "stopped" and not stopped.complete
    off = Recorder(cat, quiet_s=0, resume_bytes=0, clock=lambda: now[0])
    off.record(a, 0, 1)
    now[0] += 200
    off.record(b, 0, 1)
    assert off.active and len(off) == 2  # quiet_s=0: only the window ends it


def test_a_complete_recording_replaces_the_trace_it_replayed_and_one_cut_short_refines_it(tmp_path):
    """A poisoned trace (the whole box, in a backup's order) heals on the next resume that goes quiet."""
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    src = tmp_path / "src"
    write_tree(src)
    m, cat = snap(repo, src)
    f1, f2, f3 = (os.fsencode(src / p) for p in ("lib/f1.bin", "lib/f2.bin", "f3.txt"))
    poisoned = [(f1, 0), (f2, 0), (f3, 0), (f2, MiB)]
    now = [0.0]

    def resume() -> Recorder:
        r = Recorder(cat, quiet_s=5, resume_bytes=0, clock=lambda: now[0])
        r.record(cat.resolve(f3).ino, 0, 100)
        r.record(cat.resolve(f1).ino, 0, MiB)
        return r

    cut_short = resume()
    cut_short.stop()  # unmounted during the resume
    save_trace(repo, m["id"], cut_short, poisoned)
    assert find_trace(repo, m).entries == [(f3, 0), (f1, 0), (f2, 0), (f2, MiB)]
    quiet = resume()
    now[0] += 6
    quiet.stop()  # the quiet period passed before the unmount: it counts
    assert quiet.complete
    save_trace(repo, m["id"], quiet, poisoned)
    assert find_trace(repo, m).entries == [(f3, 0), (f1, 0)]


def test_the_quiet_period_comes_from_the_environment(caplog, expect_log):
    expect_log(r"OGREFS_TRACE_QUIET='soon' is not a number of seconds")
    from ogrefs.lazy.trace.recorder import DEFAULT_QUIET_S, quiet_from_env
    assert quiet_from_env({}) == DEFAULT_QUIET_S
    assert quiet_from_env({"OGREFS_TRACE_QUIET": "2.5"}) == 2.5
    assert quiet_from_env({"OGREFS_TRACE_QUIET": "0"}) == 0
    assert quiet_from_env({"OGREFS_TRACE_QUIET": "soon"}) == DEFAULT_QUIET_S
    assert "OGREFS_TRACE_QUIET='soon' is not a number of seconds" in caplog.text


def test_a_snapshot_after_the_resume_ends_the_recording_where_it_started(tmp_path):
    """The spot loop's B: the step, a checkpoint, ``ogrefs snapshot`` (whose probe reads through the mount), then
    ``restic backup`` at once, all within the quiet period: the trace ends where the snapshot started.  A snapshot
    that starts before the resume has read enough, or while it still reads, does not end it."""
    cat, (a, b, c) = _three_files(tmp_path)
    now = [10.0]
    r = Recorder(cat, quiet_s=0, resume_bytes=3 * MiB, clock=lambda: now[0])
    assert not r.snapshot_started(5.0)  # before this recording began: an old mark
    r.record(a, 0, 2 * MiB)
    now[0] = 11.0
    assert not r.snapshot_started(11.0) and r.active  # the agent's first snapshot, 2 MiB into the resume
    r.record(a, 2 * MiB, 2 * MiB)
    now[0] = 11.5
    assert not r.snapshot_started(11.5) and r.active  # 4 MiB in, but it read 0.5 s ago: still resuming
    r.record(a, 4 * MiB, 2 * MiB)
    now[0] = 14.0
    r.record(b, 0, 100)  # the snapshot's own probe, at 14.0
    now[0] = 14.5
    r.record(c, 0, MiB)  # restic
    assert not r.snapshot_started(20.0)  # a mark from the future is not this recording's either
    assert r.snapshot_started(13.9) and r.ended == "snapshot" and r.complete
    assert r.raw() == [(a, 0), (a, 2 * MiB), (a, 4 * MiB)] and r.bytes == 6 * MiB
    assert not r.snapshot_started(13.9)  # ended already
