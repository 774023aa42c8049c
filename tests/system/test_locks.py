"""Locks that clean themselves up, and a prune that frees what no live holder can read (issue 16).

Real processes throughout: a snapshot killed by SIGTERM, a writable mount finalized in a private
mount namespace, read-only mounts of one snapshot while another is forgotten and pruned.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ogrefs.repo.catalog import Catalog
from ogrefs.maint.prune import prune
from ogrefs.repo import Repository
from ogrefs.repo.locks import HeldLock, LockInfo, _encode, read_locks, remove_stale_locks
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot

from tests.cli_run import run
from tests.treegen import make_fidelity_tree

MiB = 1024 * 1024
OGREFS = f"{sys.executable} -m ogrefs"

fuse = [pytest.mark.fuse,
        pytest.mark.skipif(not os.path.exists("/dev/fuse") and not os.environ.get("CI"), reason="no /dev/fuse here")]


def _snap(repo: Repository, path: Path) -> dict:
    return take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(path)], no_parent=True))


def _packs(repo: Repository) -> set[str]:
    return {k.rsplit("/", 1)[1] for k in repo.store.list("packs/")}


def _size(repo_dir: Path) -> int:
    return sum(f.stat().st_size for f in repo_dir.rglob("*") if f.is_file())


def test_lock_of_a_dead_process_on_this_host_is_stale_at_once(tmp_path):
    """restic's rule: same host, same boot, pid gone (or reused by a newer process): stale, whatever the heartbeat."""
    repo = Repository.init(str(tmp_path / "repo"), cache_root=tmp_path / "cache")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = HeldLock(repo.store, "shared", "snapshot")
        info = LockInfo(**{**lock.info.__dict__, "pid": child.pid,
                           "pid_start": int(open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[19])})
        repo.store.put(f"locks/{info.id}", _encode(info))
        assert not read_locks(repo.store)[0].stale()  # its process is alive
    finally:
        child.kill()
        child.wait(timeout=10)
    assert read_locks(repo.store)[0].stale()
    reused = LockInfo(**{**info.__dict__, "id": "e" * 32, "pid": os.getpid()})  # our pid, another start time
    repo.store.put(f"locks/{reused.id}", _encode(reused))
    other_host = LockInfo(**{**info.__dict__, "id": "f" * 32, "host": "another-box"})
    repo.store.put(f"locks/{other_host.id}", _encode(other_host))
    assert {lk.id for lk in remove_stale_locks(repo.store)} == {info.id, reused.id}
    assert [lk.id for lk in read_locks(repo.store)] == [other_host.id]  # another box's pid means nothing here


def test_process_killed_by_sigterm_leaves_a_lock_that_unlock_removes(tmp_path):
    """A snapshot killed by SIGTERM dies holding its lock: `unlock` removes it at once (same host, pid dead)."""
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"))
    run(["init"], env)
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from ogrefs.repo import Repository
repo = Repository.open({str(tmp_path / "repo")!r}, cache_root=__import__("pathlib").Path({str(tmp_path / "c2")!r}))
repo.lock("shared", "snapshot").acquire()
print("locked", flush=True)
time.sleep(120)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        held = read_locks(Repository.open(str(tmp_path / "repo"), cache_root=tmp_path / "c3").store)
        assert len(held) == 1 and not held[0].stale()
        assert json.loads(run(["unlock", "--json"], env).stdout)["removed"] == []  # a live holder keeps it
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.communicate(timeout=30)
    assert len(list((tmp_path / "repo" / "locks").glob("*"))) == 1  # SIGTERM ran no cleanup
    out = json.loads(run(["unlock", "--json"], env).stdout)
    assert len(out["removed"]) == 1 and out["removed"][0]["purpose"] == "snapshot"
    assert not list((tmp_path / "repo" / "locks").glob("*"))


@pytest.mark.parametrize("marker", fuse)
def test_prune_frees_what_a_mount_of_another_snapshot_cannot_read(tmp_path, marker):
    """A live mount protects only the packs of the snapshot it serves (its lock names it)."""
    from tests.mounter import Mounter

    repo = Repository.init(str(tmp_path / "repo"), cache_root=tmp_path / "cache", pack_target_size=1 * MiB)
    keep, gone = tmp_path / "keep", tmp_path / "gone"
    keep.mkdir()
    gone.mkdir()
    payload = os.urandom(2 * MiB)
    (keep / "model.bin").write_bytes(payload)
    (gone / "old.bin").write_bytes(os.urandom(3 * MiB))
    mk, mg = _snap(repo, keep), _snap(repo, gone)
    gone_packs = set(Catalog(repo.catalog_path(mg["id"])).pack_names())
    mounter = Mounter(tmp_path, repo.store.url)
    try:
        mp = mounter.mount(mk["id"], tmp_path / "mnt")
        (lock,) = [lk for lk in read_locks(repo.store) if lk.purpose == "mount"]
        assert lock.snapshot == mk["id"]
        repo.store.delete(f"snapshots/{mg['id']}")
        repo.store.delete(f"catalogs/{mg['id']}")
        report = prune(repo)
        assert set(report.deleted) == gone_packs and not report.deferred
        assert not (_packs(repo) & gone_packs)
        assert (mp / str(keep).lstrip("/") / "model.bin").read_bytes() == payload
    finally:
        mounter.cleanup()


def test_forget_prune_does_not_make_the_repository_grow(tmp_path):
    """forget --prune repacks mostly-unused packs: with no lock alive, the old packs go in the same run."""
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"))
    run(["init", "--pack-size", "8"], env)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):  # one 8 MiB pack
        (src / f"big{i}").write_bytes(os.urandom(2 * MiB))
    run(["-q", "snapshot", str(src)], env)
    for i in range(3):  # the pack is a quarter used: repacked
        (src / f"big{i}").unlink()
    run(["-q", "snapshot", str(src)], env)
    before = _size(tmp_path / "repo")
    text = run(["forget", "--keep-last", "1", "--prune", "--json"], env).stdout
    _forgotten, end = json.JSONDecoder().raw_decode(text)
    out = json.loads(text[end:])
    after = _size(tmp_path / "repo")
    assert out["repacked"] >= 1 and out["deleted"] >= 1
    assert after < before - 5 * MiB, (before, after)
    run(["restore", "latest", str(tmp_path / "out")], env)
    assert (tmp_path / "out" / str(src).lstrip("/") / "big3").read_bytes() == (src / "big3").read_bytes()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing")
@pytest.mark.parametrize("marker", fuse)
@pytest.mark.timeout(180)
def test_finalize_releases_the_mounts_lock(tmp_path, marker):
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"),
               OGREFS_STATE_DIR=str(tmp_path / "state"), OGREFS_RUNTIME_DIR=str(tmp_path / "run"))
    proj = tmp_path / "box" / "proj"
    make_fidelity_tree(proj)
    run(["-q", "init"], env)
    snap = json.loads(run(["-q", "snapshot", "--json", str(proj)], env).stdout)["id"]
    script = f"""set -euo pipefail
        mount -t tmpfs fresh-box {proj.parent}
        {OGREFS} mount {snap} /
        ls {tmp_path}/repo/locks | wc -l > {tmp_path}/locks-mounted
        timeout 60 {OGREFS} status / --wait > /dev/null
        {OGREFS} finalize /
        ls {tmp_path}/repo/locks | wc -l > {tmp_path}/locks-finalized
        {OGREFS} unmount /
    """
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", script], env=env,
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "locks-mounted").read_text().strip() == "1"
    assert (tmp_path / "locks-finalized").read_text().strip() == "0"
    assert not list((tmp_path / "repo" / "locks").glob("*"))
