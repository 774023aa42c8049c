"""Retention, locks, two-phase prune, and many writers at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from ogrefs.repo.catalog import Catalog
from ogrefs.maint.check import check_repository
from ogrefs.maint.forget import Policy, apply_policy
from ogrefs.maint.prune import prune
from ogrefs.repo import Repository
from ogrefs.repo.locks import HeldLock, LockedError, LockInfo, _encode, read_locks, remove_stale_locks
from ogrefs.restore import Restorer
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot

from tests.treegen import compare_trees

MiB = 1024 * 1024


def _m(i: int, time_: str, tags=(), host="h", paths=("/p",)) -> dict:
    return {"id": f"{i:064x}", "time": time_, "tags": list(tags), "host": host, "paths": list(paths)}


def test_policy_last_daily_tags_grouped_by_host_and_paths():
    ms = [
        _m(1, "2026-11-01T10:00:00+00:00"), _m(2, "2026-11-01T12:00:00+00:00"),
        _m(3, "2026-11-02T09:00:00+00:00"), _m(4, "2026-11-03T09:00:00+00:00", tags=["release"]),
        _m(5, "2026-11-04T09:00:00+00:00"), _m(6, "2026-11-04T10:00:00+00:00", host="other"),
    ]
    kept, removed = apply_policy(ms, Policy(keep_last=1, keep_daily=2, keep_tags=["release"]))
    kept_ids = {m["id"][-1] for m, _ in kept}
    # group h: last=5, daily=5 (11-04) and 4 (11-03), tag keeps 4; group other: its only one is last
    assert kept_ids == {"5", "4", "6"}
    assert {m["id"][-1] for m in removed} == {"1", "2", "3"}
    reasons = {m["id"][-1]: r for m, r in kept}
    assert "tag release" in reasons["4"] and "last" in reasons["5"]
    assert apply_policy(ms, Policy())[1] == []  # no policy removes nothing


def _snap(repo, path, **kw):
    return take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(path)], no_parent=True, **kw))


def _restore_ok(repo, manifest, src, out):
    r = Restorer(Catalog(repo.catalog_path(manifest["id"])), repo.read_pack_range, os.fsencode(out))
    r.run()
    assert not r.failed
    assert compare_trees(src, out / str(src).lstrip("/")) == []


@pytest.fixture
def repo(store_url, tmp_path) -> Repository:
    return Repository.init(store_url, cache_root=tmp_path / "cache", pack_target_size=1 * MiB)


def _packs(repo) -> set[str]:
    return {k.rsplit("/", 1)[1] for k in repo.store.list("packs/")}


def test_prune_is_two_phase_and_keeps_what_is_referenced(repo, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "only-a").write_bytes(os.urandom(3 * MiB))
    (b / "only-b").write_bytes(os.urandom(3 * MiB))
    ma = _snap(repo, a)
    mb = _snap(repo, b)
    a_packs = set(Catalog(repo.catalog_path(ma["id"])).pack_names())
    repo.store.delete(f"snapshots/{ma['id']}")
    repo.store.delete(f"catalogs/{ma['id']}")
    writer = HeldLock(repo.store, "shared", "snapshot").acquire()  # a snapshot running on another box
    try:
        dry = prune(repo, dry_run=True)
        assert set(dry.newly_marked) == a_packs and not dry.deleted
        assert _packs(repo) >= a_packs  # dry run deletes nothing
        first = prune(repo)
        assert set(first.newly_marked) == a_packs and first.deleted == []
        assert _packs(repo) >= a_packs  # marked, not yet deleted: the snapshot may have seen them unmarked
    finally:
        writer.release()
    second = prune(repo)
    assert set(second.deleted) == a_packs and second.freed_bytes >= 3 * MiB
    assert not (_packs(repo) & a_packs)
    _restore_ok(repo, mb, b, tmp_path / "out")
    assert check_repository(repo, read_data=True).problems == []


def test_live_lock_older_than_marking_defers_deletion(repo, tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "f").write_bytes(os.urandom(2 * MiB))
    ma = _snap(repo, a)
    mount_lock = HeldLock(repo.store, "shared", "mount").acquire()  # e.g. a mount of this snapshot
    try:
        time.sleep(0.01)
        repo.store.delete(f"snapshots/{ma['id']}")
        repo.store.delete(f"catalogs/{ma['id']}")
        prune(repo)
        deferred = prune(repo)
        assert deferred.deleted == [] and deferred.deferred
        assert _packs(repo)  # the mount can still read them
    finally:
        mount_lock.release()
    assert prune(repo).deleted
    assert _packs(repo) == set()


def test_new_snapshot_never_references_marked_packs(repo, tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "f").write_bytes(os.urandom(2 * MiB))
    ma = _snap(repo, a)
    repo.store.delete(f"snapshots/{ma['id']}")
    repo.store.delete(f"catalogs/{ma['id']}")
    with HeldLock(repo.store, "shared", "snapshot"):  # some writer alive: the packs are only marked
        marked = set(prune(repo).newly_marked)
    assert marked
    again = _snap(repo, a)  # same content: must upload it again rather than point at trash
    assert not (set(Catalog(repo.catalog_path(again["id"])).pack_names()) & marked)
    assert again["totals"]["new_chunks"] >= 1
    prune(repo)
    _restore_ok(repo, again, a, tmp_path / "out")
    assert check_repository(repo, read_data=True).problems == []


def test_second_prune_refuses_and_stale_locks_are_ignored_and_removed(repo):
    with HeldLock(repo.store, "prune", "prune"):
        with pytest.raises(LockedError):
            prune(repo)
    dead = LockInfo("d" * 32, "prune", "prune", "gone-box", 1, time.time() - 7200, time.time() - 7200)
    repo.store.put(f"locks/{dead.id}", _encode(dead))
    prune(repo)  # a stale prune lock does not block
    assert [lk.id for lk in remove_stale_locks(repo.store)] == [dead.id]
    assert read_locks(repo.store) == []


def test_concurrent_snapshots_from_many_boxes(store_url, tmp_path):
    """Four processes snapshot into one repository at once; every snapshot survives and restores."""
    Repository.init(store_url, cache_root=tmp_path / "c0", pack_target_size=1 * MiB)
    shared = os.urandom(2 * MiB)
    srcs = []
    for i in range(4):
        s = tmp_path / f"box{i}"
        s.mkdir()
        (s / "shared.bin").write_bytes(shared)  # dedup races between writers
        (s / "own.bin").write_bytes(os.urandom(2 * MiB))
        srcs.append(s)

    def one(i: int) -> dict:
        env = dict(os.environ, OGREFS_REPO=store_url, OGREFS_CACHE_DIR=str(tmp_path / f"cache{i}"))
        proc = subprocess.run([sys.executable, "-m", "ogrefs", "snapshot", "--json", "--host", f"box{i}",
                               str(srcs[i])], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    with ThreadPoolExecutor(4) as pool:
        manifests = list(pool.map(one, range(4)))
    repo = Repository.open(store_url, cache_root=tmp_path / "reader")
    assert sorted(repo.snapshot_ids()) == sorted(m["id"] for m in manifests)
    assert check_repository(repo, read_data=True).problems == []
    for i, m in enumerate(manifests):
        _restore_ok(repo, m, srcs[i], tmp_path / f"out{i}")


@pytest.mark.fuse
@pytest.mark.skipif(not os.path.exists("/dev/fuse") and not os.environ.get("CI"), reason="no /dev/fuse here")
def test_prune_never_deletes_what_a_live_mount_reads(tmp_path):
    """A mount of a snapshot that is forgotten meanwhile keeps reading: its lock defers the deletion."""
    from tests.mounter import Mounter

    repo = Repository.init(str(tmp_path / "repo"), cache_root=tmp_path / "cache", pack_target_size=1 * MiB)
    src = tmp_path / "src"
    src.mkdir()
    payload = os.urandom(3 * MiB)
    (src / "model.bin").write_bytes(payload)
    m = _snap(repo, src)
    mounter = Mounter(tmp_path, repo.store.url)
    mp = mounter.mount(m["id"], tmp_path / "mnt")
    try:
        repo.store.delete(f"snapshots/{m['id']}")
        repo.store.delete(f"catalogs/{m['id']}")
        prune(repo)
        second = prune(repo)
        assert second.deleted == [] and second.deferred
        assert (mp / str(src).lstrip("/") / "model.bin").read_bytes() == payload  # nothing was in the cache yet
    finally:
        mounter.cli("unmount", str(mp))
    assert prune(repo).deleted
    assert _packs(repo) == set()


def test_mostly_unused_packs_are_repacked_and_stale_catalog_caches_refresh(store_url, tmp_path):
    """After forget, a pack mostly holding forgotten data is repacked; other boxes' cached catalogs follow."""
    repo = Repository.init(store_url, cache_root=tmp_path / "cache", pack_target_size=32 * MiB)
    src = tmp_path / "src"
    src.mkdir()
    (src / "keep.bin").write_bytes(os.urandom(1 * MiB))
    (src / "gone.bin").write_bytes(os.urandom(5 * MiB))
    a = _snap(repo, src)
    (src / "gone.bin").unlink()
    b = _snap(repo, src)  # keep.bin is deduplicated into a's single pack
    other_box = Repository.open(store_url, cache_root=tmp_path / "other")
    Catalog(other_box.catalog_path(b["id"]))  # that box has b's catalog cached, with the old locations
    (old_pack,) = Catalog(repo.catalog_path(b["id"])).pack_names()
    repo.store.delete(f"snapshots/{a['id']}")
    repo.store.delete(f"catalogs/{a['id']}")
    dry = prune(repo, dry_run=True)
    assert dry.repack == [old_pack] and old_pack in _packs(repo)
    first = prune(repo)
    # no lock is alive: the old pack goes in the same run (a repository never grows from a prune)
    assert first.repack == [old_pack] and first.deleted == [old_pack] and not first.newly_marked
    new_packs = set(Catalog(repo.catalog_path(b["id"])).pack_names())
    assert old_pack not in new_packs and new_packs <= _packs(repo)
    # the other box notices the rewritten catalog and restores from the new pack
    _restore_ok(other_box, b, src, tmp_path / "out")
    assert check_repository(repo, read_data=True).problems == []
    assert _packs(repo) == new_packs  # only the repacked data is left


