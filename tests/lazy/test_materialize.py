"""Background materialization into a local tree, without a kernel mount: fidelity, order, crashes, full disks."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import logging

import pytest
import trio

from ogrefs.repo.catalog import ROOT_INO
from ogrefs.lazy.fetch import threadnice
from ogrefs.lazy.fetch.chunkcache import ChunkCache
from ogrefs.lazy.fetch.fetcher import Fetcher, Priority
from ogrefs.lazy.background.materialize.build import prepare
from ogrefs.lazy.background.materialize.materializer import Materializer
from ogrefs.lazy.background.materialize.writer import Disk, TreeWriter
from ogrefs.lazy.background.prefetch import Prefetch
from ogrefs.lazy.fs import localread
from ogrefs.lazy.fs.vfs import SnapshotFS
from ogrefs.box.copyplan import Plan
from ogrefs.snapshot.mounted import OwnMount

from tests.pagecache import resident_bytes
from ogrefs.repo import Repository
from tests.resume_box import Box, CallLog, make_box, run_trio, snapshot_box
from tests.treegen import compare_trees

MiB = 1024 * 1024
GiB = 1024 * MiB
ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def box(tmp_path_factory) -> Box:
    return make_box(tmp_path_factory.mktemp("box"))


def all_refs(box: Box):
    """Every distinct chunk of the snapshot, by chunk id."""
    from ogrefs.repo.chunkref import ChunkRef

    out = {}
    for _ino, off, length, chunk, pack, poff, slen in box.catalog.all_extents():
        out[chunk] = ChunkRef(chunk, pack, poff, slen, length)
    return out


def materialize(box: Box, state: Path, read_range=None, *, fetcher_kw=None, trace=None, cls=Materializer,
                **kw) -> tuple[Materializer, Fetcher]:
    fetcher = Fetcher(read_range or box.repo.read_pack_range, **(fetcher_kw or {}))
    m = cls(box.catalog, fetcher, state, **kw)

    async def body():
        await m.run(trace)

    run_trio(fetcher, body)
    return m, fetcher


def gated(box: Box, gate: threading.Event):
    """The box's pack reads, each held until ``gate`` is set (at most 20 s)."""
    def read_range(pack, off, n):
        gate.wait(20)
        return box.repo.read_pack_range(pack, off, n)
    return read_range


def done_chunks(state: Path) -> set[bytes]:
    """The plan's done chunks, read as a second process would while the materializer writes."""
    with sqlite3.connect(state / "materialize.sqlite") as db:
        return {r[0] for r in db.execute("SELECT chunk FROM chunks WHERE done=1")}


async def read_all_through_vfs(box: Box, fs: SnapshotFS) -> None:
    """Every regular file under the source, read through the vfs, equals the source."""
    for path, node in box.catalog.walk():
        if not node.is_reg or not path.startswith(os.fsencode(box.src)):
            continue
        fh = await fs.open(node.ino, os.O_RDONLY)
        got = bytearray()
        while chunk := await fs.read(fh, len(got), 4 * MiB):
            got += chunk
        fs.release(fh)
        with open(path, "rb") as fh_src:
            assert got == fh_src.read(), path


# -- fidelity -------------------------------------------------------------------------------------
def test_materialized_tree_equals_the_source_and_skips_the_chunk_cache(box, tmp_path):
    cache = ChunkCache(tmp_path / "chunks", 1 << 30)
    state = tmp_path / "state"
    m, f = materialize(box, state, fetcher_kw={"cache": cache})
    assert m.state == "done" and m.complete, m.stats()
    assert compare_trees(box.src, box.tree_of(state)) == []
    st = m.stats()
    assert st["classes"]["hint"]["bytes_total"] > 4 * MiB  # the venv and the checkpoint
    assert st["classes"]["background"]["bytes_total"] > 12 * MiB
    assert st["bytes_done"] == st["bytes_total"] == sum(r.raw_len for r in all_refs(box).values())
    assert st["files_complete"] == st["files_total"] > 60
    # every chunk fetched once; none went to the bounded cache or the memory LRU (materialization keeps its own)
    assert f.stats.chunks_fetched == len(all_refs(box))
    assert cache.usage() == 0 and f.snapshot_stats()["memory_bytes"] == 0
    # the vfs side: complete files have a local path, directories and symlinks do not
    node = box.catalog.resolve(box.path("ckpt/model.bin"))
    assert m.local_path(node.ino) == os.fsencode(box.tree_of(state) / "ckpt" / "model.bin")
    assert m.local_path(box.catalog.resolve(box.path("dir")).ino) is None
    # a second Materializer on the same state knows at once that everything is local, fetches nothing
    log = CallLog(box.repo.read_pack_range)
    m2, f2 = materialize(box, state, log)
    assert m2.complete and m2.state == "done" and log.calls == []


@pytest.mark.skipif(not threadnice.may_renice(), reason="this process may not raise a thread's priority back")
def test_a_hard_linked_file_is_local_under_every_name(tmp_path):
    """A snapshot of a box running from a mount asks whether a file's local copy is whole by its path
    (snapshot/mounted.py): every name of a hard link must count, not only the one the plan was built with."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "a.bin").write_bytes(os.urandom(300_000))
    os.link(src / "d" / "a.bin", src / "b.bin")
    os.link(src / "d" / "a.bin", src / "d" / "c.bin")
    (src / "single.bin").write_bytes(b"x" * 1000)
    url = f"file://{tmp_path}/repo"
    repo = Repository.init(url, cache_root=tmp_path / "cache")
    box = snapshot_box(src, repo, url, tmp_path / "cache", hints=False)
    state = tmp_path / "state"
    m, _f = materialize(box, state)
    assert m.complete
    own = OwnMount(box.manifest["id"], url, os.fsencode(state), finalized=False, status_path=None)
    names = [os.fsencode(src / n) for n in ("d/a.bin", "b.bin", "d/c.bin", "single.bin")]
    assert [own.local_complete(n) for n in names] == [True] * 4
    assert not own.local_complete(os.fsencode(src / "d/none.bin"))
    # a copy whose data is not whole yet is local under none of its names
    plan = Plan(state / "materialize.sqlite")
    ino = box.catalog.resolve(names[0]).ino
    plan.db().execute("UPDATE files SET complete=0 WHERE ino=?", (ino,))
    own = OwnMount(box.manifest["id"], url, os.fsencode(state), finalized=False, status_path=None)
    assert [own.local_complete(n) for n in names] == [False, False, False, True]


def test_tree_writes_run_niced_and_the_fetches_do_not(box, tmp_path, monkeypatch):
    """The copy into the local tree is background work: its batches run at nice +10, so the loop and the
    application win the cores; the GETs (which a reader may be waiting on) run at the daemon's priority."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen: dict[str, set[int]] = {"write": set(), "fetch": set()}
    original = TreeWriter.write_batch

    def write_batch(self, batch):
        seen["write"].add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return original(self, batch)

    def read_range(pack, off, n):
        seen["fetch"].add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return box.repo.read_pack_range(pack, off, n)

    monkeypatch.setattr(TreeWriter, "write_batch", write_batch)
    m, _f = materialize(box, tmp_path / "state", read_range)
    assert m.complete
    assert seen == {"write": {min(19, base + threadnice.BACKGROUND_NICE)}, "fetch": {base}}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base


