"""The no-FUSE copy's data path (``inplace/stream.py``): one stream over the whole copy, not a restore a batch.

Each test failed on the engine that ran one Restorer per batch of 256 files, each waiting for the one before:

* the rest is fetched in whole ranges across the groups the engine hands over (one read a pack here, where a
  batch each read its own);
* files are put in place (the ``syncfs`` before their renames) while the next ranges are fetched;
* a path asked for while every worker is inside a range of the rest is fetched and placed at once.
"""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import threading
import time
from pathlib import Path

import pytest

from ogrefs.box.copyplan import Plan
from ogrefs.inplace.engine import InPlace, Order
from ogrefs.repo import Repository
from ogrefs.repo.catalog import Catalog
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot
from tests.treegen import compare_trees

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (owners as the snapshot has them)")]

#: Longest a held read or a held syncfs waits in these tests (a test that never releases it fails, not hangs).
HOLD_S = 20


def _box(tmp_path: Path, files: int) -> tuple[Repository, Catalog, Path, Path]:
    src = tmp_path / "src"
    for i in range(files):
        (src / f"a{i // 100}").mkdir(parents=True, exist_ok=True)
        (src / f"a{i // 100}" / f"f{i:03}").write_bytes(os.urandom(2048))
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    out = tmp_path / "out"
    out.mkdir()
    return repo, Catalog(repo.catalog_path(m["id"])), src, out


def _engine(tmp_path: Path, repo: Repository, cat: Catalog, out: Path, read_range) -> InPlace:
    engine = InPlace(cat, read_range, os.fsencode(out), Plan(tmp_path / "plan.sqlite"),
                     snapshot_id=repo.resolve("latest")["id"], skip=lambda *_a: False)
    engine.prepare(Order())
    return engine


def _data_modules() -> list:
    """The modules of the copy's data path: restore's, the engine's, and the stream's where there is one."""
    import ogrefs.inplace.engine
    import ogrefs.restore
    modules = [ogrefs.restore, ogrefs.inplace.engine]
    try:
        import ogrefs.inplace.stream
    except ImportError:  # (the engine of one Restorer a batch)
        return modules
    return modules + [ogrefs.inplace.stream]


def _small_ranges(monkeypatch) -> None:
    """Ranges of at most 16 KiB: many reads from a small box."""
    for module in _data_modules():
        if hasattr(module, "MAX_RANGE"):
            monkeypatch.setattr(module, "MAX_RANGE", 16384)


@contextlib.contextmanager
def _open_files_limit(room: int):
    """The soft open-files limit at ``room`` above what this process has open now (a suite's worker holds
    descriptors of earlier tests: a limit of 256 left the copy a few dozen in one, and it failed "Too many open
    files" where it keeps within 256 of its own)."""
    gc.collect()  # (an earlier test's engine, catalog and repository, unreachable, close their files)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + room, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_rest_is_read_in_whole_ranges_across_groups(tmp_path):
    """600 files of the rest (three groups of 256 at most) in one pack: one read, where each batch read its
    own part (three reads)."""
    repo, cat, src, out = _box(tmp_path, 600)
    reads: list[tuple[str, int, int]] = []
    lock = threading.Lock()

    def read_range(pack, offset, length):
        with lock:
            reads.append((pack, offset, length))
        return repo.read_pack_range(pack, offset, length)

    engine = _engine(tmp_path, repo, cat, out, read_range)
    engine.run()
    packs = {e.pack for _p, n in cat.walk() if n.is_reg for e in cat.extents(n.ino)}
    assert len(packs) == 1 and len(reads) == 1, reads
    assert compare_trees(src, out / str(src).lstrip("/")) == []


