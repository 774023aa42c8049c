"""The walk's read-ahead (snapshot/readahead.py): it advises the files of a tree the walk will read whole,
nothing where the parent's files are reused, never opens what is not a regular file, and stays out of
directories the walk skips."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ogrefs.repo import Repository
from ogrefs.snapshot import pipeline
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot
from ogrefs.snapshot.readahead import ReadAhead

from tests.treegen import compare_trees


@pytest.fixture
def advised(monkeypatch) -> list[ReadAhead]:
    """Every ReadAhead a snapshot makes, to read its count after the run."""
    made: list[ReadAhead] = []

    class Counted(ReadAhead):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(pipeline, "ReadAhead", Counted)
    return made


def _tree(root: Path) -> None:
    for d in range(5):
        sub = root / f"pkg{d}" / "sub"
        sub.mkdir(parents=True)
        for f in range(20):
            (sub / f"m{f}.py").write_bytes(os.urandom(3000 + f))
    (root / "big.bin").write_bytes(os.urandom(3 * 1024 * 1024))  # above SMALL_FILE: the kernel's own readahead
    os.mkfifo(root / "pipe")  # opened by nobody: an open would block
    (root / "skipme").mkdir()
    (root / "skipme" / "secret.txt").write_text("x")


def test_a_new_tree_is_advised_a_reused_one_is_not(tmp_path, advised):
    repo = Repository.init(str(tmp_path / "repo"), cache_root=tmp_path / "cache")
    src = tmp_path / "src"
    src.mkdir()
    _tree(src)
    first = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], excludes=["*/skipme"]))
    # up to 100 small files (some may be passed before the walker gets to them), never the big one, the FIFO
    # or the excluded directory's file
    assert 0 < advised[-1].advised <= 100
    assert first["totals"]["files"] == 101
    second = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], excludes=["*/skipme"]))
    assert advised[-1].advised == 0 and second["totals"]["reused_files"] == 101  # nothing read, nothing advised
    out = tmp_path / "out"
    from ogrefs.repo.catalog import Catalog
    from ogrefs.restore import Restorer

    Restorer(Catalog(repo.catalog_path(second["id"])), repo.read_pack_range, os.fsencode(out)).run()
    (src / "skipme" / "secret.txt").unlink()
    (src / "skipme").rmdir()
    assert compare_trees(src, out / str(src).lstrip("/")) == []


def test_the_walker_never_opens_what_is_not_a_regular_file(tmp_path, monkeypatch):
    """lstat first, then fstat of what was opened: a FIFO, a socket or a device node is never opened."""
    from ogrefs.snapshot import readahead

    _tree(tmp_path)
    opened: list[bytes] = []
    real_open = os.open

    def watching_open(path, flags, *a):
        opened.append(os.fsencode(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(readahead.os, "open", watching_open)
    ra = ReadAhead(lambda: 0, lambda p: p.endswith(b"/skipme"))
    ra.entering(os.fsencode(tmp_path), os.lstat(tmp_path).st_dev, all_read=True)
    ra._walker._thread.join(30)  # the whole tree is within 64 MiB of a walk at 0: the walker ends by itself
    ra.close()
    assert ra.advised == 100
    assert not any(p.endswith((b"/pipe", b"/big.bin", b"/secret.txt")) for p in opened)
    assert all(p.endswith(b".py") for p in opened)


def test_a_walker_the_walk_has_left_far_behind_stops(tmp_path, monkeypatch):
    """A warm cache: the walk gets past the walker by more than its window; the walker stops there, advising
    nothing and looking at nothing more (it would otherwise lstat the rest of the tree for no one)."""
    from ogrefs.snapshot import readahead

    _tree(tmp_path)  # in walk order: big.bin (not advised: large), pipe, then the pkg directories
    looked: list[bytes] = []
    real_lstat = os.lstat
    monkeypatch.setattr(readahead.os, "lstat", lambda p: (looked.append(p), real_lstat(p))[1])
    walked = [0]
    jumped = threading.Event()

    def skip(path: bytes) -> bool:  # the walker's first directory: it waits here until the walk is far ahead
        jumped.wait(30)
        return False

    ra = ReadAhead(lambda: walked[0], skip)
    ra.entering(os.fsencode(tmp_path), os.lstat(tmp_path).st_dev, all_read=True)
    walked[0] = 1 << 40  # the walk has passed a terabyte of files since
    jumped.set()
    ra._walker._thread.join(30)
    assert not ra._walker._thread.is_alive()
    ra.close()
    assert ra.advised == 0
    assert len(looked) <= 6, looked  # big.bin, pipe, pkg0, pkg0/sub, its first file: then it stopped


def test_the_stat_ahead_looks_at_every_entry_the_walk_will_but_not_below_a_skipped_directory(tmp_path, monkeypatch):
    """A no-change snapshot's stat-ahead lstat()s each entry of the tree once (so the walk finds its metadata
    in memory), and nothing below a directory the walk does not enter."""
    from ogrefs.snapshot import readahead

    _tree(tmp_path)
    (tmp_path / "skipme" / "deep").mkdir()
    (tmp_path / "skipme" / "deep" / "x").write_bytes(b"x")
    looked: list[bytes] = []
    lock = threading.Lock()
    real_lstat = os.lstat

    def counting_lstat(p):
        if isinstance(p, bytes):  # (the stat-ahead's; the test's own are str and paths)
            with lock:
                looked.append(p)
        return real_lstat(p)

    monkeypatch.setattr(readahead.os, "lstat", counting_lstat)
    ra = ReadAhead(lambda: 0, lambda p: p.endswith(b"/skipme"))
    ra.stat_tree(os.fsencode(tmp_path), os.lstat(tmp_path).st_dev)
    assert ra._stat[0].done.wait(30)
    ra.close()
    want = {os.fsencode(os.path.join(d, n)) for d, dirs, files in os.walk(tmp_path)
            if not (d + "/").startswith(str(tmp_path / "skipme") + "/") for n in dirs + files}
    assert sorted(looked) == sorted(want)  # each once; skipme itself, not what is below it
    assert os.fsencode(tmp_path / "skipme") in looked


def test_the_stat_ahead_stays_within_its_lead_of_the_walk(tmp_path, monkeypatch):
    """With the walk standing still, the stat-ahead stops after its lead (it would otherwise run through a
    box of millions of entries for a walk that is still at the start), and close() ends it at once."""
    from ogrefs.snapshot import readahead

    _tree(tmp_path)  # 5 x (pkg, sub, 20 files) + big.bin, pipe, secret.txt ...
    monkeypatch.setattr(readahead, "AHEAD_ENTRIES", 3)
    ra = ReadAhead(lambda: 0, lambda p: False, entries=lambda: 0)
    ra.stat_tree(os.fsencode(tmp_path), os.lstat(tmp_path).st_dev)
    ahead = ra._stat[0]
    deadline = threading.Event()
    while ahead.seen <= 3 and not deadline.wait(0.01):
        pass  # (the top directory's task: its entries count once it has looked at them all)
    deadline.wait(0.3)  # time for the tasks it submitted to run, if they did not wait
    seen = ahead.seen
    ra.close()
    # the top directory, and the directories it listed (each lists 1 entry) but no sub/ with its 20 files
    assert 3 < seen < 20, seen
