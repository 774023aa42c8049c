"""The store requests of a command's start and a snapshot's commit that need no answer of each other overlap.

Behind a far link each request that waits for another costs a round trip
(docs/benchmarks.md, "A mount's start behind a far link", "A snapshot's fixed
requests behind a far link"). A store that holds one request until the ones
it should overlap with have started proves they overlap: done one after the
other, the held request waits out its timeout and the test fails, whatever
the machine's speed.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ogrefs.errors import RepositoryError
from ogrefs.lazy.trace.recorder import Recorder, save_trace
from ogrefs.mount import plan as planning
from ogrefs.mount.options import MountOptions
from ogrefs.repo import Repository
from ogrefs.repo.catalog import Catalog
from ogrefs.repo.keys import Secret
from ogrefs.repo.locks import read_locks
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot
from ogrefs.store.file import FileStore

#: How long a held request waits for its companions: far above any thread's start, and a failure, not a pass.
HOLD_S = 10.0


class Rendezvous(FileStore):
    """A file store whose ``held`` request (op, key prefix) waits until each of ``companions`` has started."""

    def __init__(self, root: str, held: tuple[str, str], companions: list[tuple[str, str]]) -> None:
        super().__init__(root)
        self.held = held
        self.started = {c: threading.Event() for c in companions}
        self.missed: list[tuple[str, str]] = []  # companions not started when the held request gave up waiting
        self.holds = 0  # held requests seen (several at once: the snapshot deletes its index objects side by side)
        self._count = threading.Lock()
        self.armed = True  # False: requests pass without waiting (what a test does before the part it checks)

    def _call(self, op: str, key: str) -> None:
        for (c_op, prefix), event in self.started.items():
            if op == c_op and key.startswith(prefix):
                event.set()
        if not self.armed:
            return
        if op in (self.held[0], "get_range" if self.held[0] == "get" else "") and key.startswith(self.held[1]):
            with self._count:
                self.holds += 1
            for c, event in self.started.items():
                if not event.wait(HOLD_S):
                    self.missed.append(c)

    def get(self, key: str) -> bytes:
        self._call("get", key)
        return super().get(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        self._call("get_range", key)
        return super().get_range(key, offset, length)

    def put(self, key: str, data: bytes) -> None:
        self._call("put", key)
        super().put(key, data)

    def list(self, prefix: str = ""):
        self._call("list", prefix)
        return super().list(prefix)

    def delete(self, key: str) -> None:
        self._call("delete", key)
        super().delete(key)


class TwoAtOnce(FileStore):
    """A file store whose deletions of ``prefix`` each wait until two of them have started."""

    def __init__(self, root: str, prefix: str) -> None:
        super().__init__(root)
        self.prefix = prefix
        self.started = 0
        self.alone = 0  # deletions that waited HOLD_S for a second one in vain
        self._cond = threading.Condition()

    def delete(self, key: str) -> None:
        if key.startswith(self.prefix):
            with self._cond:
                self.started += 1
                self._cond.notify_all()
                if not self._cond.wait_for(lambda: self.started >= 2, HOLD_S):
                    self.alone += 1
        super().delete(key)


@pytest.mark.parametrize("encrypted", [False, True])
def test_open_reads_the_key_objects_beside_the_config(tmp_path, encrypted):
    secret = Secret(b"pw", "scrypt") if encrypted else None
    Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache", secret=secret)
    store = Rendezvous(str(tmp_path / "repo"), held=("get", "config"), companions=[("list", "keys/")])
    repo = Repository.open(store.url, store=store, cache_root=tmp_path / "cache", secret=secret)
    assert store.holds == 1 and store.missed == []
    assert repo.codec.encrypted == encrypted


def test_a_plaintext_config_beside_key_objects_is_still_refused(tmp_path):
    """The keys read beside the config still decide: a plaintext config that keys contradict is refused."""
    Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    (tmp_path / "repo" / "keys").mkdir(exist_ok=True)
    (tmp_path / "repo" / "keys" / "k1").write_text("{}")
    with pytest.raises(RepositoryError, match="config says unencrypted but key objects exist"):
        Repository.open(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache2")


@pytest.mark.parametrize("held, companion", [(("put", "locks/"), ("get", "catalogs/")),
                                             (("get", "catalogs/"), ("list", "traces/"))])
def test_a_mount_narrows_its_lock_fetches_the_catalog_and_finds_the_trace_side_by_side(tmp_path, held, companion):
    src = tmp_path / "src"
    (src / "lib").mkdir(parents=True)
    (src / "lib" / "a.bin").write_bytes(os.urandom(300_000))
    (src / "b.txt").write_bytes(b"b\n")
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)]))
    cat = Catalog(repo.catalog_path(m["id"]))
    rec = Recorder(cat)
    rec.record(cat.resolve(os.fsencode(src / "lib" / "a.bin")).ino, 0)
    save_trace(repo, m["id"], rec, None)

    store = Rendezvous(str(tmp_path / "repo"), held=held, companions=[companion])
    opened = Repository.open(store.url, store=store, cache_root=tmp_path / "cache-b")  # a fresh box: no catalog
    store.armed = False  # the lock's first put does not count: only the narrowing in the plan does
    lock = opened.lock("shared", "mount").acquire()
    store.armed = True
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        plan = planning.prepare(MountOptions(repo_url=store.url, snapshot="latest", mountpoint=mnt), opened, lock,
                                mnt)
    finally:
        lock.release()
    assert store.holds == 1 and store.missed == []
    assert plan.trace_entries == [(os.fsencode(src / "lib" / "a.bin"), 0)]
    assert Path(plan.catalog_path).is_file()


def test_the_narrowed_lock_is_written_before_the_plan_returns(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x")
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)]))
    lock = repo.lock("shared", "mount").acquire()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        planning.prepare(MountOptions(repo_url=repo.store.url, snapshot="latest", mountpoint=mnt), repo, lock, mnt)
        assert [lk.snapshot for lk in read_locks(repo.store)] == [m["id"]]
    finally:
        lock.release()


def _data_tree(src: Path, mib: int) -> None:
    (src / "ckpt").mkdir(parents=True, exist_ok=True)
    (src / "ckpt" / f"step-{mib}.bin").write_bytes(os.urandom(mib * 1024 * 1024))
    (src / "train.log").write_text(f"{mib}\n")


@pytest.mark.parametrize("listing", ["packs/", "trash/"])
def test_a_snapshot_lists_packs_and_trash_beside_the_parents_search(tmp_path, listing):
    Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    _data_tree(tmp_path / "src", 1)
    store = Rendezvous(str(tmp_path / "repo"), held=("list", listing), companions=[("list", "snapshots/")])
    repo = Repository.open(store.url, store=store, cache_root=tmp_path / "cache")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(tmp_path / "src")]))
    assert store.holds == 1 and store.missed == []
    assert m["totals"]["files"] == 2


def test_a_snapshots_commit_puts_the_catalog_beside_the_index_clean_up(tmp_path):
    Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache", pack_target_size=2 * 1024 * 1024)
    _data_tree(tmp_path / "src", 7)  # several packs: several per-pack index objects to replace
    store = Rendezvous(str(tmp_path / "repo"), held=("delete", "index/"), companions=[("put", "catalogs/")])
    repo = Repository.open(store.url, store=store, cache_root=tmp_path / "cache")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(tmp_path / "src")]))
    assert store.holds == m["totals"]["packs"] >= 3 and store.missed == []
    # what the commit left: the consolidated index object only, the catalog, the manifest
    assert sorted(store.list("index/")) == [f"index/{m['id']}"]
    assert store.exists(f"catalogs/{m['id']}") and store.exists(f"snapshots/{m['id']}")


def test_a_snapshots_per_pack_index_objects_are_deleted_side_by_side(tmp_path):
    Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache", pack_target_size=2 * 1024 * 1024)
    _data_tree(tmp_path / "src", 7)
    store = TwoAtOnce(str(tmp_path / "repo"), "index/")
    repo = Repository.open(store.url, store=store, cache_root=tmp_path / "cache")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(tmp_path / "src")]))
    assert store.started == m["totals"]["packs"] >= 3 and store.alone == 0
