"""The index sync beside the walk's start (snapshot/indexsync.py): the walk does not wait for it, every
lookup does, and its failure fails the snapshot with the lock released."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from ogrefs.repo import Repository
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot
from ogrefs.store import open_store
from ogrefs.store.base import StoreError

from tests.storegets import GetsUnder

MiB = 1024 * 1024


class Walked:
    """An observer that notes the walk's first directory."""

    def __init__(self) -> None:
        self.started = threading.Event()

    def observe_dir(self, path: bytes, names: list) -> None:
        self.started.set()

    def finish(self) -> dict:
        return {"notes": []}


def IndexGets(inner, before) -> GetsUnder:
    """GETs of index objects first call ``before()``."""
    return GetsUnder(inner, "index/", lambda key: before())


@pytest.fixture
def stored(tmp_path) -> tuple[str, Path]:
    """A file repository holding one snapshot of 6 MiB of random data (its index object: the run's)."""
    url = str(tmp_path / "repo")
    repo = Repository.init(url, cache_root=tmp_path / "cache-a", pack_target_size=2 * MiB)
    data = tmp_path / "a"
    data.mkdir()
    (data / "blob").write_bytes(os.urandom(6 * MiB))
    take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(data)]))
    return url, data


def _fresh_box(tmp_path: Path, url: str, store, name: str) -> Repository:
    """The repository as a box that has never synced its index sees it."""
    return Repository.open(url, cache_root=tmp_path / f"cache-{name}", store=store)


def test_the_walk_starts_before_the_index_is_synced(tmp_path, stored):
    url, _ = stored
    walked = Walked()

    def wait_for_the_walk() -> None:
        if not walked.started.wait(20):
            raise StoreError("the index GET waited 20 s: the walk did not start before the sync ended")

    store = IndexGets(open_store(url), wait_for_the_walk)
    src = tmp_path / "b"
    src.mkdir()
    (src / "other").write_bytes(os.urandom(MiB))
    m = take_snapshot(_fresh_box(tmp_path, url, store, "b"), SnapshotOptions(paths=[os.fsencode(src)],
                                                                          observers=[walked]))
    assert store.gets >= 1 and m["totals"]["new_chunks"] >= 1


def test_every_lookup_waits_for_the_sync(tmp_path, stored):
    """The same bytes under another path (no parent to reuse): with the sync slowed, a lookup that did not
    wait would store every chunk again."""
    url, data = stored
    store = IndexGets(open_store(url), lambda: time.sleep(1.0))
    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    m = take_snapshot(_fresh_box(tmp_path, url, store, "c"), SnapshotOptions(paths=[os.fsencode(copy)]))
    assert store.gets >= 1
    assert m["totals"]["chunks"] >= 3 and m["totals"]["new_chunks"] == 0 and m["totals"]["packs"] == 0


def test_a_failed_sync_fails_the_snapshot_and_releases_the_lock(tmp_path, stored):
    url, _ = stored

    def down() -> None:
        raise StoreError("index object unreachable (injected)")

    store = IndexGets(open_store(url), down)
    repo = _fresh_box(tmp_path, url, store, "d")
    before = set(store.list("snapshots/"))
    src = tmp_path / "d"
    src.mkdir()
    (src / "f").write_bytes(b"x" * 1000)  # reused nothing, asks the index nothing it could not answer alone
    with pytest.raises(StoreError, match="injected"):
        take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)]))
    assert set(store.list("snapshots/")) == before
    assert list(store.list("locks/")) == []


def test_a_fresh_box_fetches_the_index_objects_several_at_a_time(tmp_path, stored):
    """One index object per snapshot of every box: one after the other they cost a round trip each."""
    url, _ = stored
    repo = Repository.open(url, cache_root=tmp_path / "cache-more")
    for n in range(3):
        d = tmp_path / f"more{n}"
        d.mkdir()
        (d / "f").write_bytes(os.urandom(100_000))
        take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(d)]))
    objects = list(open_store(url).list("index/"))
    two = threading.Event()

    def wait_for_company() -> None:
        if store.in_flight >= 2:
            two.set()
        if not two.wait(10):
            raise StoreError("an index object fetched alone for 10 s: they are fetched one at a time")

    store = IndexGets(open_store(url), wait_for_company)
    fresh = _fresh_box(tmp_path, url, store, "e")
    assert fresh.index.sync() == len(objects) >= 4
    assert store.gets == len(objects) and len(fresh.index) == len(repo.index)
