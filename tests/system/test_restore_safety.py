"""Restore under attack and faults: a hostile local user, failing data, conflicts, refused xattrs, signals.

Each test restores a real snapshot (file repository, or SeaweedFS where the
store's outage is the point) and checks what is on disk afterwards:

* a thread swapping just-restored directories and files for symlinks into a
  root-only directory while root restores never gets anything outside the
  target written, chowned or chmodded;
* a file whose data fails is absent under every one of its hardlinked names;
* an interrupted restore leaves no full-size wrong file and no temporary file;
* a path conflict or a refused xattr is reported for its entry, the restore
  goes on, and no directory is left owner-only.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import logging

import pytest

from ogrefs.repo.catalog import Catalog
from ogrefs.errors import OgrefsError
from ogrefs.repo import Repository
from ogrefs.restore import Interrupted, Restorer, stop_on_signals
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot
from ogrefs.store.base import TransientError

pytestmark = pytest.mark.timeout(240)
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (owners, tmpfs mounts)")
MiB = 1024 * 1024


def _snap(repo: Repository, src: Path) -> dict:
    return take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))


def _restorer(repo: Repository, m: dict, out: Path, **kw) -> Restorer:
    return Restorer(Catalog(repo.catalog_path(m["id"])), kw.pop("read_range", repo.read_pack_range),
                    os.fsencode(out), **{"workers": 4, **kw})


def _under(out: Path, src: Path) -> Path:
    return out / str(src).lstrip("/")


# -- 14.1: a local user swapping restored directories for symlinks -------------------------------------
def _attack_tree(src: Path) -> None:
    for i in range(12):
        d = src / f"d{i}" / "sub"
        d.mkdir(parents=True)
        for j in range(6):
            f = d / f"f{j}"
            f.write_bytes(bytes([i, j]) * 3000)
            os.chown(f, 4321, 4321)
            os.chmod(f, 0o666)
        for p in (d, d.parent):
            os.chown(p, 4321, 4321)
            os.chmod(p, 0o777)


def _victim_state(secret: Path) -> dict:
    out = {}
    for dirpath, dirs, files in os.walk(secret):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p)] = (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns,
                           p.read_bytes() if stat.S_ISREG(st.st_mode) else None)
    st = secret.lstat()
    out[str(secret)] = (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, None)
    return out


def _swapper(top: Path, secret: Path, stop: threading.Event, swaps: list[int]) -> None:
    """The attacker: whatever restore has made below ``top`` is renamed away and replaced by a symlink into
    ``secret`` (directories to the root-only directory, files to a root-only file), as fast as it can."""
    n = 0
    while not stop.is_set():
        for dirpath, dirs, files in os.walk(top):
            for name in dirs + [f for f in files if not f.startswith(".ogrefs")] + \
                    [f for f in files if f.startswith(".ogrefs")]:
                p = os.path.join(dirpath, name)
                dest = secret if name in dirs or name.startswith("d") or name == "sub" else secret / "f0"
                try:
                    os.rename(p, p + f".moved{n}")
                    os.symlink(dest, p)
                    n += 1
                except OSError:
                    pass
            if stop.is_set():
                break
    swaps.append(n)


@root_only
@pytest.mark.parametrize("resolve", ["openat2", "component walk"])
def test_symlink_swaps_during_a_root_restore_never_reach_outside(tmp_path, monkeypatch, resolve):
    """A local user owning the target's directories swaps each just-restored directory and file for a
    symlink into a root-only directory while root restores, over and over: nothing there is written,
    chowned or chmodded (before the fix: 3 of 3 runs wrote and chowned the victim).  Both ways of
    resolving below the target: openat2 where the kernel has it, the O_NOFOLLOW walk where it does not."""
    from ogrefs import localtree

    if resolve == "openat2" and not localtree.HAVE_OPENAT2:
        pytest.skip("this kernel has no openat2")
    monkeypatch.setattr(localtree, "HAVE_OPENAT2", resolve == "openat2")
    src = tmp_path / "src"
    _attack_tree(src)
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = _snap(repo, src)
    secret = tmp_path / "secret"
    secret.mkdir(mode=0o700)
    for j in range(6):
        (secret / f"f{j}").write_bytes(b"root only\n")
        os.chmod(secret / f"f{j}", 0o600)
    (secret / "sub").mkdir(mode=0o700)
    before = _victim_state(secret)
    total_swaps = 0
    deadline = time.monotonic() + 40  # bounded in time; every iteration is a full restore under attack
    runs = 0
    while runs < 4 or (runs < 60 and time.monotonic() < deadline):
        out = tmp_path / f"out{runs}"
        stop, swaps = threading.Event(), []
        attacker = threading.Thread(target=_swapper, args=(out, secret, stop, swaps))
        r = _restorer(repo, m, out, workers=2)
        attacker.start()
        try:
            r.run()
        except OgrefsError:
            pass
        finally:
            stop.set()
            attacker.join(30)
        total_swaps += swaps[0]
        runs += 1
        assert _victim_state(secret) == before, f"run {runs}: the root-only directory was changed"
    assert total_swaps > 50  # the attack really ran against restores in progress


# -- 14.4: every name of a file whose data fails -------------------------------------------------------
def _linked_tree(src: Path) -> None:
    (src / "a").mkdir(parents=True)
    (src / "b").mkdir()
    (src / "a" / "victim.bin").write_bytes(os.urandom(3 * MiB))
    os.link(src / "a" / "victim.bin", src / "b" / "second-name.bin")
    os.link(src / "a" / "victim.bin", src / "third-name.bin")
    (src / "fine.txt").write_bytes(b"fine\n")


def _victim_pack(repo: Repository, m: dict, src: Path) -> tuple[str, int]:
    cat = Catalog(repo.catalog_path(m["id"]))
    ino = cat.resolve(os.fsencode(src / "a" / "victim.bin")).ino
    (ext, *_) = cat.extents(ino)
    return ext.pack, ext.pack_offset + ext.stored_len // 2


def _assert_all_names_failed(r: Restorer, out: Path, src: Path, needle: str) -> None:
    names = [src / "a" / "victim.bin", src / "b" / "second-name.bin", src / "third-name.bin"]
    for name in names:
        p = _under(out, name)
        assert os.fsencode(p) in r.failed, (p, r.failed)
        assert needle in r.failed[os.fsencode(p)]
        assert not os.path.lexists(p)
    fine = _under(out, src) / "fine.txt"
    assert fine.read_bytes() == b"fine\n" if os.fsencode(fine) not in r.failed else not fine.exists()
    leftovers = [p for p in out.rglob(".ogrefs-restore-*")]
    assert leftovers == []


def test_flipped_pack_byte_fails_every_hardlinked_name(tmp_path):
    src = tmp_path / "src"
    _linked_tree(src)
    url = f"file://{tmp_path}/repo"
    repo = Repository.init(url, cache_root=tmp_path / "cache")
    m = _snap(repo, src)
    pack, at = _victim_pack(repo, m, src)
    (path,) = (tmp_path / "repo").rglob(pack)
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    r = _restorer(repo, m, tmp_path / "out")
    r.run()
    _assert_all_names_failed(r, tmp_path / "out", src, "")


def test_store_outage_for_one_pack_fails_every_hardlinked_name(tmp_path):
    src = tmp_path / "src"
    _linked_tree(src)
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = _snap(repo, src)
    pack, _ = _victim_pack(repo, m, src)

    def read_range(p: str, off: int, n: int) -> bytes:
        if p == pack:
            raise TransientError("connection refused (gave up after 6 attempts)")
        return repo.read_pack_range(p, off, n)

    r = _restorer(repo, m, tmp_path / "out", read_range=read_range)
    r.run()
    _assert_all_names_failed(r, tmp_path / "out", src, "connection refused")


@root_only
def test_full_disk_fails_every_hardlinked_name(tmp_path, small_fs):
    src = tmp_path / "src"
    _linked_tree(src)
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = _snap(repo, src)
    disk = small_fs(2 * MiB)  # the 3 MiB file cannot fit; fine.txt can
    r = _restorer(repo, m, disk / "out", check_space=False)
    r.run()
    _assert_all_names_failed(r, disk / "out", src, "No space left")


def test_swapped_encrypted_packs_fail_every_hardlinked_name(tmp_path, monkeypatch):
    from ogrefs.repo.keys import Secret

    src = tmp_path / "src"
    _linked_tree(src)
    (src / "other.bin").write_bytes(os.urandom(3 * MiB))
    url = f"file://{tmp_path}/repo"
    secret = Secret(b"pw", "scrypt")
    repo = Repository.init(url, cache_root=tmp_path / "cache", secret=secret, pack_target_size=MiB)
    m = _snap(repo, src)
    pack, _ = _victim_pack(repo, m, src)
    packs = sorted((tmp_path / "repo").rglob("packs/*/*"))
    (mine,) = [p for p in packs if p.name == pack]
    other = next(p for p in packs if p.name != pack)  # (shorter: a short read; longer: authentication fails)
    mine_bytes, other_bytes = mine.read_bytes(), other.read_bytes()
    mine.write_bytes(other_bytes)
    other.write_bytes(mine_bytes)
    repo = Repository.open(url, cache_root=tmp_path / "cache", secret=secret)
    r = _restorer(repo, m, tmp_path / "out", decode_blob=repo.codec.decode_blob)
    r.run()
    _assert_all_names_failed(r, tmp_path / "out", src, "")


# -- issue 16: temporary names, signals, free space, target errors, summary -------------------------
def _many_files(src: Path, n: int = 40) -> None:
    src.mkdir(parents=True)
    for i in range(n):
        (src / f"f{i:03}").write_bytes(os.urandom(64 * 1024 + i))


def test_a_signal_stops_the_restore_and_leaves_no_full_size_wrong_file(tmp_path, monkeypatch):
    from ogrefs import restore

    monkeypatch.setattr(restore, "MAX_RANGE", 64 * 1024)  # one range per file: many are queued when it stops
    src = tmp_path / "src"
    _many_files(src)
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache", pack_target_size=MiB)
    m = _snap(repo, src)
    calls = []
    holder: dict = {}

    def read_range(p: str, off: int, n: int) -> bytes:
        calls.append(p)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # handled on the main thread, which calls stop()
            assert holder["r"]._stop.wait(10)
        return repo.read_pack_range(p, off, n)

    r = holder["r"] = _restorer(repo, m, tmp_path / "out", read_range=read_range, workers=1)
    with pytest.raises(Interrupted) as info, stop_on_signals(r.stop):
        r.run()
    assert "interrupted" in str(info.value)
    assert len(calls) == 1  # no more downloads after the signal
    out = _under(tmp_path / "out", src)
    for p in out.iterdir():
        assert not p.name.startswith(".ogrefs-restore-"), p  # no temporary file left
        assert p.read_bytes() == (src / p.name).read_bytes()  # what is there is complete and right
    assert len(list(out.iterdir())) < 40
    assert stat.S_IMODE(out.stat().st_mode) == stat.S_IMODE(src.stat().st_mode)  # directories finished anyway


def test_stale_temporary_files_of_a_killed_restore_are_removed(tmp_path):
    src = tmp_path / "src"
    _many_files(src, 3)
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = _snap(repo, src)
    out = _under(tmp_path / "out", src)
    out.mkdir(parents=True)
    (out / ".ogrefs-restore-0123456789abcdef-99999.tmp").write_bytes(bytes(100_000))  # as a kill -9 leaves it
    os.chmod(out / ".ogrefs-restore-0123456789abcdef-99999.tmp", 0o600)
    _restorer(repo, m, tmp_path / "out").run()
    assert sorted(p.name for p in out.iterdir()) == ["f000", "f001", "f002"]


def test_progress_counts_files_done(tmp_path):
    src = tmp_path / "src"
    _many_files(src, 10)
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = _snap(repo, src)
    seen = []
    r = _restorer(repo, m, tmp_path / "out", progress=lambda s: seen.append((s.files_done, s.files)))
    r.run()
    assert seen[0][0] == 0 and seen[-1] == (10, 10)



def _forge_pack_escape(cat_path: Path, forged: Path, victim: Path, new_id: str | None = None) -> Path:
    """A copy of a catalog whose ``victim`` file's blobs name the pack ``../../etc`` (and, with
    ``new_id``, the snapshot id ``new_id``)."""
    shutil.copyfile(cat_path, forged)
    ino = Catalog(cat_path).resolve(os.fsencode(victim)).ino
    db = sqlite3.connect(forged)
    db.execute("INSERT INTO packs (id, name) VALUES (?, '../../etc')", (1 + db.execute("SELECT max(id) FROM packs").fetchone()[0],))
    assert db.execute("UPDATE blobs SET pack=(SELECT id FROM packs WHERE name='../../etc') "
                      "WHERE id IN (SELECT blob FROM extents WHERE ino=?)", (ino,)).rowcount == 1
    if new_id is not None:
        db.execute("UPDATE meta SET value=? WHERE key='snapshot_id'", (new_id,))
    db.commit()
    db.close()
    return forged

def _cli(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ogrefs", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def cli_repo(tmp_path):
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("OGREFS_S3_ENDPOINT", None)
    src = tmp_path / "src"
    _many_files(src, 20)
    assert _cli(["-q", "init"], env).returncode == 0
    snap = json.loads(_cli(["-q", "snapshot", "--json", str(src)], env).stdout)
    return env, src, snap["id"]


def _one_line(proc: subprocess.CompletedProcess, needle: str) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    return lines[0]


def test_restore_targets_that_cannot_be_used_are_one_line_errors(cli_repo, tmp_path):
    env, _src, sid = cli_repo
    afile = tmp_path / "afile"
    afile.write_bytes(b"x")
    _one_line(_cli(["restore", sid, str(afile)], env), "not a directory")
    _one_line(_cli(["restore", sid, str(afile / "below")], env), "afile")


@root_only
def test_restore_onto_a_read_only_file_system_is_a_one_line_error(cli_repo, tmp_path, small_fs):
    env, _src, sid = cli_repo
    disk = small_fs(8 * MiB)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True, timeout=30)
    _one_line(_cli(["restore", sid, str(disk)], env), "read-only file system")
    _one_line(_cli(["restore", sid, str(disk / "sub")], env), "Read-only file system")


@root_only
def test_restore_refuses_without_free_space_and_force_overrides(cli_repo, tmp_path, small_fs):
    env, _src, sid = cli_repo
    disk = small_fs(512 * 1024)  # 20 files of 64 KiB do not fit
    line = _one_line(_cli(["restore", sid, str(disk / "out")], env), "not enough free space")
    assert "needs 1.3 MiB" in line and "512.0 KiB free" in line
    assert not (disk / "out").exists() or not any((disk / "out").rglob("f*"))
    forced = _cli(["restore", "--force", sid, str(disk / "out")], env)
    assert forced.returncode == 3  # partial: what did not fit is counted and reported
    assert "No space left" in forced.stderr and "Traceback" not in forced.stderr
    assert "problems" in forced.stdout


def test_restore_summary_counts_failures_and_exits_partial(cli_repo, tmp_path):
    env, src, sid = cli_repo
    packs = sorted((tmp_path / "repo").rglob("packs/*/*"))
    data = bytearray(packs[0].read_bytes())
    data[100] ^= 1
    packs[0].write_bytes(bytes(data))
    proc = _cli(["restore", sid, str(tmp_path / "out")], env)
    assert proc.returncode == 3, proc.stderr
    n_failed = sum(1 for line in proc.stderr.splitlines() if line.startswith("error:"))
    assert n_failed >= 1 and "Traceback" not in proc.stderr
    assert f"{n_failed} problems" in proc.stdout
    restored = int(proc.stdout.split("restored ")[1].split(" of ")[0])
    assert restored == 20 - n_failed


# -- 14.10 and 14.19: one entry's trouble is that entry's ---------------------------------------------
def _plain_tree(src: Path) -> None:
    (src / "d1" / "inner").mkdir(parents=True)
    (src / "d1" / "inner" / "x.txt").write_bytes(b"x\n")
    (src / "d2").mkdir()
    (src / "d2" / "y.txt").write_bytes(b"y\n")
    (src / "conflict").write_bytes(b"a file in the snapshot\n")
    (src / "z.txt").write_bytes(b"z\n")
    for d in (src / "d1", src / "d1" / "inner", src / "d2", src):
        os.chmod(d, 0o755)


def _no_owner_only_dirs(out: Path, src: Path) -> None:
    for d in (src, src / "d1", src / "d1" / "inner", src / "d2"):
        assert stat.S_IMODE(_under(out, d).stat().st_mode) == 0o755, d


def test_a_directory_in_the_way_of_a_file_is_reported_and_the_restore_goes_on(tmp_path):
    src = tmp_path / "src"
    _plain_tree(src)
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = _snap(repo, src)
    out = tmp_path / "out"
    blocker = _under(out, src) / "conflict"
    (blocker / "keep").mkdir(parents=True)  # a non-empty directory where the snapshot has a file
    r = _restorer(repo, m, out)
    r.run()
    assert "directory is in the way" in r.failed[os.fsencode(blocker)]
    assert (blocker / "keep").is_dir()  # nothing already there is lost
    assert (_under(out, src) / "z.txt").read_bytes() == b"z\n"
    assert (_under(out, src) / "d2" / "y.txt").read_bytes() == b"y\n"
    _no_owner_only_dirs(out, src)


def test_a_file_in_the_way_of_a_directory_is_replaced(tmp_path):
    src = tmp_path / "src"
    _plain_tree(src)
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = _snap(repo, src)
    out = tmp_path / "out"
    _under(out, src).mkdir(parents=True)
    (_under(out, src) / "d2").write_bytes(b"a file where the snapshot has a directory\n")
    r = _restorer(repo, m, out)
    r.run()
    assert r.failed == {}
    assert (_under(out, src) / "d2" / "y.txt").read_bytes() == b"y\n"
    _no_owner_only_dirs(out, src)


def _with_xattr(cat_path: Path, dest: Path, inos: list[int], value: bytes) -> Catalog:
    shutil.copyfile(cat_path, dest)
    db = sqlite3.connect(dest)
    db.executemany("INSERT INTO xattrs (ino, name, value) VALUES (?,?,?)",
                   [(ino, b"user.too-big", value) for ino in inos])
    db.commit()
    db.close()
    return Catalog(dest)


def test_an_xattr_the_target_refuses_is_reported_and_the_restore_goes_on(tmp_path):
    """A 70 KB xattr (more than any Linux file system takes) on a file and on a directory: each is
    reported for its entry, every file is restored, and no file is 0600 nor directory 0700 afterwards
    (before the fix: a traceback, every file 0600 and every directory 0700)."""
    src = tmp_path / "src"
    _plain_tree(src)
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = _snap(repo, src)
    cat = Catalog(repo.catalog_path(m["id"]))
    file_ino = cat.resolve(os.fsencode(src / "z.txt")).ino
    dir_ino = cat.resolve(os.fsencode(src / "d1")).ino
    forged = _with_xattr(repo.catalog_path(m["id"]), tmp_path / "x.sqlite", [file_ino, dir_ino], b"v" * 70_000)
    out = tmp_path / "out"
    r = Restorer(forged, repo.read_pack_range, os.fsencode(out), workers=2)
    r.run()
    assert r.failed == {}
    for p in (src / "z.txt", src / "d1"):
        assert "xattr user.too-big not set" in r.metadata_problems[os.fsencode(_under(out, p))]
    assert (_under(out, src) / "z.txt").read_bytes() == b"z\n"
    assert stat.S_IMODE((_under(out, src) / "z.txt").stat().st_mode) == stat.S_IMODE((src / "z.txt").stat().st_mode)
    _no_owner_only_dirs(out, src)


def test_cli_reports_a_refused_xattr_in_one_line_and_exits_partial(cli_repo, tmp_path):
    env, src, sid = cli_repo
    repo = Repository.open(env["OGREFS_REPO"], cache_root=Path(env["OGREFS_CACHE_DIR"]) / "probe")
    cat_path = repo.catalog_path(sid)
    ino = Catalog(cat_path).resolve(os.fsencode(src / "f000")).ino
    forged = _with_xattr(cat_path, tmp_path / "forged.sqlite", [ino], b"v" * 70_000)
    fid = secrets.token_hex(32)
    repo.put_catalog(fid, forged.path)
    repo.put_manifest({**repo.load_manifest(sid), "id": fid})
    proc = _cli(["restore", fid, str(tmp_path / "out")], env)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr
    assert [line for line in proc.stderr.splitlines() if "xattr user.too-big not set" in line]
    assert (_under(tmp_path / "out", src) / "f000").read_bytes() == (src / "f000").read_bytes()


# -- 14.20: snapshot and restore ride through an outage as long as the mount does ---------------------
def test_retrying_store_with_a_time_budget_retries_until_it_is_spent():
    """``retry_for``: attempts are not counted; the call is retried until the budget (fake clock) is spent."""
    from ogrefs.store import FaultyStore, MemoryStore, RetryingStore

    now = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    faulty = FaultyStore(MemoryStore(f"budget-{secrets.token_hex(4)}"))
    faulty.inner.put("k", b"v")
    store = RetryingStore(faulty, base_delay=0.01, max_delay=1.0, retry_for=60.0, sleep=sleep, clock=lambda: now[0])
    faulty.fail_next(20)  # 20 failures: far more than the 6 attempts without a budget
    assert store.get("k") == b"v" and faulty.calls["get"] == 21
    faulty.down = True
    now[0], sleeps[:] = 0.0, []
    with pytest.raises(TransientError) as info:
        store.get("k")
    assert "gave up after 60 s" in str(info.value)
    assert 60.0 - 1e-6 <= sum(sleeps) <= 60.0 + 1e-6  # the last wait is cut to the budget


@pytest.mark.s3
def test_snapshot_and_restore_ride_through_an_s3_outage_with_retry_for(tmp_path, seaweed):
    """The server is down when each command starts and comes back ~10 s later (a restart on the same ports):
    with --retry-for both finish exactly (before: they gave up after ~6 s)."""
    seaweed.ensure_running()
    env = dict(os.environ, **seaweed.env(), OGREFS_REPO=f"s3://{seaweed.new_bucket()}/repo",
               OGREFS_CACHE_DIR=str(tmp_path / "cache"))
    src = tmp_path / "src"
    _many_files(src, 5)
    assert _cli(["-q", "init"], env).returncode == 0
    try:
        for args in (["-q", "snapshot", "--retry-for", "120", str(src)],
                     ["-q", "restore", "--retry-for", "120", "latest", str(tmp_path / "out")]):
            seaweed.stop(grace=0)
            proc = subprocess.Popen([sys.executable, "-m", "ogrefs", *args], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            try:
                time.sleep(1.0)  # (not an assertion: lets the command meet the outage before the restart)
                seaweed.start()  # on this thread: the server dies with the thread that started it
                out, err = proc.communicate(timeout=180)
            finally:
                if proc.poll() is None:
                    proc.kill()
            assert proc.returncode == 0, err
    finally:
        seaweed.ensure_running()
    for p in src.iterdir():
        assert (_under(tmp_path / "out", src) / p.name).read_bytes() == p.read_bytes()


# -- 14.10: a malformed blob location under a writable mount ------------------------------------------
@root_only
@pytest.mark.fuse
@pytest.mark.skipif(not os.path.exists("/dev/fuse") or shutil.which("unshare") is None, reason="no FUSE here")
def test_a_forged_pack_name_fails_only_its_file_under_a_writable_mount(tmp_path):
    """One file's chunk names a pack no store accepts (``../../etc``): a writable mount (materializing in
    the background, prefetching a directory's small files together) reads that file as EIO and lives on,
    serving its sibling (before: the ValueError escaped the fetcher and the daemon died)."""
    src = tmp_path / "box" / "proj"
    src.mkdir(parents=True)
    for name in ("a.txt", "b.txt", "c.txt"):
        (src / name).write_bytes(name.encode() * 100)
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"),
               OGREFS_STATE_DIR=str(tmp_path / "state"), OGREFS_RUNTIME_DIR=str(tmp_path / "run"))
    env.pop("OGREFS_S3_ENDPOINT", None)
    assert _cli(["-q", "init"], env).returncode == 0
    sid = json.loads(_cli(["-q", "snapshot", "--json", str(src)], env).stdout)["id"]
    repo = Repository.open(env["OGREFS_REPO"], cache_root=tmp_path / "probe")
    fid = secrets.token_hex(32)
    forged = _forge_pack_escape(repo.catalog_path(sid), tmp_path / "forged.sqlite", src / "b.txt", new_id=fid)
    repo.put_catalog(fid, forged)
    repo.put_manifest({**repo.load_manifest(sid), "id": fid})
    script = f"""