class _LoopOnly(Materializer):
    """Records the thread of every attribute assigned after construction (the loop owns them all)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.__dict__["assigned_in"] = []

    def __setattr__(self, name, value) -> None:
        if "assigned_in" in self.__dict__:
            self.__dict__["assigned_in"].append((name, threading.current_thread().name))
        super().__setattr__(name, value)


@pytest.mark.parametrize("run", ["fresh", "resumed"])
def test_worker_threads_never_assign_the_materializers_state(box, tmp_path, run):
    """The preparation, the writes and the finish run in worker threads; what they find is assigned on the loop.

    (The preparation used to set the tree, the counters and the done/complete sets from its thread, while the
    loop read them on every vfs read.)"""
    state = tmp_path / "state"
    if run == "resumed":
        materialize(box, state)  # a first run; then its record is undone: the tree is reopened, not built
        with sqlite3.connect(state / "materialize.sqlite") as db:
            db.execute("UPDATE chunks SET done=0")
            db.execute("UPDATE files SET complete=0, pending=(SELECT count(*) FROM targets t WHERE t.ino=files.ino)")
            db.execute("DELETE FROM meta WHERE key='finished'")
    m, _ = materialize(box, state, cls=_LoopOnly, trace=[(box.path("data/shard2.bin"), 0)])
    assert m.complete, m.stats()
    names = {name for name, _thread in m.assigned_in}
    assert {"state", "files_total"} <= names  # (the spy sees the assignments)
    off_loop = [(name, thread) for name, thread in m.assigned_in if thread != threading.main_thread().name]
    assert off_loop == []


def test_hints_come_before_background_and_the_trace_before_both(box, tmp_path):
    """All requests queue behind a reader that holds the only non-reader slot; then they go in class order."""
    refs = all_refs(box)
    trace = [(box.path("data/shard2.bin"), 0), (box.path("data/shard0.bin"), MiB + 7)]
    trace_chunks = {e.chunk for p, off in trace for e in box.catalog.extents(box.catalog.resolve(p).ino)
                    if e.offset <= off < e.end}
    hint_files = [n.ino for _p, n in box.catalog.walk(box.catalog.resolve(box.path("venv/lib/site-packages")).ino)
                  if n.is_reg] + [box.catalog.resolve(box.path("ckpt/model.bin")).ino]
    hint_chunks = {e.chunk for ino in hint_files for e in box.catalog.extents(ino)} - trace_chunks
    klass = {c: 0 if c in trace_chunks else 1 if c in hint_chunks else 2 for c in refs}
    by_loc = {(r.pack, r.offset): klass[c] for c, r in refs.items()}

    log = CallLog(box.repo.read_pack_range, hold_first=True)
    fetcher = Fetcher(log, max_requests=2, reserved_for_read=1)
    state = tmp_path / "state"
    m = Materializer(box.catalog, fetcher, state, window_bytes=GiB, group_bytes=4 * MiB)
    blocker = next(r for c, r in refs.items() if klass[c] == 2)

    async def body():
        async with trio.open_nursery() as n:
            n.start_soon(fetcher.get, blocker, Priority.READ)  # holds the one slot prefetch may use
            n.start_soon(m.run, trace)
            with trio.fail_after(20):
                while fetcher.queued < len(refs) - 1:
                    await trio.sleep(0.01)
            log.release()

    run_trio(fetcher, body)
    assert m.complete
    sequence = []
    for pack, off, length in log.calls[1:]:
        sequence.append(min(k for (p, o), k in by_loc.items() if p == pack and off <= o < off + length))
    assert sequence == sorted(sequence), sequence
    assert sequence[0] == 0 and 1 in sequence and sequence[-1] == 2
    st = m.stats()["classes"]
    assert st["trace"]["bytes_total"] == sum(refs[c].raw_len for c in trace_chunks)
    assert st["hint"]["bytes_total"] == sum(refs[c].raw_len for c in hint_chunks)
    assert compare_trees(box.src, box.tree_of(state)) == []


# -- crashes ---------------------------------------------------------------------------------------
_CHILD = r"""
import sys, time, trio
from pathlib import Path
from ogrefs.repo.catalog import Catalog
from ogrefs.lazy.fetch.fetcher import Fetcher
from ogrefs.lazy.background.materialize.materializer import Materializer
from ogrefs.repo import Repository

url, cache_root, snap, state = sys.argv[1:5]
repo = Repository.open(url, cache_root=Path(cache_root))
cat = Catalog(repo.catalog_path(snap))

def slow(pack, off, n):
    time.sleep(0.03)
    return repo.read_pack_range(pack, off, n)

fetcher = Fetcher(slow, max_requests=3, reserved_for_read=1, max_range=512 * 1024)
m = Materializer(cat, fetcher, Path(state), window_bytes=1 << 20, group_bytes=256 << 10, batch_bytes=256 << 10,
                 flush_after=0.01)

async def main():
    async with trio.open_nursery() as n:
        await n.start(fetcher.run)
        await m.run()
        n.cancel_scope.cancel()