def test_files_take_their_names_while_the_next_ranges_are_fetched(tmp_path, monkeypatch):
    """The first ``syncfs`` before renames waits for a read to start meanwhile: the stream's placer runs beside
    the fetching; a batch's came after its last read (the read never came: False)."""
    import ogrefs.localtree

    _small_ranges(monkeypatch)
    repo, cat, src, out = _box(tmp_path, 600)
    read_during_sync = threading.Event()
    syncing = threading.Event()
    reads = [0]
    lock = threading.Lock()
    seen: list[bool] = []
    real_syncfs = ogrefs.localtree.syncfs_fd

    def read_range(pack, offset, length):
        with lock:
            reads[0] += 1
            first = reads[0] <= 3
        if not first:  # the first files are complete: the rest waits for a placement to begin
            syncing.wait(HOLD_S)
        if syncing.is_set():
            read_during_sync.set()
        return repo.read_pack_range(pack, offset, length)

    def syncfs(fd):
        if not seen:
            syncing.set()
            seen.append(read_during_sync.wait(HOLD_S))
        real_syncfs(fd)

    for module in _data_modules():
        if hasattr(module, "syncfs_fd"):
            monkeypatch.setattr(module, "syncfs_fd", syncfs)
    engine = _engine(tmp_path, repo, cat, out, read_range)
    engine.run()
    assert seen == [True]
    assert compare_trees(src, out / str(src).lstrip("/")) == []


def test_a_path_asked_for_while_every_worker_reads_the_rest_comes_at_once(tmp_path, monkeypatch):
    """Every worker is held inside a range of the rest; a ``need`` of the catalog's last file is answered
    while they stay held (the asked-for ranges have workers of their own); then everything completes."""
    _small_ranges(monkeypatch)
    repo, cat, src, out = _box(tmp_path, 600)
    last = src / "a5" / "f599"
    wanted = {(e.pack, e.pack_offset) for e in cat.extents(cat.resolve(os.fsencode(last)).ino)}
    gate = threading.Event()
    held = threading.Semaphore(0)

    def read_range(pack, offset, length):
        if not any(p == pack and offset <= o < offset + length for p, o in wanted):
            held.release()
            gate.wait(HOLD_S)
        return repo.read_pack_range(pack, offset, length)

    engine = _engine(tmp_path, repo, cat, out, read_range)
    runner = threading.Thread(target=engine.run, daemon=True)
    runner.start()
    try:
        for _ in range(engine.workers):
            assert held.acquire(timeout=HOLD_S), "the workers never all started a read"
        need = engine.need(os.fsencode(out / str(last).lstrip("/")))
        answered = need.event.wait(HOLD_S)
        still_held = not gate.is_set()
    finally:
        gate.set()
        runner.join(60)
    assert answered and need.answer == "ok" and still_held
    assert not runner.is_alive()
    assert compare_trees(src, out / str(src).lstrip("/")) == []


