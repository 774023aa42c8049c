"""Snapshot and eager restore, over the file and S3 backends (tier 3: repository + tree)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ogrefs.repo.catalog import Catalog
from ogrefs.errors import SnapshotNotFound
from ogrefs.repo import Repository
from ogrefs.store import FaultyStore, open_store
from ogrefs.restore import Restorer
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot

from tests.treegen import compare_trees, make_fidelity_tree

MiB = 1024 * 1024


def _snap(repo: Repository, *paths: Path, **kw) -> dict:
    return take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(p) for p in paths], **kw))


def _restore(repo: Repository, manifest: dict, target: Path, **kw) -> Restorer:
    r = Restorer(Catalog(repo.catalog_path(manifest["id"])), repo.read_pack_range, os.fsencode(target), **kw)
    r.run()
    return r


@pytest.fixture
def repo(store_url, tmp_path) -> Repository:
    return Repository.init(store_url, cache_root=tmp_path / "cache", pack_target_size=4 * MiB)


def test_fidelity_roundtrip(repo, tmp_path):
    src = tmp_path / "src"
    make_fidelity_tree(src)
    m = _snap(repo, src)
    out = tmp_path / "out"
    r = _restore(repo, m, out)
    assert not r.failed
    assert compare_trees(src, out / str(src).lstrip("/")) == []
    assert m["totals"]["files"] >= 15
    assert m["unreadable"] == []


@pytest.mark.slow
def test_big_sparse_and_over_4g(store_url, tmp_path):
    repo = Repository.init(store_url, cache_root=tmp_path / "cache")
    src = tmp_path / "big"
    make_fidelity_tree(src, big=True)
    m = _snap(repo, src)
    # holes are not stored: 5 GiB + 4 GiB apparent, a few MiB of data
    assert m["totals"]["read_bytes"] < 64 * MiB
    out = tmp_path / "out"
    _restore(repo, m, out)
    restored = out / str(src).lstrip("/")
    assert compare_trees(src, restored) == []
    st = os.stat(restored / "sparse-5g")
    assert st.st_size == 5 * 1024**3 and st.st_blocks * 512 < 16 * MiB


def test_dedup_and_incremental(repo, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    payload = os.urandom(6 * MiB)
    (src / "a.bin").write_bytes(payload)
    (src / "b.bin").write_bytes(payload)  # same content: stored once
    m1 = _snap(repo, src)
    assert m1["totals"]["new_raw_bytes"] <= 6 * MiB + 1
    # nothing changed: nothing read, nothing new
    m2 = _snap(repo, src)
    assert m2["parent"] == m1["id"]
    assert m2["totals"]["reused_files"] == 2 and m2["totals"]["read_bytes"] == 0
    assert m2["totals"]["new_chunks"] == 0
    # one file appended: only it is read, and only its tail is new
    with open(src / "b.bin", "ab") as fh:
        fh.write(os.urandom(MiB))
    m3 = _snap(repo, src)
    assert m3["totals"]["reused_files"] == 1
    assert m3["totals"]["read_bytes"] == 7 * MiB
    assert m3["totals"]["new_raw_bytes"] < 6 * MiB
    out = tmp_path / "out"
    _restore(repo, m3, out)
    assert compare_trees(src, out / str(src).lstrip("/")) == []


def test_dedup_across_boxes(store_url, tmp_path):
    """A second machine (own cache, own host name) skips chunks already in the repository."""
    repo_a = Repository.init(store_url, cache_root=tmp_path / "cache-a")
    src = tmp_path / "src"
    src.mkdir()
    (src / "venv.bin").write_bytes(os.urandom(8 * MiB))
    _snap(repo_a, src, host="box-a")
    repo_b = Repository.open(store_url, cache_root=tmp_path / "cache-b")
    m = _snap(repo_b, src, host="box-b")
    assert m["parent"] is None
    assert m["totals"]["read_bytes"] == 8 * MiB and m["totals"]["new_chunks"] == 0


def test_include_restores_subset(repo, tmp_path):
    src = tmp_path / "src"
    make_fidelity_tree(src)
    m = _snap(repo, src)
    out = tmp_path / "out"
    _restore(repo, m, out, includes=[os.fsencode(src / "dir")])
    base = out / str(src).lstrip("/")
    assert (base / "dir" / "nested" / "deeper" / "leaf.py").read_text() == "print('leaf')\n"
    assert not (base / "random.bin").exists()


def test_multiple_roots_and_ancestors(repo, tmp_path):
    a = tmp_path / "x" / "a"
    b = tmp_path / "x" / "b"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    (a / "f").write_text("a")
    (b / "g").write_text("b")
    (tmp_path / "x" / "not-included").write_text("no")
    m = _snap(repo, a, b)
    assert sorted(m["paths"]) == sorted([str(a), str(b)])
    out = tmp_path / "out"
    _restore(repo, m, out)
    base = out / str(tmp_path / "x").lstrip("/")
    assert (base / "a" / "f").read_text() == "a" and (base / "b" / "g").read_text() == "b"
    assert not (base / "not-included").exists()


def test_corrupt_pack_fails_restore_naming_file(repo, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "victim.bin").write_bytes(os.urandom(2 * MiB))
    m = _snap(repo, src)
    cat = Catalog(repo.catalog_path(m["id"]))
    ext = cat.extents(cat.resolve(os.fsencode(src / "victim.bin")).ino)[0]
    key = f"packs/{ext.pack[:2]}/{ext.pack}"
    body = bytearray(repo.store.get(key))
    body[ext.pack_offset + 100] ^= 0xFF
    repo.store.put(key, bytes(body))
    out = tmp_path / "out"
    r = _restore(repo, m, out)
    restored = os.fsencode(out / str(src).lstrip("/") / "victim.bin")
    assert restored in r.failed and "BLAKE3" in r.failed[restored]
    assert not os.path.exists(restored)  # no wrong bytes left behind


def test_changed_during_snapshot_is_flagged(repo, tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    f = src / "growing.log"
    f.write_bytes(os.urandom(MiB))
    import ogrefs.snapshot.packer as packer

    real = packer.data_extents

    def touching(fd, size):
        with open(f, "ab") as fh:  # the file changes while we read it, every time
            fh.write(b"more")
        return real(fd, size)

    monkeypatch.setattr(packer, "data_extents", touching)
    m = _snap(repo, src)
    assert m["changed_during_snapshot"] == [str(f)]


def test_unreadable_file_continues(repo, tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok").write_text("fine")
    (src / "bad").write_text("secret")
    import ogrefs.snapshot.pipeline as snapmod

    real_open = os.open

    def failing_open(path, flags, *a, **kw):
        if os.fsencode(path).endswith(b"/bad"):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(snapmod.os, "open", failing_open)
    m = _snap(repo, src)
    assert [u["path"] for u in m["unreadable"]] == [str(src / "bad")]
    out = tmp_path / "out"
    monkeypatch.undo()
    _restore(repo, m, out)
    assert (out / str(src).lstrip("/") / "ok").read_text() == "fine"


def test_resolve_names(repo, tmp_path):
    src = tmp_path / "s"
    src.mkdir()
    (src / "f").write_text("1")
    m1 = _snap(repo, src)
    (src / "f").write_text("22")
    m2 = _snap(repo, src)
    assert repo.resolve("latest")["id"] == m2["id"]
    assert repo.resolve(m1["id"][:10])["id"] == m1["id"]
    with pytest.raises(SnapshotNotFound):
        repo.resolve("0" * 64)
    with pytest.raises(SnapshotNotFound):
        repo.resolve("not-hex")


def test_interrupted_snapshot_leaves_valid_repo_and_rerun_reuses_packs(tmp_path):
    """SIGKILL in the middle of a snapshot: no snapshot appears; the rerun uploads only what is missing."""
    repo_dir = tmp_path / "repo"
    Repository.init(str(repo_dir), cache_root=tmp_path / "cache", pack_target_size=1 * MiB)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"f{i:02d}").write_bytes(os.urandom(MiB))
    env = dict(os.environ, OGREFS_REPO=str(repo_dir), OGREFS_CACHE_DIR=str(tmp_path / "cache"))
    # slow the uploads so the kill lands mid-way
    code = (
        "import time, ogrefs.store.file as f\n"
        "orig = f.FileStore.put\n"
        "def slow(self, key, data):\n"
        "    orig(self, key, data)\n"
        "    if key.startswith('packs/'): time.sleep(0.15)\n"
        "f.FileStore.put = slow\n"
        "from ogrefs.cli.app import main\n"
        f"main(['-q', 'snapshot', {str(src)!r}])\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    deadline = time.time() + 60
    while time.time() < deadline and len([p for p in (repo_dir / "packs").rglob("*")
                                          if p.is_file() and not p.name.startswith(".tmp-")]) < 8:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    repo = Repository.open(str(repo_dir), cache_root=tmp_path / "cache")
    assert repo.snapshot_ids() == []
    packs_before = {p.name for p in (repo_dir / "packs").rglob("*") if p.is_file() and not p.name.startswith(".tmp-")}
    assert packs_before
    m = _snap(repo, src)
    # every pack that made it into the store is reused, including those whose
    # index object the kill prevented (they are recovered from pack trailers)
    assert m["totals"]["new_raw_bytes"] <= 40 * MiB - (len(packs_before) - 1) * MiB
    from ogrefs.maint.check import check_repository

    assert check_repository(repo, read_data=True).problems == []


def test_store_unreachable_is_clean_error(tmp_path, seaweed):
    repo = Repository.init(f"s3://{seaweed.new_bucket()}/r", s3_endpoint=seaweed.endpoint,
                           cache_root=tmp_path / "c")
    assert repo.config.id
    with pytest.raises(Exception) as info:
        Repository.open("s3://no-such-bucket-ogrefs/x", s3_endpoint="http://127.0.0.1:9", cache_root=tmp_path / "c")
    assert "127.0.0.1:9" in str(info.value) or "connect" in str(info.value).lower()



def test_check_reports_a_missing_pack_once(repo, tmp_path):
    from ogrefs.maint.check import check_repository

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(2 * MiB))
    m = _snap(repo, src)
    (pack,) = Catalog(repo.catalog_path(m["id"])).pack_names()
    repo.store.delete(f"packs/{pack[:2]}/{pack}")
    for read_data in (False, True):
        problems = check_repository(repo, read_data=read_data).problems
        assert len([p for p in problems if pack[:16] in p]) == 1, problems


def test_the_environment_probe_reads_while_the_last_packs_upload(tmp_path):
    """At a preemption notice the probe's reads (through a lazy mount, NVML, git) must not wait for the upload
    tail: here every pack's upload waits until the probe has started, so a probe run after the uploads fails."""
    url = str(tmp_path / "repo")
    Repository.init(url, cache_root=tmp_path / "cache", pack_target_size=4 * MiB)
    probe_started = threading.Event()

    class PacksWaitForTheProbe(FaultyStore):
        def put(self, key: str, data: bytes) -> None:
            if key.startswith("packs/") and not probe_started.wait(20):
                raise RuntimeError("the pack upload waited 20 s: the probe did not run beside it")
            super().put(key, data)

    class Probe:
        def observe_dir(self, path: bytes, names: list) -> None:
            pass

        def finish(self) -> dict:
            probe_started.set()
            return {"notes": ["probed"], "hints": {}}

    repo = Repository.open(url, cache_root=tmp_path / "cache", store=PacksWaitForTheProbe(open_store(url)))
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.bin").write_bytes(os.urandom(2 * MiB))  # one pack, sealed and uploaded at the walk's end
    m = _snap(repo, src, observers=[Probe()])
    assert m["environment"]["notes"] == ["probed"] and m["totals"]["packs"] == 1
    _restore(repo, m, tmp_path / "out")
    assert (tmp_path / "out" / str(src).lstrip("/") / "data.bin").read_bytes() == (src / "data.bin").read_bytes()