set -u
mount -t tmpfs fresh-box {src.parent}
{sys.executable} -m ogrefs mount {fid} / || exit 10
cat {src}/a.txt > /dev/null || {{ ls -la {src.parent} {src}; {sys.executable} -m ogrefs status; cat /proc/self/mountinfo | tail -5; exit 11; }}
if cat {src}/b.txt > /dev/null 2> {tmp_path}/b.err; then exit 12; fi
grep -q "Input/output error" {tmp_path}/b.err || exit 13
sleep 1
[ "$(cat {src}/c.txt)" = "{'c.txt' * 100}" ] || exit 14
{sys.executable} -m ogrefs status / > {tmp_path}/status.txt 2>&1 || {{ cat {tmp_path}/status.txt; exit 15; }}
[ "$(cat {src}/a.txt)" = "{"a.txt" * 100}" ] || exit 17
{sys.executable} -m ogrefs unmount / || exit 16
"""
    try:
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", script], env=env,
                              capture_output=True, text=True, timeout=150)
    finally:
        for reg in (tmp_path / "run").rglob("*.json"):
            with __import__("contextlib").suppress(OSError, ValueError, AttributeError, TypeError):
                os.kill(json.loads(reg.read_text()).get("pid"), signal.SIGKILL)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)


def test_a_forged_pack_name_fails_only_its_file_in_a_restore(tmp_path):
    src = tmp_path / "src"
    _plain_tree(src)
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = _snap(repo, src)
    forged = _forge_pack_escape(repo.catalog_path(m["id"]), tmp_path / "forged.sqlite", src / "z.txt")
    out = tmp_path / "out"
    r = Restorer(Catalog(forged), repo.read_pack_range, os.fsencode(out), workers=2)
    r.run()
    assert list(r.failed) == [os.fsencode(_under(out, src / "z.txt"))]
    assert "location is malformed" in r.failed[os.fsencode(_under(out, src / "z.txt"))]
    assert not (_under(out, src) / "z.txt").exists()
    assert (_under(out, src) / "d2" / "y.txt").read_bytes() == b"y\n"
    _no_owner_only_dirs(out, src)


# -- 14.18: a flipped byte in the materialized local copy is never served ------------------------------
@pytest.mark.expect_log(r"local copy of inode .*(does not hold|is damaged)", level=logging.ERROR, logger="ogrefs.lazy")
@pytest.mark.parametrize("copy", ["complete", "incomplete"])
def test_a_flipped_byte_in_the_local_copy_is_not_served(tmp_path_factory, tmp_path, copy):
    """After materialization a byte of a local file changes on disk (before finalize): reads through the
    mount return the snapshot's bytes, fetched from the store, never the damaged ones; the damage is
    counted.  ``incomplete``: the file is not yet complete, its chunks are served one by one from the tree."""
    from ogrefs.lazy.fetch.fetcher import Fetcher
    from ogrefs.lazy.background.materialize.materializer import Materializer
    from ogrefs.lazy.fs.vfs import SnapshotFS

    from tests.resume_box import CallLog, make_box, run_trio

    box = make_box(tmp_path_factory.mktemp("flipbox"))
    state = tmp_path / "state"
    fetcher = Fetcher(box.repo.read_pack_range)
    m = Materializer(box.catalog, fetcher, state)

    async def body():
        await m.run()

    run_trio(fetcher, body)
    assert m.complete
    rel = "ckpt/model.bin"
    ino = box.catalog.resolve(box.path(rel)).ino
    local = box.tree_of(state) / rel
    data = bytearray(local.read_bytes())
    at = len(data) // 2 + 12345
    data[at] ^= 0x01
    local.write_bytes(bytes(data))
    if copy == "incomplete":
        with sqlite3.connect(state / "materialize.sqlite") as db:
            db.execute("UPDATE files SET complete=0 WHERE ino=?", (ino,))
            db.execute("DELETE FROM meta WHERE key='finished'")
    log = CallLog(box.repo.read_pack_range)
    fetcher = Fetcher(log)
    m2 = Materializer(box.catalog, fetcher, state)  # not run: serves what the first run wrote
    assert (m2.local_path(ino) is not None) == (copy == "complete")
    fs = SnapshotFS(box.catalog, fetcher, local=m2)
    got = bytearray()

    async def read():
        fh = await fs.open(ino, os.O_RDONLY)
        while piece := await fs.read(fh, len(got), 256 * 1024):
            got.extend(piece)
        fs.release(fh)

    run_trio(fetcher, read)
    assert bytes(got) == (box.src / rel).read_bytes()
    assert fs.stats.local_corrupt >= 1 and log.calls  # detected, and the damaged chunk came from the store


def test_a_signal_during_an_outage_ends_the_retry_wait_and_fetches_nothing_more(tmp_path):
    """The store is down and restore waits to retry (a 60 s budget, waits of seconds): SIGINT ends the wait
    at once and no further request is made (before: the retries ran on until the budget was spent)."""
    from ogrefs.restore import interruptible_sleep
    from ogrefs.store import FaultyStore, RetryingStore

    src = tmp_path / "src"
    _many_files(src, 4)
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = _snap(repo, src)
    stop = threading.Event()
    faulty = FaultyStore(repo.store)
    faulty.down = True
    signalled = []

    def sleep(seconds: float) -> None:
        if not signalled:
            signalled.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # arrives while this worker waits to retry
        interruptible_sleep(stop)(seconds)

    store = RetryingStore(faulty, base_delay=20.0, max_delay=20.0, retry_for=60.0, sleep=sleep)
    r = _restorer(repo, m, tmp_path / "out", workers=1, stop_event=stop,
                  read_range=lambda p, o, n: store.get_range(f"packs/{p[:2]}/{p}", o, n))
    with pytest.raises(Interrupted), stop_on_signals(r.stop):
        r.run()
    assert faulty.calls["get_range"] == 1
    assert not any(p.name.startswith(".ogrefs-restore-") for p in (tmp_path / "out").rglob("*"))