def test_prune_removes_what_a_killed_put_left_in_a_file_repository(tmp_path):
    """A put killed between its write and its rename leaves a .tmp- file listings never show; prune removes
    it once it is an hour old, through the real entry point, says so, and keeps every object."""
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("OGREFS_S3_ENDPOINT", None)
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(os.urandom(100_000))

    def og(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ogrefs", *args], env=env, capture_output=True, text=True,
                              timeout=120, check=True)

    og("init")
    og("snapshot", "-q", str(src))
    leftovers = [tmp_path / "repo" / "packs" / ".tmp-0123456789abcdef", tmp_path / "repo" / ".tmp-fedcba9876543210"]
    for path in leftovers:
        path.write_bytes(b"half of a pack")
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    young = tmp_path / "repo" / "index" / ".tmp-0000111122223333"
    young.write_bytes(b"a put in progress")
    dry = json.loads(og("prune", "--dry-run", "--json").stdout)
    assert (dry["stale_temporaries"], dry["stale_temporary_bytes"]) == (2, 28) and all(p.exists() for p in leftovers)
    out = og("prune").stdout
    assert "removed 2 temporary files (28 B) that interrupted writes left over an hour ago" in out, out
    assert not any(p.exists() for p in leftovers) and young.exists()
    og("check", "--read-data")
    og("restore", "latest", str(tmp_path / "out"))
    assert (tmp_path / "out" / str(src).lstrip("/") / "f").read_bytes() == (src / "f").read_bytes()