def test_once_the_working_set_is_in_place_the_rest_is_fetched_niced(tmp_path, monkeypatch):
    """A job started on the working set (``ogrefs run``) gets the cores before the rest of the copy: every read of
    the rest that starts after the working set is in place runs in a thread niced by BACKGROUND_NICE; the working
    set's reads ran at the daemon's own priority.  (Failed before: every read at the daemon's priority.)"""
    import ogrefs.inplace.stream as stream

    _small_ranges(monkeypatch)
    repo, cat, src, out = _box(tmp_path, 600)
    first = [cat.resolve(os.fsencode(src / "a0" / f"f{i:03}")).ino for i in range(50)]
    working = {(e.pack, e.pack_offset) for ino in first for e in cat.extents(ino)}
    signalled = threading.Event()
    reads: list[tuple[bool, bool, int]] = []  # (the working set's, after the signal, the thread's nice)
    base = os.getpriority(os.PRIO_PROCESS, 0)

    def read_range(pack, offset, length):
        mine = any(p == pack and offset <= o < offset + length for p, o in working)
        after = signalled.is_set()
        reads.append((mine, after, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        if not mine and not after:
            signalled.wait(HOLD_S)  # the rest waits for the working set (as a link shared with it would)
        return repo.read_pack_range(pack, offset, length)

    engine = InPlace(cat, read_range, os.fsencode(out), Plan(tmp_path / "plan.sqlite"),
                     snapshot_id=repo.resolve("latest")["id"], skip=lambda *_a: False)
    engine.prepare(Order(trace=tuple(first)))
    runner = threading.Thread(target=engine.run, args=(signalled.set,), daemon=True)
    runner.start()
    runner.join(120)
    assert not runner.is_alive()
    assert compare_trees(src, out / str(src).lstrip("/")) == []
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # (the caller's own thread is never reniced)
    niced = min(19, base + getattr(stream, "BACKGROUND_NICE", 10))
    assert {nice for mine, after, nice in reads if mine} == {base}
    later = [nice for mine, after, nice in reads if not mine and after]
    assert later and set(later) == {niced}, (len(later), set(later))


def test_a_file_asked_for_takes_its_name_without_waiting_for_a_syncfs(tmp_path, monkeypatch):
    """A ``syncfs`` while the rest is being written waits for every dirty page of the file system (0.1-0.4 s a
    round on the bench's VM): a file a job waits on is made durable by its own ``fdatasync`` and takes its name
    while every ``syncfs`` is held, whether it was complete before it was asked for (then the asker places it,
    also out of the round the placer is syncing) or after (the worker that completes it).  Before, its ``need``
    was answered only once a ``syncfs`` returned; with only the worker placing it, in one full-suite run of
    eight, the file was complete already and waited for the held ``syncfs``."""
    import ogrefs.localtree

    _small_ranges(monkeypatch)
    repo, cat, src, out = _box(tmp_path, 600)
    release = threading.Event()
    syncs = threading.Semaphore(0)
    real_syncfs = ogrefs.localtree.syncfs_fd

    def syncfs(fd):
        syncs.release()
        release.wait(HOLD_S)
        real_syncfs(fd)

    for module in _data_modules():
        if hasattr(module, "syncfs_fd"):
            monkeypatch.setattr(module, "syncfs_fd", syncfs)
    engine = _engine(tmp_path, repo, cat, out, repo.read_pack_range)
    runner = threading.Thread(target=engine.run, daemon=True)
    runner.start()
    try:
        assert syncs.acquire(timeout=HOLD_S), "no syncfs began"  # the placer is inside a held syncfs
        last = src / "a5" / "f599"
        need = engine.need(os.fsencode(out / str(last).lstrip("/")))
        answered = need.event.wait(HOLD_S / 2)
        held = not release.is_set()
    finally:
        release.set()
        runner.join(60)
    assert answered and held and need.answer == "ok"
    assert not runner.is_alive()
    assert compare_trees(src, out / str(src).lstrip("/")) == []


def test_complete_files_waiting_for_the_placer_stay_within_the_open_files_limit(tmp_path, monkeypatch):
    """Every complete file used to wait for the placer with its descriptor open: with the placer inside a held
    ``syncfs`` while 600 files complete, with room for 256 open files, the workers ran out of them
    ("Too many open files": files failed, the tree incomplete).  Past a bound a complete file now waits closed,
    its metadata set when its round reopens it; the copy completes, metadata included, within the limit."""
    import ogrefs.localtree

    _small_ranges(monkeypatch)
    repo, cat, src, out = _box(tmp_path, 600)
    for i in range(0, 600, 7):  # owners and modes a reopened file must still get
        p = src / f"a{i // 100}" / f"f{i:03}"
        os.chown(p, 1000 + i, 2000 + i)
        os.chmod(p, 0o4751 if i % 2 else 0o640)
    repo = Repository.open(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    cat = Catalog(repo.catalog_path(m["id"]))
    real_syncfs = ogrefs.localtree.syncfs_fd
    engines: list[InPlace] = []
    waited: list[bool] = []
    asked: list[str | None] = []

    def syncfs(fd):
        if not waited:  # the first round waits until every file is complete (every worker ended)
            deadline = time.monotonic() + HOLD_S
            while not engines[0]._stream.drained() and time.monotonic() < deadline:
                time.sleep(0.01)
            waited.append(engines[0]._stream.drained())
            # the last file, waiting closed, is asked for meanwhile: reopened and placed by its asker
            need = engines[0].need(os.fsencode(out / str(src / "a5" / "f599").lstrip("/")))
            asked.append(need.answer if need.event.wait(HOLD_S) else None)
        real_syncfs(fd)

    for module in _data_modules():
        if hasattr(module, "syncfs_fd"):
            monkeypatch.setattr(module, "syncfs_fd", syncfs)
    with _open_files_limit(256):
        engines.append(_engine(tmp_path, repo, cat, out, repo.read_pack_range))
        engines[0].run()
    assert waited == [True] and asked == ["ok"]
    assert engines[0].failed == {} and engines[0].metadata_problems == {}
    assert compare_trees(src, out / str(src).lstrip("/")) == []


def test_a_file_asked_for_while_the_placer_reopens_it_is_placed_by_its_asker(tmp_path, monkeypatch):
    """A round reopens the files that waited closed before its ``syncfs``; one being reopened was in neither of
    the lists an asker looks in, so a job asking for it then waited for the whole round, ``syncfs`` included
    (here held until the need is answered: it never was).  The asker now waits for that one reopen and places
    the file itself, in the round's ``syncfs``."""
    import ogrefs.inplace.stream as stream_mod
    import ogrefs.localtree

    _small_ranges(monkeypatch)
    repo, cat, src, out = _box(tmp_path, 300)
    real_syncfs = ogrefs.localtree.syncfs_fd
    real_opened = stream_mod.Stream._opened
    engines: list[InPlace] = []
    syncs: list[bool] = []
    target: list[bytes] = []  # the file asked for: the first the placer reopens after the first round
    asked: list[str | None] = []

    def syncfs(fd):
        stream = engines[0]._stream
        deadline = time.monotonic() + HOLD_S
        if not syncs:  # the first round waits until every file is complete: most of them wait closed
            while not stream.drained() and time.monotonic() < deadline:
                time.sleep(0.01)
        elif target:  # the round that reopened the file asked for: held until its need is answered
            while not asked and time.monotonic() < deadline:
                time.sleep(0.01)
        syncs.append(True)
        real_syncfs(fd)

    def ask() -> None:
        need = engines[0].need(target[0])
        asked.append(need.answer if need.event.wait(HOLD_S) else None)

    def opened(self, items):
        closed = [f for f, fd, _p in items if fd < 0]
        if threading.current_thread() is self._placer and syncs and not target and closed:
            target.append(os.fsencode(out) + b"/" + closed[0].names[0].lstrip(b"/"))
            threading.Thread(target=ask, daemon=True).start()
            time.sleep(0.5)  # asked for while the placer reopens it, and the reopen takes a while
        return real_opened(self, items)

    for module in _data_modules():
        if hasattr(module, "syncfs_fd"):
            monkeypatch.setattr(module, "syncfs_fd", syncfs)
    monkeypatch.setattr(stream_mod.Stream, "_opened", opened)
    with _open_files_limit(256):  # (32 files wait open, the others closed)
        engines.append(_engine(tmp_path, repo, cat, out, repo.read_pack_range))
        engines[0].run()
    assert target and asked == ["ok"]
    assert engines[0].failed == {}
    assert compare_trees(src, out / str(src).lstrip("/")) == []


def test_files_made_after_others_completed_are_written_through_the_descriptor_they_were_made_with(
        tmp_path, monkeypatch):
    """Restore keeps a quarter of the open-files limit of files open from creation to completion; past that a
    file's every write reopens it by name.  That budget was spent once and never given back when a file
    completed, so in the copy, where a file is made by its first write, every file after the first quarter of
    the limit (64 with room for 256) was reopened per write.  A completed file now gives its place back."""
    import ogrefs.localtree

    _small_ranges(monkeypatch)
    repo, cat, src, out = _box(tmp_path, 600)
    real_open_own = ogrefs.localtree.LocalTree.open_own
    reopened_to_write: list[bytes] = []

    def open_own(self, rel, flags, own):
        if flags & os.O_ACCMODE == os.O_WRONLY:
            reopened_to_write.append(rel)
        return real_open_own(self, rel, flags, own)

    monkeypatch.setattr(ogrefs.localtree.LocalTree, "open_own", open_own)
    with _open_files_limit(256):
        engine = _engine(tmp_path, repo, cat, out, repo.read_pack_range)
        engine.run()
    assert engine.failed == {}
    assert compare_trees(src, out / str(src).lstrip("/")) == []
    assert len(reopened_to_write) < 60, len(reopened_to_write)  # (a tenth of the files; before: 536)