trio.run(main)
"""


def test_kill_9_then_restart_fetches_no_done_chunk_and_ends_exact(box, tmp_path):
    state = tmp_path / "state"
    refs = all_refs(box)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, box.repo_url, str(box.cache_root), box.snap_id,
                              str(state)], env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert child.poll() is None, "the child finished before it could be killed"
            assert time.monotonic() < deadline, "no progress in the child"
            try:
                if len(done_chunks(state)) >= len(refs) // 3:
                    break
            except sqlite3.Error:
                pass
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    done = done_chunks(state)
    assert 0 < len(done) < len(refs)
    log = CallLog(box.repo.read_pack_range)
    m, f = materialize(box, state, log)
    assert m.complete, m.stats()
    fetched = {r.chunk for r in log.chunks_fetched(list(refs.values()))}
    assert not fetched & done, "a chunk recorded done was fetched again"
    assert fetched == set(refs) - done
    assert compare_trees(box.src, box.tree_of(state)) == []


class TornDisk(Disk):
    """Once ``torn``: every write puts garbage on disk and the flush fails (the process "dies" there)."""

    torn = False

    def pwrite(self, fd, data, offset):
        super().pwrite(fd, b"\xaa" * len(data) if self.torn else data, offset)

    def datasync(self, fd):
        if self.torn:
            raise OSError(errno.EIO, "simulated crash after the write, before the commit")
        super().datasync(fd)

    def syncfs(self, fd):
        if self.torn:
            raise OSError(errno.EIO, "simulated crash after the write, before the commit")
        super().syncfs(fd)


@pytest.mark.expect_log(r"stopped: writing the local tree failed", level=logging.ERROR)
def test_chunks_written_but_not_recorded_are_fetched_again(box, tmp_path):
    """The third batch is written torn (garbage) and the process "dies" at its flush, before the commit."""
    disk = TornDisk()
    crash: dict = {"batches": 0, "chunks": []}

    class ThirdBatchTorn(TreeWriter):  # (the writers take turns: one batch at a time)
        def write_batch(self, batch):
            crash["batches"] += 1
            disk.torn = crash["batches"] == 3
            if disk.torn:
                crash["chunks"] = [item.ref.chunk for item, _ in batch]
            return super().write_batch(batch)

    state = tmp_path / "state"
    m, _ = materialize(box, state, batch_bytes=512 * 1024, batch_chunks=2,
                       make_writer=lambda catalog, tree, plan: ThirdBatchTorn(catalog, tree, plan, disk))
    assert m.state == "stopped" and "simulated crash" in m.reason
    crashed = set(crash["chunks"])
    assert crashed
    done = done_chunks(state)
    assert not done & crashed
    # files holding garbage are not served as local copies
    for ino, _off, _l, chunk, *_ in box.catalog.all_extents():
        if chunk in crashed:
            assert m.local_path(ino) is None
    log = CallLog(box.repo.read_pack_range)
    m2, _ = materialize(box, state, log)
    assert m2.complete
    fetched = {r.chunk for r in log.chunks_fetched(list(all_refs(box).values()))}
    assert crashed <= fetched
    assert not fetched & done
    assert compare_trees(box.src, box.tree_of(state)) == []


def test_cancelled_mid_way_resumes_where_it_stopped(box, tmp_path):
    state = tmp_path / "state"
    refs = all_refs(box)
    log = CallLog(box.repo.read_pack_range)
    fetcher = Fetcher(lambda *a: (time.sleep(0.02), log(*a))[1], max_requests=3, reserved_for_read=1,
                      max_range=512 * 1024)
    m = Materializer(box.catalog, fetcher, state, window_bytes=MiB, group_bytes=256 * 1024,
                     batch_bytes=256 * 1024, flush_after=0.01)

    async def body():
        with trio.move_on_after(10):
            async with trio.open_nursery() as n:
                n.start_soon(m.run)
                while m.stats()["bytes_done"] < m.stats()["bytes_total"] // 3 or m.state != "running":
                    await trio.sleep(0.01)
                n.cancel_scope.cancel()  # an unmount

    run_trio(fetcher, body)
    assert not m.complete
    done = done_chunks(state)
    assert 0 < len(done) < len(refs)
    log2 = CallLog(box.repo.read_pack_range)
    m2, _ = materialize(box, state, log2)
    assert m2.complete
    assert not {r.chunk for r in log2.chunks_fetched(list(refs.values()))} & done
    assert compare_trees(box.src, box.tree_of(state)) == []


# -- the store goes away ----------------------------------------------------------------------------------
@pytest.mark.expect_log(r"the store is unavailable; trying again", logger="ogrefs.lazy.background.materialize")
@pytest.mark.expect_log(r"store request failed|store unreachable", logger="ogrefs.lazy.fetch.fetcher")
def test_an_unreachable_store_pauses_materialization_which_then_resumes(box, tmp_path):
    from ogrefs.store.base import TransientError

    outage = {"until": None}

    def flaky(pack, off, n):
        if outage["until"] is None:
            outage["until"] = time.monotonic() + 0.6  # the store goes away at the first request, for 0.6 s
        if time.monotonic() < outage["until"]:
            raise TransientError("connection refused")
        return box.repo.read_pack_range(pack, off, n)

    fetcher = Fetcher(flaky)  # no retrying store: each failure is StoreUnavailable at once
    state = tmp_path / "state"
    m = Materializer(box.catalog, fetcher, state, retry_delay=0.3)
    states = set()

    async def body():
        async with trio.open_nursery() as n:
            n.start_soon(m.run)
            while m.state not in ("done", "incomplete", "stopped"):
                states.add(m.state)
                await trio.sleep(0.01)

    run_trio(fetcher, body)
    assert "waiting" in states and m.state == "done" and m.failed_chunks == 0
    assert compare_trees(box.src, box.tree_of(state)) == []


@contextlib.contextmanager
def pack_missing(box: Box, pack: str):
    """The store lacks ``pack`` inside the block; it is put back afterwards."""
    from ogrefs.repo.pack import pack_key

    body_ = box.repo.store.get(pack_key(pack))
    box.repo.store.delete(pack_key(pack))
    try:
        yield
    finally:
        box.repo.store.put(pack_key(pack), body_)


@pytest.mark.expect_log(r"materialization incomplete", level=logging.ERROR)
@pytest.mark.expect_log(r"is missing from the (repository|store)", level=logging.ERROR)
def test_a_missing_pack_leaves_its_files_lazy_and_a_rerun_completes(box, tmp_path):
    victim = box.refs_of("data/shard1.bin")[0].pack
    state = tmp_path / "state"
    with pack_missing(box, victim):
        m, _ = materialize(box, state)
        assert m.state == "incomplete" and m.failed_chunks > 0 and not m.complete
        assert "could not be fetched" in m.reason
        lost = {ino for ino, _o, _l, _c, pack, *_ in box.catalog.all_extents() if pack == victim}
        for path, node in box.catalog.walk():
            if node.is_reg and node.size:
                assert (m.local_path(node.ino) is None) == (node.ino in lost), path
    log = CallLog(box.repo.read_pack_range)
    m2, _ = materialize(box, state, log)
    assert m2.complete
    assert {p for p, _o, _n in log.calls} == {victim}
    assert compare_trees(box.src, box.tree_of(state)) == []


@pytest.mark.expect_log(r"materialization incomplete", level=logging.ERROR)
@pytest.mark.expect_log(r"is missing from the (repository|store)", level=logging.ERROR)
def test_done_chunks_of_incomplete_files_are_read_from_the_tree_never_fetched_again(box, tmp_path):
    # a file with chunks in two packs (the box's data is random; one of these always spans two)
    rel = next(r for r in ("data/shard0.bin", "data/shard1.bin", "data/shard2.bin", "data/shard3.bin",
                           "ckpt/model.bin") if len({x.pack for x in box.refs_of(r)}) > 1)
    refs = box.refs_of(rel)
    victim = refs[-1].pack
    state = tmp_path / "state"
    with pack_missing(box, victim):
        m, _ = materialize(box, state)
        assert m.state == "incomplete"
    done = [r for r in refs if r.pack != victim]
    assert done
    log = CallLog(box.repo.read_pack_range)
    fetcher = Fetcher(log)
    m2 = Materializer(box.catalog, fetcher, state)  # not run: only what the earlier run wrote
    ino = box.catalog.resolve(box.path(rel)).ino
    assert m2.local_path(ino) is None and all(m2.residency.in_tree(r.chunk) for r in done)
    fs = SnapshotFS(box.catalog, fetcher, local=m2)
    got = bytearray()

    async def body():
        fh = await fs.open(ino, os.O_RDONLY)
        while chunk := await fs.read(fh, len(got), 1 * MiB):
            got.extend(chunk)
        fs.release(fh)

    run_trio(fetcher, body)
    assert bytes(got) == (box.src / rel).read_bytes()
    assert {p for p, _o, _n in log.calls} == {victim}  # only what the tree does not have
    assert not log.chunks_fetched(done)
    assert fs.stats.local_reads >= len(done)


# -- disk space -----------------------------------------------------------------------------------------
@pytest.mark.expect_log(r"not materializing: needs")
def test_not_enough_space_means_no_materialization_and_a_working_lazy_mount(box, tmp_path):
    state = tmp_path / "state"
    fetcher = Fetcher(box.repo.read_pack_range)
    m = Materializer(box.catalog, fetcher, state, free_bytes=lambda path: (5 * MiB, 100 * GiB))
    pf = Prefetch(box.catalog, fetcher, materializer=m)

    async def body():
        await pf.run()
        await read_all_through_vfs(box, SnapshotFS(box.catalog, fetcher, local=m))

    run_trio(fetcher, body)
    assert m.state == "not materializing"
    assert m.reason.startswith("not materializing: needs ") and "5.0 MiB free" in m.reason, m.reason
    assert not (state / "tree").exists()
    st = pf.stats()
    assert st["mode"] == "cache" and st["reason"] == m.reason and st["state"] == "done"



@pytest.mark.expect_log(r"not materializing: needs")
@pytest.mark.skipif(not ROOT, reason="mounting a tmpfs needs root")
def test_a_small_disk_is_refused_by_statvfs(box, small_fs):
    disk = small_fs(8 * MiB)
    m, _ = materialize(box, disk / "state")
    assert m.state == "not materializing" and "not materializing: needs" in m.reason
    assert not (disk / "state" / "tree").exists()


def take_space(ballast: Path, want: int) -> None:
    """Fill up to ``want`` bytes of the disk, as another program would.

    The materializer keeps writing in its own threads between our statvfs and
    our write, so the disk may run full before ``want`` bytes are written: that
    is the point (the disk is full), not an error of the test.
    """
    piece = b"\1" * MiB
    with open(ballast, "wb") as f:
        try:
            while want > 0:
                want -= f.write(piece[: min(want, MiB)])
                f.flush()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise


@pytest.mark.expect_log(r"stopped: the disk of .* is full", level=logging.ERROR)
@pytest.mark.skipif(not ROOT, reason="mounting a tmpfs needs root")
def test_disk_full_mid_way_stops_cleanly_keeps_serving_and_resumes(box, small_fs):
    disk = small_fs(48 * MiB)
    state = disk / "state"
    ballast = disk / "ballast"

    def fill(n: int) -> None:
        if n == 1:  # after the space check passed: someone else takes the disk
            st = os.statvfs(disk)
            take_space(ballast, st.f_bavail * st.f_frsize - 12 * MiB)

    log = CallLog(box.repo.read_pack_range, on_call=fill)
    m, _ = materialize(box, state, log, reserve_bytes=0, batch_bytes=MiB)
    assert m.state == "stopped" and "is full" in m.reason, m.stats()
    assert not m.complete and 0 < m.stats()["bytes_done"] < m.stats()["bytes_total"]
    # complete files are exact; the mount serves every file (local or lazy) correctly
    local = 0
    for path, node in box.catalog.walk():
        if node.is_reg and (p := m.local_path(node.ino)) is not None:
            local += 1
            assert Path(os.fsdecode(p)).read_bytes() == Path(os.fsdecode(path)).read_bytes()
    assert local
    fetcher = Fetcher(box.repo.read_pack_range)
    run_trio(fetcher, lambda: read_all_through_vfs(box, SnapshotFS(box.catalog, fetcher, local=m)))
    # space comes back: a restart finishes the job
    ballast.unlink()
    m2, _ = materialize(box, state, reserve_bytes=0)
    assert m2.complete, m2.stats()
    assert compare_trees(box.src, box.tree_of(state)) == []


def test_state_of_another_snapshot_is_not_touched(box, tmp_path):
    state = tmp_path / "state"
    with sqlite3.connect(tmp_path / "x.sqlite"):
        pass
    state.mkdir()
    with sqlite3.connect(state / "materialize.sqlite") as db:
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
        db.execute("INSERT INTO meta VALUES ('snapshot', 'ab' || ?)", ("0" * 62,))
    m, f = materialize(box, state)
    assert m.state == "not materializing" and "holds the materialization of snapshot ab000" in m.reason
    assert not (state / "tree").exists() and f.stats.requests == 0


# -- the vfs hook ------------------------------------------------------------------------------------------
def test_complete_files_are_served_locally_and_the_store_is_never_contacted(box, tmp_path):
    state = tmp_path / "state"
    m, _ = materialize(box, state)
    assert m.complete

    def no_store(pack, off, n):
        raise AssertionError("the store was contacted")

    fetcher = Fetcher(no_store)
    fs = SnapshotFS(box.catalog, fetcher, local=m)
    run_trio(fetcher, lambda: read_all_through_vfs(box, fs))
    assert fetcher.stats.requests == 0 and fs.stats.local_opens == fs.stats.opens > 60
    assert fs.open_files == 0


def _read_local_copy(box, state, monkeypatch, rel: str, reads: list[tuple[int, int]], ops: list[str],
                     concurrent: int = 1):
    """Read ``rel`` front to back through a vfs over its complete local copy in 1 MiB READs, ``concurrent`` of
    them in flight at a time as the kernel's read-ahead sends them; every read system call on the copy is
    appended to ``reads`` as (offset, length), every worker-thread read of it (a span, a plain read) to
    ``ops``.  The bytes read, and the vfs."""
    m, _ = materialize(box, state)
    node = box.catalog.resolve(box.path(rel))
    ino, size = node.ino, node.size
    copy = str(box.tree_of(state) / rel)
    real_pread, real_preadv = os.pread, os.preadv

    def counting_pread(fd, n, off):
        data = real_pread(fd, n, off)
        if os.readlink(f"/proc/self/fd/{fd}") == copy:
            reads.append((off, len(data)))
        return data

    def counting_preadv(fd, bufs, off, *flags):
        n = real_preadv(fd, bufs, off, *flags)
        if os.readlink(f"/proc/self/fd/{fd}") == copy:
            reads.append((off, n))
        return n

    monkeypatch.setattr(os, "pread", counting_pread)
    monkeypatch.setattr(os, "preadv", counting_preadv)
    real_span, real_plain = localread.read_span, localread.pread

    def counting_span(*args):
        ops.append("span")
        return real_span(*args)

    async def counting_plain(*args):
        ops.append("pread")
        return await real_plain(*args)

    monkeypatch.setattr(localread, "read_span", counting_span)
    monkeypatch.setattr(localread, "pread", counting_plain)
    fetcher = Fetcher(box.repo.read_pack_range)
    fs = SnapshotFS(box.catalog, fetcher, local=m)
    got: dict[int, bytes] = {}

    async def one(fh: int, off: int) -> None:
        got[off] = bytes(await fs.read(fh, off, 1 << 20))

    async def read():
        fh = await fs.open(ino, os.O_RDONLY)
        offsets = list(range(0, size, 1 << 20))
        for i in range(0, len(offsets), concurrent):
            async with trio.open_nursery() as nursery:
                for off in offsets[i:i + concurrent]:
                    nursery.start_soon(one, fh, off)
        fs.release(fh)

    run_trio(fetcher, read)
    return b"".join(got[off] for off in sorted(got)), fs


@pytest.mark.parametrize("concurrent", [1, 3])
def test_a_complete_local_copy_read_front_to_back_is_exact_and_read_once_in_spans(box, tmp_path, monkeypatch,
                                                                                  concurrent):
    """Issue 49: a sequential reader of a complete local copy is served from spans of whole chunks, each read and
    named once in one worker-thread call, the READs inside a span answered from it (before: one read of the copy
    per READ, reading its range and each new chunk whole, so most bytes twice).  Also with several READs of the
    handle in flight at once, as the kernel's read-ahead sends them: they wait for the span being read."""
    monkeypatch.setattr(localread, "LOCAL_SPAN", 4 * MiB)  # the 5 MiB file: the first READ's chunks, then a span
    rel = "data/shard0.bin"
    reads: list[tuple[int, int]] = []
    ops: list[str] = []
    data, fs = _read_local_copy(box, tmp_path / "state", monkeypatch, rel, reads, ops, concurrent)
    want = (box.src / rel).read_bytes()
    assert data == want and len(box.refs_of(rel)) >= 2
    requests = -(-len(want) // MiB)
    # the first READ's chunks, then a span of the rest: fewer reads of the copy than READs (a READ in flight
    # beside it that lies behind the new span reads its own bytes)
    assert ops.count("span") >= 1 and len(ops) <= 1 + concurrent < requests
    # each byte read once, but where a span's last chunk went past the READs it held (read again from the READ on)
    biggest = max(ref.raw_len for ref in box.refs_of(rel))
    assert len(want) <= sum(n for _, n in reads) <= len(want) + len(ops) * biggest
    assert fs.stats.local_reads == requests and fs._local_reads.held_bytes == 0  # released with the handle


def test_spans_past_their_bound_are_not_read_ahead(box, tmp_path, monkeypatch):
    """With no room for spans (``LOCAL_SPANS_MAX``) a sequential reader reads what each READ needs, as before
    spans: exact, one read of the copy per READ, nothing held."""
    monkeypatch.setattr(localread, "LOCAL_SPANS_MAX", 0)
    rel = "data/shard0.bin"
    reads: list[tuple[int, int]] = []
    ops: list[str] = []
    data, fs = _read_local_copy(box, tmp_path / "state", monkeypatch, rel, reads, ops)
    want = (box.src / rel).read_bytes()
    assert data == want and len(ops) == -(-len(want) // MiB) and fs._local_reads.held_bytes == 0
    assert sum(n for _, n in reads) < 2 * len(want)


@pytest.mark.expect_log(r"local copy ", logger="ogrefs.lazy")
def test_a_local_copy_found_damaged_is_closed_at_release_not_at_once(box, tmp_path):
    """A handle whose complete local copy fails its naming reads the store from then on, and the copy's
    descriptor stays open until the handle is released: another READ of the handle may have a worker thread
    reading it, and a number closed at once can be reused by the next open (that read would then serve another
    file's bytes).  Before: closed when the damage was found."""
    state = tmp_path / "state"
    m, _ = materialize(box, state)
    rel = "data/shard0.bin"
    copy = box.tree_of(state) / rel
    damaged = bytearray(copy.read_bytes())
    damaged[3 * MiB + 5] ^= 0x01
    copy.write_bytes(bytes(damaged))
    ino = box.catalog.resolve(box.path(rel)).ino
    fetcher = Fetcher(box.repo.read_pack_range)
    fs = SnapshotFS(box.catalog, fetcher, local=m)
    seen: dict[str, object] = {}

    async def read():
        fh = await fs.open(ino, os.O_RDONLY)
        got = bytearray()
        while piece := await fs.read(fh, len(got), 1 << 20):
            got.extend(piece)
        fd = fs._files[fh].dropped_fd
        seen["open until release"] = fd is not None and os.readlink(f"/proc/self/fd/{fd}") == str(copy)
        fs.release(fh)
        seen["closed at release"] = not os.path.exists(f"/proc/self/fd/{fd}") or \
            os.readlink(f"/proc/self/fd/{fd}") != str(copy)
        seen["bytes"] = bytes(got)

    run_trio(fetcher, read)
    assert seen["bytes"] == (box.src / rel).read_bytes() and fs.stats.local_corrupt == 1 and fetcher.stats.requests
    assert seen["open until release"] and seen["closed at release"]


@pytest.mark.expect_log(r"local copy ", logger="ogrefs.lazy")
def test_a_damaged_local_copy_is_not_served(box, tmp_path, caplog):
    state = tmp_path / "state"
    m, _ = materialize(box, state)
    shard = box.tree_of(state) / "data" / "shard1.bin"
    os.truncate(shard, 10)  # somebody truncated the local copy behind our back
    fetcher = Fetcher(box.repo.read_pack_range)
    fs = SnapshotFS(box.catalog, fetcher, local=m)
    run_trio(fetcher, lambda: read_all_through_vfs(box, fs))
    assert fetcher.stats.requests > 0 and fs.stats.local_opens == fs.stats.opens - 1
    assert "is not the snapshot's file" in caplog.text


# -- no materialization: trace and hints into the chunk cache ----------------------------------------------------
def test_without_materialization_trace_and_hints_warm_the_cache(box, tmp_path):
    cache = ChunkCache(tmp_path / "chunks", 1 << 30)
    fetcher = Fetcher(box.repo.read_pack_range, cache)
    trace = [(box.path("data/shard3.bin"), 0), (box.path("gone/file"), 0)]
    pf = Prefetch(box.catalog, fetcher, trace_entries=trace, materializer=None)

    async def body():
        await pf.run()
        await trio.sleep(0.3)  # cache writes run in the background

    run_trio(fetcher, body)
    trace_ref = box.refs_of("data/shard3.bin")[0]
    assert cache.contains(trace_ref.chunk)
    for ref in box.refs_of("ckpt/model.bin") + box.refs_of("venv/lib/site-packages/pkg3/mod1.py"):
        assert cache.contains(ref.chunk)
    assert not any(cache.contains(r.chunk) for r in box.refs_of("data/shard0.bin"))  # no hint, no trace
    st = pf.stats()
    assert st["mode"] == "cache" and st["state"] == "done" and st["trace_dropped"] == 1
    assert st["classes"]["trace"] == {"bytes_done": trace_ref.raw_len, "bytes_total": trace_ref.raw_len}
    assert st["classes"]["hint"]["bytes_done"] == st["classes"]["hint"]["bytes_total"] > 4 * MiB
    assert st["classes"]["background"]["bytes_total"] == 0
    # a budget bounds what is prefetched (room for the first hint chunk, whatever its random size)
    from ogrefs.lazy.background.prefetch import hint_refs

    first = hint_refs(box.catalog)[0].raw_len
    fetcher2 = Fetcher(box.repo.read_pack_range, ChunkCache(tmp_path / "c2", 1 << 30))
    pf2 = Prefetch(box.catalog, fetcher2, materializer=None, cache_budget=first)
    run_trio(fetcher2, pf2.run)
    assert pf2.stats()["bytes_done"] == first < st["classes"]["hint"]["bytes_total"]


@pytest.mark.parametrize("with_trace", [True, False], ids=["trace", "hints-without-trace"])
def test_the_trace_or_the_hints_stream_into_memory_before_the_tree_is_built_and_are_fetched_once(
        box, tmp_path, with_trace):
    """Materializing mounts stream the trace at once (the tree takes seconds to build) and write it from memory;
    without a trace the hints (python, checkpoint) stream the same way."""
    from ogrefs.lazy.background.prefetch import hint_refs

    from ogrefs.lazy.background import prefetch

    cache = ChunkCache(tmp_path / "chunks", 1 << 30)
    log = CallLog(box.repo.read_pack_range)
    fetcher = Fetcher(log, cache, memory_bytes=1)  # an LRU that keeps nothing: the replay is held apart from it
    if with_trace:
        trace = [(box.path("data/shard2.bin"), 0), (box.path("data/shard0.bin"), 0)]
        streamed = box.refs_of("data/shard2.bin")[:1] + box.refs_of("data/shard0.bin")[:1]
    else:
        trace, streamed = None, hint_refs(box.catalog)
    # then the first 2 MiB of the rest, in pack order (the materializer's background order)
    rest = prefetch.rest_refs(box.catalog, frozenset(r.chunk for r in streamed), 2 * MiB)
    assert rest and sum(r.raw_len for r in rest) - rest[-1].raw_len < 2 * MiB  # (the last may go past it)
    assert rest == sorted(rest, key=lambda r: (r.pack, r.offset))
    streamed = streamed + rest
    calls_before_prepare: list[int] = []

    def spy(*args):
        calls_before_prepare.append(len(log.calls))
        return prepare(*args)

    m = Materializer(box.catalog, fetcher, tmp_path / "state", preparer=spy)

    def idle_for() -> float:  # an application busy until the replay and the rest have streamed
        return 1e9 if pf.replay_finished("background") else 0.0

    async def at_once() -> None:  # the rest streams whatever else the machine runs (pacing is test_trace's)
        pass

    # (with the box's real idle CPU as the pace, a loaded test machine held the rest back until the
    # 20 s settle deadline, and the tree was built before it had streamed)
    pf = Prefetch(box.catalog, fetcher, trace_entries=trace, materializer=m, idle_for=idle_for, settle_quiet=0.3,
                  rest_hold_bytes=2 * MiB,
                  spare_cpu=lambda: at_once)
    run_trio(fetcher, pf.run)
    assert m.complete and compare_trees(box.src, box.tree_of(tmp_path / "state")) == []
    assert calls_before_prepare and calls_before_prepare[0] >= 1  # fetched before the tree existed
    before = log.calls[:calls_before_prepare[0]]
    for ref in streamed:
        assert any(c[0] == ref.pack and c[1] <= ref.offset < c[1] + c[2] for c in before), ref
    for ref in streamed:
        covering = [c for c in log.calls if c[0] == ref.pack and c[1] <= ref.offset < c[1] + c[2]]
        assert len(covering) == 1, (ref, covering)  # once: the materializer took it from memory
        assert not cache.contains(ref.chunk)  # Keep.MEMORY: not a third copy in the disk cache
    assert fetcher.residency.memory_bytes == 1  # the LRU never grew for the replay
    assert fetcher.snapshot_stats()["held_bytes"] == 0 and fetcher.residency.hold_bytes == 0  # all taken, then released
    st = pf.stats()
    if with_trace:
        assert st["classes"]["trace"]["bytes_done"] == st["classes"]["trace"]["bytes_total"] > 0


def timed(stage, started: list[float]):
    """``stage`` (the preparation), noting the time each call begins in ``started``."""
    def call(*args):
        started.append(time.monotonic())
        return stage(*args)
    return call


@pytest.mark.parametrize("app_stops", [True, False], ids=["app-goes-quiet", "app-keeps-busy"])
def test_materialization_waits_for_the_application_to_settle(box, tmp_path, app_stops):
    fetcher = Fetcher(box.repo.read_pack_range)
    started: list[float] = []
    m = Materializer(box.catalog, fetcher, tmp_path / "state", preparer=timed(prepare, started))
    busy_until = time.monotonic() + 0.6 if app_stops else math.inf
    idle = lambda: 0.0 if time.monotonic() < busy_until else time.monotonic() - busy_until  # noqa: E731
    pf = Prefetch(box.catalog, fetcher, materializer=m, idle_for=idle, settle_quiet=0.2,
                  settle_max=1.5)
    states: list[str] = []

    async def body():
        async with trio.open_nursery() as n:
            n.start_soon(pf.run)
            while not started:
                states.append(pf.stats()["state"])
                await trio.sleep(0.05)

    t0 = time.monotonic()
    run_trio(fetcher, body)
    assert m.complete
    waited = started[0] - t0
    if app_stops:
        assert 0.75 <= waited < 1.5, waited  # busy for 0.6 s, then 0.2 s of quiet (not settle_max)
    else:
        assert waited >= 1.5, waited  # never quiet: starts at settle_max
    assert any("waiting for the application to settle" in s for s in states), states


@pytest.mark.parametrize("reads_past_trace", [True, False], ids=["reads-past-its-trace", "reads-its-trace"])
def test_an_application_reading_past_its_trace_starts_the_materializer(box, tmp_path, reads_past_trace):
    """A busy application that has left its traced start-up (reads what the trace did not hold) is not waited for:
    the tree is built at once, so what it reads next is adopted."""
    fetcher = Fetcher(box.repo.read_pack_range)
    started: list[float] = []
    m = Materializer(box.catalog, fetcher, tmp_path / "state", preparer=timed(prepare, started))
    traced = box.refs_of("data/shard0.bin")[:1]  # (the trace entry's chunk)
    untraced = box.refs_of("data/shard2.bin")
    pf = Prefetch(box.catalog, fetcher, trace_entries=[(box.path("data/shard0.bin"), 0)], materializer=m,
                  idle_for=lambda: 0.0, settle_quiet=0.2, settle_max=3.0,  # never quiet
                  rest_hold_bytes=0, settle_past_trace_bytes=sum(r.raw_len for r in untraced))
    t0 = time.monotonic()

    async def body():
        async with trio.open_nursery() as n:
            n.start_soon(pf.run)
            with trio.fail_after(10):
                while not pf.replay_finished("trace"):
                    await trio.sleep(0.01)
            for ref in traced[:1] + (untraced if reads_past_trace else traced[:1] * 3):
                await fetcher.get(ref, Priority.READ)

    run_trio(fetcher, body)
    assert m.complete
    waited = started[0] - t0
    if reads_past_trace:
        assert waited < 2.0, waited
    else:
        assert waited >= 3.0, waited  # what the trace held does not count: settle_max


def test_written_chunks_leave_the_page_cache(box, tmp_path):
    """The tree is written with fdatasync, then dropped from the page cache (fadvise DONTNEED)."""
    state = tmp_path / "state"
    m, _ = materialize(box, state)
    assert m.complete
    big = box.tree_of(state) / "data" / "shard0.bin"
    assert big.stat().st_size > MiB
    assert resident_bytes(big) < big.stat().st_size // 8  # (metadata reads may bring a page or two back)


def test_the_traces_chunks_stay_in_the_page_cache(box, tmp_path):
    """What the trace says the application reads next is not sent to the disk (on a busy box it queues there)."""
    state = tmp_path / "state"
    traced = box.refs_of("data/shard2.bin")[0]
    assert traced.raw_len >= 256 * 1024  # (smaller chunks stay cached anyway)
    m, _ = materialize(box, state, trace=[(box.path("data/shard2.bin"), 0)])
    assert m.complete
    tree = box.tree_of(state) / "data"

    assert resident_bytes(tree / "shard2.bin") >= traced.raw_len
    big = tree / "shard0.bin"  # neither traced nor a hint: it left the page cache
    assert resident_bytes(big) < big.stat().st_size // 8


def test_a_backlog_from_memory_does_not_hold_the_link_back(box, tmp_path):
    """Chunks streamed into memory before the tree existed are written while the link fetches what follows."""
    from ogrefs.lazy.fetch.fetcher import Keep
    from ogrefs.lazy.background.prefetch import hint_refs

    window = 1 * MiB
    log = CallLog(box.repo.read_pack_range)
    fetcher = Fetcher(log, memory_bytes=GiB)
    hints = hint_refs(box.catalog)
    in_memory = {r.chunk: r.raw_len for r in hints}
    left = [sum(in_memory.values())]
    assert left[0] > 4 * window
    seen: list[tuple[int, int]] = []  # (backlog bytes not yet written, store calls so far) at each backlog batch

    class SlowWriter(TreeWriter):  # (the writers take turns: one batch at a time)
        def write_batch(self, batch):
            mine = sum(in_memory.get(item.ref.chunk, 0) for item, _ in batch)
            if mine:
                seen.append((left[0], len(log.calls)))
                left[0] -= mine
                time.sleep(0.05)  # a writer busy with thousands of small files
            return super().write_batch(batch)

    m = Materializer(box.catalog, fetcher, tmp_path / "state", window_bytes=window, group_bytes=window // 4,
                     batch_bytes=256 * 1024, batch_chunks=8, make_writer=SlowWriter)

    async def body():
        for t in fetcher.request(hints, Priority.HINT, keep=Keep.MEMORY):
            await t.result()
        log.calls.clear()
        await m.run()

    run_trio(fetcher, body)
    assert m.complete and log.calls
    # the link did not wait for the backlog to be written: it fetched what follows while most was still to do
    assert any(calls > 0 and backlog > 3 * window for backlog, calls in seen), seen


def test_what_a_reader_fetches_is_adopted_into_the_tree_not_cached_and_never_fetched_again(box, tmp_path):
    cache = ChunkCache(tmp_path / "chunks", 1 << 30)
    log = CallLog(box.repo.read_pack_range)
    fetcher = Fetcher(log, cache)
    m = Materializer(box.catalog, fetcher, tmp_path / "state", window_bytes=MiB, group_bytes=256 * 1024)
    # background class: the materializer gets there last (three files: at least three chunks, whatever the
    # random content makes of each)
    refs = [r for name in ("shard1", "shard2", "shard3") for r in box.refs_of(f"data/{name}.bin")]
    assert len(refs) >= 3

    async def body():
        async with trio.open_nursery() as n:
            n.start_soon(m.run)
            with trio.fail_after(20):
                while m.state != "running":
                    await trio.sleep(0.005)
            for ref in refs:  # an application reads the shard while the materializer works on the rest
                assert len(await fetcher.get(ref, Priority.READ)) == ref.raw_len

    run_trio(fetcher, body)
    assert m.complete and compare_trees(box.src, box.tree_of(tmp_path / "state")) == []
    assert m.adopted_chunks >= len(refs)
    for ref in refs:
        covering = [c for c in log.calls if c[0] == ref.pack and c[1] <= ref.offset < c[1] + c[2]]
        assert len(covering) == 1, (ref, covering)  # fetched for the reader only: the tree took it from there
        assert not cache.contains(ref.chunk)  # and the chunk cache did without it
    assert done_chunks(tmp_path / "state") >= {r.chunk for r in refs}


def test_a_chunk_the_materializer_asked_for_that_a_reader_also_reads_skips_the_chunk_cache(box, tmp_path):
    """The feeder writes it from its own ticket (single flight): a copy in the chunk cache would be waste."""
    cache = ChunkCache(tmp_path / "chunks", 1 << 30)
    gate = threading.Event()
    fetcher = Fetcher(gated(box, gate), cache)
    m = Materializer(box.catalog, fetcher, tmp_path / "state", window_bytes=64 * MiB)
    ref = box.refs_of("data/shard1.bin")[0]

    async def body():
        async with trio.open_nursery() as n:
            n.start_soon(m.run)
            with trio.fail_after(20):
                while not m.residency.is_claimed(ref.chunk):  # requested by the feeder, still on its way
                    await trio.sleep(0.01)
            reader = trio.Event()

            async def read():
                assert len(await fetcher.get(ref, Priority.READ)) == ref.raw_len
                reader.set()

            n.start_soon(read)
            await trio.sleep(0.1)
            gate.set()
            await reader.wait()

    run_trio(fetcher, body)
    assert m.complete and compare_trees(box.src, box.tree_of(tmp_path / "state")) == []
    assert ref.chunk in done_chunks(tmp_path / "state")
    assert not cache.contains(ref.chunk)


def test_a_chunk_fetched_for_the_tree_but_not_yet_written_is_read_from_hand_not_fetched_again(box, tmp_path):
    log = CallLog(box.repo.read_pack_range)
    fetcher = Fetcher(log)
    gate = threading.Event()

    class HeldWriter(TreeWriter):
        def write_batch(self, batch):
            gate.wait(20)  # the writer is slow: fetched chunks wait in hand
            return super().write_batch(batch)

    m = Materializer(box.catalog, fetcher, tmp_path / "state", window_bytes=64 * MiB, make_writer=HeldWriter)
    fs = SnapshotFS(box.catalog, fetcher, local=m)
    path = box.path("data/shard1.bin")
    node = box.catalog.resolve(path)
    ref = box.refs_of("data/shard1.bin")[0]
    got: dict[str, object] = {}

    async def body():
        async with trio.open_nursery() as n:
            n.start_soon(m.run)
            with trio.fail_after(20):
                while m.residency.in_hand(ref.chunk) is None:
                    await trio.sleep(0.01)
            got["calls"] = len(log.calls)
            fh = await fs.open(node.ino, os.O_RDONLY)
            got["data"] = bytes(await fs.read(fh, 0, ref.raw_len))
            fs.release(fh)
            got["after"] = len(log.calls)
            gate.set()

    run_trio(fetcher, body)
    assert got["data"] == Path(os.fsdecode(path)).read_bytes()[:ref.raw_len]
    covering = [c for c in log.calls if c[0] == ref.pack and c[1] <= ref.offset < c[1] + c[2]]
    assert len(covering) == 1, covering  # the materializer's GET only
    assert m.complete and m.residency.in_hand(ref.chunk) is None


def test_adoption_stops_at_its_bound_and_the_cache_keeps_the_rest(box, tmp_path):
    cache = ChunkCache(tmp_path / "chunks", 1 << 30)
    fetcher = Fetcher(box.repo.read_pack_range, cache)
    m = Materializer(box.catalog, fetcher, tmp_path / "state", window_bytes=MiB, group_bytes=256 * 1024,
                     adopt_bytes=1)  # room for nothing
    refs = box.refs_of("data/shard2.bin")

    async def body():
        async with trio.open_nursery() as n:
            n.start_soon(m.run)
            with trio.fail_after(20):
                while m.state != "running":
                    await trio.sleep(0.005)
            for ref in refs:
                await fetcher.get(ref, Priority.READ)
            await trio.sleep(0.2)
            assert all(cache.contains(r.chunk) for r in refs)  # kept the usual way

    run_trio(fetcher, body)
    assert m.complete and m.adopted_chunks == 0
    assert compare_trees(box.src, box.tree_of(tmp_path / "state")) == []


def test_request_keep_false_stays_out_of_the_caches_unless_a_reader_wants_it(box, tmp_path):
    cache = ChunkCache(tmp_path / "chunks", 1 << 30)
    gate = threading.Event()
    fetcher = Fetcher(gated(box, gate), cache)
    a, b = box.refs_of("data/shard0.bin")[:2]

    async def body():
        ta, tb = fetcher.request([a, b], Priority.BACKGROUND, keep=False)
        await trio.sleep(0.1)
        reader = trio.Event()

        async def read_b():
            await fetcher.get(b, Priority.READ)
            reader.set()

        async with trio.open_nursery() as n:
            n.start_soon(read_b)
            await trio.sleep(0.1)
            gate.set()
            assert await ta.result() and await tb.result()
        await trio.sleep(0.3)

    run_trio(fetcher, body)
    assert not cache.contains(a.chunk) and not fetcher.residency.is_cached(a.chunk)
    assert cache.contains(b.chunk) and fetcher.residency.is_cached(b.chunk)
    assert fetcher.stats.chunks_fetched == 2


def test_root_inode_is_a_directory_in_the_tree(box, tmp_path):
    """The local tree's root takes the snapshot root's metadata once complete."""
    state = tmp_path / "state"
    m, _ = materialize(box, state)
    root = box.catalog.get(ROOT_INO)
    st = os.stat(state / "tree")
    assert (st.st_mode, st.st_mtime_ns) == (root.mode, root.mtime_ns)


# -- one real mount ------------------------------------------------------------------------------------------------
_MOUNT_CHILD = r"""
import os, sys, trio
from pathlib import Path
from ogrefs.mount import fuse_ops
from ogrefs.repo.catalog import Catalog
from ogrefs.lazy.fetch.fetcher import Fetcher
from ogrefs.lazy.background.materialize.materializer import Materializer
from ogrefs.repo import Repository
from ogrefs.store.base import NotFound
from ogrefs.lazy.fs.vfs import SnapshotFS

url, cache_root, snap, state, mp = sys.argv[1:6]
repo = Repository.open(url, cache_root=Path(cache_root))
cat = Catalog(repo.catalog_path(snap))

def gone(pack, off, n):
    raise NotFound(f"pack {pack}: the store is gone")

fetcher = Fetcher(gone)
fs = SnapshotFS(cat, fetcher, local=Materializer(cat, fetcher, Path(state)),
                page_cache=fuse_ops.store_in_page_cache if os.environ.get("OGREFS_TEST_PUSH") else None)
ready = []
ops = fuse_ops.FuseOps(fs, on_init=lambda: ready[0].set())
fuse_ops.fuse_mount(ops, mp, fuse_ops.mount_options())

async def main():
    ready.append(trio.Event())
    async with trio.open_nursery() as n:
        await n.start(fetcher.run)

        async def announce():
            await ready[0].wait()
            print("ready", flush=True)

        async def report_idle():  # each line on stdin: wait until the pushes asked for are done, say so
            while await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True):
                while not fs.pushes_idle():
                    await trio.sleep(0.01)
                print("idle", flush=True)

        n.start_soon(announce)
        n.start_soon(report_idle)
        n.start_soon(fs.run_pushes)
        await fuse_ops.serve()
        n.cancel_scope.cancel()

try:
    trio.run(main)
finally:
    fuse_ops.fuse_close(unmount=True)
print("requests", fetcher.stats.requests, "local opens", fs.stats.local_opens, "reads", fs.stats.reads,
      "pushed", fs.stats.page_cache_pushed, flush=True)
"""


@pytest.mark.fuse
@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.exists("/dev/fuse") or not ROOT, reason="needs /dev/fuse and root")
def test_a_real_mount_of_a_materialized_snapshot_needs_no_store_and_crawls_from_the_page_cache(box, tmp_path):
    """Reads of a crawl's small local files are served from the kernel's page cache, with the right bytes."""
    state = tmp_path / "state"
    m, _ = materialize(box, state)
    assert m.complete
    with_push = _crawl_a_real_mount(box, state, tmp_path / "mnt", push=True)
    without = _crawl_a_real_mount(box, state, tmp_path / "mnt", push=False)
    assert without["pushed"] == 0 and with_push["pushed"] >= with_push["small"] - 2 * with_push["first"]
    # every pushed file that was read afterwards was served by the kernel's page cache, not by a READ
    assert with_push["reads"] <= without["reads"] - with_push["pushed"] + with_push["first"], (with_push, without)


def _crawl_a_real_mount(box: Box, state: Path, mp: Path, *, push: bool) -> dict[str, int]:
    """Mount (no store: only the local copy), open one small file per directory, then read everything."""
    mp.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OGREFS_TEST_PUSH="1" if push else "")
    child = subprocess.Popen([sys.executable, "-c", _MOUNT_CHILD, box.repo_url, str(box.cache_root), box.snap_id,
                              str(state), str(mp)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    first = seen = small = 0
    try:
        assert child.stdout.readline().strip() == "ready"
        for dirpath, _dirs, files in os.walk(mp / str(box.src).lstrip("/")):  # list, then open one file per dir
            for name in sorted(files):
                p = Path(dirpath) / name
                if not p.is_symlink() and p.is_file() and 0 < p.stat().st_size <= 128 * 1024:
                    p.read_bytes()
                    first += 1
                    break
        child.stdin.write("\n")  # the pushes run in the background: wait until they are done
        child.stdin.flush()
        assert child.stdout.readline().strip() == "idle"
        for dirpath, _dirs, files in os.walk(box.src):
            for name in files:
                p = Path(dirpath) / name
                if p.is_symlink() or not p.is_file():
                    continue
                assert (mp / str(p).lstrip("/")).read_bytes() == p.read_bytes(), p
                seen += 1
                small += 0 < p.stat().st_size <= 128 * 1024
        assert seen > 60 and small > 20
    finally:
        subprocess.run(["umount", str(mp)], capture_output=True)
        child.stdin.close()
        out = child.stdout.read()
        child.wait(timeout=30)
    assert child.returncode == 0
    assert "requests 0 " in out and f"local opens {seen + first}" in out, out
    reads, pushed = (int(x) for x in re.search(r"reads (\d+) pushed (\d+)", out).groups())
    return {"reads": reads, "pushed": pushed, "first": first, "small": small}


@pytest.mark.expect_log(r"stopped: preparing the local tree failed", level=logging.ERROR)
def test_a_preparation_that_stops_leaves_the_materializer_stopped_with_its_reason(box, tmp_path):
    """What the tree build raises reaches the materializer as itself (not wrapped by the gate's nursery)."""
    from ogrefs.lazy.background.materialize import space

    def failing(*_args):
        raise space.Stop(OSError(errno.EIO, "Input/output error"), "preparing the local tree")

    fetcher = Fetcher(box.repo.read_pack_range)
    m = Materializer(box.catalog, fetcher, tmp_path / "state", preparer=failing, idle_for=lambda: 0.0)
    run_trio(fetcher, m.run)
    assert m.state == "stopped" and "Input/output error" in m.reason and not m.complete
