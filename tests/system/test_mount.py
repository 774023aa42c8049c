"""Real FUSE mounts through the CLI (tier 5): fidelity, programs, concurrency, failures, lifecycle.

Every mount made here is unmounted in teardown, lazily and by killing its
daemon if it has to be, so a failing test never leaves a stale mount behind.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import signal
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
from pathlib import Path

import pytest

from ogrefs.repo.catalog import Catalog
from ogrefs.box.mountsys import mounted_fstype
from ogrefs.repo import Repository
from ogrefs.repo.pack import pack_key
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot

from tests.treegen import compare_trees, make_fidelity_tree
from tests.mounter import Mounter
from tests.pagecache import resident_bytes

MiB = 1024 * 1024

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not os.path.exists("/dev/fuse") and not os.environ.get("CI"), reason="no /dev/fuse here"),
]


@pytest.fixture
def tree_repo(tmp_path):
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "xdg", pack_target_size=4 * MiB)
    return repo


@pytest.fixture
def mounter(tmp_path, tree_repo):
    m = Mounter(tmp_path, tree_repo.store.url)
    yield m
    m.cleanup()


@pytest.fixture
def any_repo(store_url, tmp_path):
    """A repository over each backend (file, and S3 against SeaweedFS)."""
    return Repository.init(store_url, cache_root=tmp_path / "xdg", pack_target_size=4 * MiB)


@pytest.fixture
def any_mounter(tmp_path, any_repo):
    m = Mounter(tmp_path, any_repo.store.url)  # the S3 endpoint and keys are in os.environ (store_url fixture)
    yield m
    m.cleanup()


def snapshot(repo: Repository, *paths: Path) -> dict:
    return take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(p) for p in paths]))


def under(mp: Path, path: Path) -> Path:
    return mp / str(path).lstrip("/")


def test_mounted_tree_matches_source(tmp_path, any_repo, any_mounter, monkeypatch):
    mounter = any_mounter
    src = tmp_path / "src"
    make_fidelity_tree(src)
    m = snapshot(any_repo, src)
    mp = mounter.mount(m["id"][:12], tmp_path / "mnt")
    assert os.listdir(mp) == [str(tmp_path).split("/")[1]]  # the snapshot keeps its absolute layout
    # pyfuse3 has no lseek handler, so SEEK_DATA/SEEK_HOLE cannot show holes through a mount; holes stay
    # visible as st_blocks, which describe(check_holes=True) still compares
    assert compare_trees(src, under(mp, src), seek_holes=False) == []

    inos = {p.name: os.lstat(p).st_ino for p in under(mp, src).iterdir()}
    assert os.stat(under(mp, src) / "small.txt").st_ino == os.stat(under(mp, src) / "dir" / "hardlink-to-small").st_ino
    with pytest.raises(OSError) as e:
        open(under(mp, src) / "small.txt", "r+b")
    assert e.value.errno == errno.EROFS
    with pytest.raises(OSError) as e:
        os.mkdir(under(mp, src) / "new")
    assert e.value.errno == errno.EROFS
    vfs = os.statvfs(mp)
    assert vfs.f_files >= 20 and vfs.f_namemax == 255

    # the kernel keeps the data across opens (keep_cache). Without it, every OPEN invalidates the file's
    # pages (fuse_finish_open), so fincore, which opens the file before mincore(2), would see none; with it
    # the pages of the first read are still there. A page the kernel reclaims in between (memory pressure
    # from the rest of the suite) is read again, so the daemon may serve what was not resident, never more
    want = (src / "random.bin").read_bytes()
    assert (under(mp, src) / "random.bin").read_bytes() == want
    first = mounter.status(mp)["bytes_read"]
    resident = resident_bytes(under(mp, src) / "random.bin")
    assert resident >= len(want) // 2, f"only {resident} of {len(want)} bytes stayed cached across an open"
    assert (under(mp, src) / "random.bin").read_bytes() == want
    again = mounter.status(mp)["bytes_read"] - first
    assert again < len(want) // 2, f"the second open re-read {again} of {len(want)} bytes through the daemon"

    mounter.unmount(mp)
    mounter.mount(m["id"], mp)  # inode numbers are stable across mounts
    assert {p.name: os.lstat(p).st_ino for p in under(mp, src).iterdir()} == inos


C_EXTENSION = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject *add(PyObject *self, PyObject *args) {
    long a, b;
    if (!PyArg_ParseTuple(args, "ll", &a, &b)) return NULL;
    return PyLong_FromLong(a + b);
}
static PyMethodDef methods[] = {{"add", add, METH_VARARGS, "add two ints"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "ogretest", NULL, -1, methods};
PyMODINIT_FUNC PyInit_ogretest(void) { return PyModule_Create(&mod); }
"""


def test_program_runs_from_mount_and_imports_a_compiled_extension(tmp_path, tree_repo, mounter):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (tmp_path / "ogretest.c").write_text(C_EXTENSION)
    so = site / f"ogretest{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", f"-I{sysconfig.get_paths()['include']}",
                    str(tmp_path / "ogretest.c"), "-o", str(so)], check=True)
    pkg = site / "ogrepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .core import answer\n")
    (pkg / "core.py").write_text("answer = 42\n" + "# padding\n" * 2000)
    m = snapshot(tree_repo, venv)
    mp = mounter.mount(m["id"], tmp_path / "mnt")
    mvenv = under(mp, venv)
    code = textwrap.dedent("""
        import sys, ogretest, ogrepkg
        print(sys.prefix, ogretest.__file__, ogretest.add(2, 3), ogrepkg.answer)
    """)
    res = subprocess.run([str(mvenv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    prefix, so_file, total, answer = res.stdout.split()
    assert prefix == str(mvenv) and so_file.startswith(str(mvenv)) and (total, answer) == ("5", "42")
    st = mounter.status(mp)
    assert st["errors"] == 0 and st["bytes_fetched"] > 0


def test_the_loop_profile_is_in_the_status_only_when_asked_for(tmp_path, tree_repo, mounter):
    """``OGREFS_PROFILE_LOOP=1``: the status shows the loop's steps per FUSE operation, its wake-up lateness and
    its threads' run-queue waits; without it, nothing is timed and the status has no such entry."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"f{i}").write_bytes(os.urandom(300_000))
    m = snapshot(tree_repo, src)
    profiled = Mounter(tmp_path / "p", tree_repo.store.url, extra_env={"OGREFS_PROFILE_LOOP": "1"})
    try:
        mp = profiled.mount(m["id"], tmp_path / "mnt-profiled")
        for i in range(5):
            assert (under(mp, src) / f"f{i}").read_bytes() == (src / f"f{i}").read_bytes()
        p = profiled.status(mp)["loop_profile"]
        steps = p["steps"]
        assert steps["lookup"]["count"] >= 5 and steps["read"]["count"] >= 5 and steps["open"]["count"] >= 5
        assert all(s["wall_s"] >= 0 and s["cpu_s"] >= 0 for s in steps.values())
        assert p["wakeup_late_ms"]["samples"] > 0 and p["threads"]["loop"]["cpu_s"] > 0
    finally:
        profiled.cleanup()
    plain = mounter.mount(m["id"], tmp_path / "mnt-plain")
    assert (under(plain, src) / "f0").read_bytes() == (src / "f0").read_bytes()
    assert "loop_profile" not in mounter.status(plain)


def test_concurrent_readers_get_correct_bytes_and_each_chunk_is_fetched_once(tmp_path, any_repo, any_mounter):
    mounter = any_mounter
    src = tmp_path / "data"
    src.mkdir()
    payload = os.urandom(24 * MiB + 4321)
    (src / "big.bin").write_bytes(payload)
    m = snapshot(any_repo, src)
    cat = Catalog(any_repo.catalog_path(m["id"]))
    chunks = {e.chunk for e in cat.extents(cat.resolve(os.fsencode(src / "big.bin")).ino)}
    mp = mounter.mount(m["id"], tmp_path / "mnt", "--cache-dir", str(tmp_path / "fresh-cache"))
    target = under(mp, src) / "big.bin"
    rng = random.Random(3)
    ranges = [(rng.randrange(0, len(payload)), rng.choice([4096, 300_000, 2 * MiB, 5 * MiB])) for _ in range(64)]
    failures: list[str] = []

    def reader(part: list[tuple[int, int]]) -> None:
        fd = os.open(target, os.O_RDONLY)
        try:
            for off, size in part:
                if os.pread(fd, size, off) != payload[off:off + size]:
                    failures.append(f"thread read at {off}+{size}")
        finally:
            os.close(fd)

    script = textwrap.dedent(f"""
        import os, sys, random
        rng = random.Random(int(sys.argv[1]))
        a, b = os.open({str(target)!r}, os.O_RDONLY), os.open({str(src / 'big.bin')!r}, os.O_RDONLY)
        for _ in range(24):
            off, size = rng.randrange(0, {len(payload)}), rng.choice([4096, 1 << 20, 3 << 20])
            if os.pread(a, size, off) != os.pread(b, size, off):
                sys.exit(f"process read at {{off}}+{{size}} differs")
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(i)], stderr=subprocess.PIPE, text=True)
             for i in range(4)]
    threads = [threading.Thread(target=reader, args=(ranges[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for p in procs:
        _, err = p.communicate(timeout=120)
        if p.returncode:
            failures.append(err.strip())
    assert failures == []
    st = mounter.status(mp)
    assert st["errors"] == 0
    assert st["chunks_fetched"] <= len(chunks)  # single flight: never the same chunk twice
    with open(target, "rb") as fh:
        assert hashlib.sha256(fh.read()).digest() == hashlib.sha256(payload).digest()
    assert mounter.status(mp)["chunks_fetched"] == len(chunks)


def test_corrupt_and_deleted_packs_fail_only_their_files(tmp_path, mounter):
    repo = Repository.init(f"file://{tmp_path}/repo2", cache_root=tmp_path / "xdg", pack_target_size=1 * MiB)
    src = tmp_path / "src"
    files = {}
    for name in ("a/1", "a/2", "b/1", "b/2", "c/1", "c/2"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        files[name] = os.urandom(int(1.5 * MiB))
        (src / name).write_bytes(files[name])
    m = snapshot(repo, src)
    cat = Catalog(repo.catalog_path(m["id"]))
    packs = {n: {e.pack for e in cat.extents(cat.resolve(os.fsencode(src / n)).ino)} for n in files}
    corrupt = sorted(packs["a/1"])[0]
    deleted = sorted(packs["b/2"] - {corrupt})[0]
    broken = {n for n, ps in packs.items() if ps & {corrupt, deleted}}
    assert len(broken) < len(files), "the test needs files outside the damaged packs"
    root = Path(repo.store.url[len("file://"):])
    raw = bytearray((root / pack_key(corrupt)).read_bytes())
    for i in range(0, len(raw) - 64, 4096):
        raw[i + 10] ^= 0x55
    (root / pack_key(corrupt)).write_bytes(raw)
    (root / pack_key(deleted)).unlink()
    mounter.repo_url = repo.store.url
    mp = mounter.mount(m["id"], tmp_path / "mnt", "--retry-for", "2")
    base = under(mp, src)
    for name, data in files.items():
        if name in broken:
            with pytest.raises(OSError) as e:
                (base / name).read_bytes()
            assert e.value.errno == errno.EIO, name
        else:
            assert (base / name).read_bytes() == data, name
    assert sorted(os.listdir(base)) == ["a", "b", "c"]
    st = mounter.status(mp)
    assert st["read_errors"] >= len(broken) and st["corrupt"] >= 1
    log = Path(st["log"]).read_text()
    assert all(f"read of {src / name}" in log for name in broken)


def test_cli_errors_are_one_line(tmp_path, tree_repo, mounter):
    src = tmp_path / "src"
    src.mkdir()
    (src / "x").write_text("x")
    m = snapshot(tree_repo, src)
    full = tmp_path / "full"
    full.mkdir()
    (full / "something").write_text("in the way")
    cases = [
        (("mount", m["id"], str(tmp_path / "missing"), "--read-only"), "does not exist"),
        (("mount", m["id"], str(full), "--read-only"), "not empty"),
        (("mount", "deadbeef", str(tmp_path), "--read-only"), "deadbeef"),
        (("status", str(tmp_path)), "not an ogrefs mount"),
        (("unmount", str(tmp_path)), "not mounted"),
    ]
    (tmp_path / "mnt").mkdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    cases[2] = (("mount", "deadbeef", str(empty), "--read-only"), "deadbeef")
    for args, needle in cases:
        res = mounter.cli(*args, check=False)
        assert res.returncode != 0, args
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in res.stderr, (args, res.stderr)
    assert mounted_fstype(empty) is None


def test_a_snapshot_without_xattrs_says_not_supported_and_one_with_them_shows_them(tmp_path, tree_repo, mounter):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "f").write_text("f")
    tagged = tmp_path / "tagged"
    tagged.mkdir()
    (tagged / "f").write_text("f")
    os.setxattr(tagged / "f", "user.tag", b"v")
    mp = mounter.mount(snapshot(tree_repo, plain)["id"], tmp_path / "mnt-plain")
    with pytest.raises(OSError) as e:  # the daemon answered ENOSYS once; the kernel says "not supported"
        os.getxattr(under(mp, plain / "f"), "user.tag")
    assert e.value.errno == errno.EOPNOTSUPP
    assert os.listxattr(under(mp, plain / "f")) == []
    assert under(mp, plain / "f").read_text() == "f"
    mp2 = mounter.mount(snapshot(tree_repo, tagged)["id"], tmp_path / "mnt-tagged")
    assert os.getxattr(under(mp2, tagged / "f"), "user.tag") == b"v"
    with pytest.raises(OSError) as e:
        os.getxattr(under(mp2, tagged / "f"), "user.other")
    assert e.value.errno == errno.ENODATA


def test_a_daemon_that_cannot_start_undoes_what_it_set_up(tmp_path, tree_repo, mounter):
    """The daemon's teardown covers a failed start too: one-line reason, nothing mounted, lock released.

    The chunk cache cannot be opened (its directory is a file) after the caller
    handed the repository lock over to the daemon; the lock must not outlive it.
    """
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("f")
    m = snapshot(tree_repo, src)
    (tmp_path / "not-a-dir").write_text("x")
    mp = tmp_path / "mnt"
    mp.mkdir()
    mounter.mounts.append(mp)
    res = mounter.cli("mount", m["id"], str(mp), "--read-only", "--cache-dir", str(tmp_path / "not-a-dir"),
                      check=False)
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "not-a-dir" in res.stderr, res.stderr
    assert mounted_fstype(mp) is None
    assert not list((tmp_path / "run" / "mounts").glob("*.json"))  # never registered
    assert not list((tmp_path / "repo" / "locks").iterdir())  # released by the daemon on its way out


def test_missing_dev_fuse_is_reported(monkeypatch, tmp_path):
    from ogrefs.box.records import MountError
    from ogrefs.mount.client import mount
    from ogrefs.mount.options import MountOptions

    real = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: False if p == "/dev/fuse" else real(p))
    opts = MountOptions(repo_url="file:///nonexistent", snapshot="latest", mountpoint=tmp_path)
    with pytest.raises(MountError, match="/dev/fuse is missing"):
        mount(opts)


def test_signals_unmount_cleanly(tmp_path, tree_repo, mounter):
    src = tmp_path / "src"
    src.mkdir()
    (src / "x").write_text("hello")
    m = snapshot(tree_repo, src)
    mp = mounter.mount(m["id"], tmp_path / "mnt")
    pid = mounter.status(mp)["pid"]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while (mounted_fstype(mp) is not None or os.path.exists(f"/proc/{pid}")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mounted_fstype(mp) is None
    assert not list((tmp_path / "run" / "mounts").glob("*.status.json"))

    # --foreground: stays attached, reports readiness on stdout, Ctrl-C unmounts
    proc = subprocess.Popen([sys.executable, "-m", "ogrefs", "--repo", mounter.repo_url, "mount", m["id"],
                             str(mp), "--read-only", "--foreground"], env=mounter.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "mounted" in line, proc.stderr.read() if proc.poll() is not None else line
        assert (under(mp, src) / "x").read_text() == "hello"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert mounted_fstype(mp) is None
    finally:
        if proc.poll() is None:
            proc.kill()
        mounter.mounts.append(mp)


@pytest.mark.s3
def test_s3_read_waits_through_a_server_restart(tmp_path, seaweed):
    seaweed.ensure_running()
    url = f"s3://{seaweed.new_bucket()}/repo"
    repo = Repository.init(url, s3_endpoint=seaweed.endpoint, cache_root=tmp_path / "xdg", pack_target_size=1 * MiB)
    src = tmp_path / "src"
    src.mkdir()
    early, late = os.urandom(2 * MiB), os.urandom(3 * MiB)
    (src / "early.bin").write_bytes(early)
    (src / "late.bin").write_bytes(late)
    m = snapshot(repo, src)
    mounter = Mounter(tmp_path, url, extra_env=seaweed.env())
    try:
        mp = mounter.mount(m["id"], tmp_path / "mnt", "--retry-for", "90")
        base = under(mp, src)
        assert (base / "early.bin").read_bytes() == early
        seaweed.stop(grace=0)
        result: dict = {}

        def read_late() -> None:
            try:
                result["data"] = (base / "late.bin").read_bytes()
            except OSError as exc:
                result["error"] = exc

        reader = threading.Thread(target=read_late)
        reader.start()
        time.sleep(1.5)
        assert reader.is_alive() and not result  # waiting for the store, not failed
        seaweed.start()
        reader.join(90)
        assert result.get("data") == late, result.get("error")
        st = mounter.status(mp)
        assert st["errors"] == 0 and st["read_errors"] == 0
    finally:
        seaweed.ensure_running()
        mounter.cleanup()


def test_encrypted_repository_mounts_with_its_passphrase(tmp_path, monkeypatch):
    from ogrefs.repo.keys import Secret

    repo = Repository.init(f"file://{tmp_path}/enc", cache_root=tmp_path / "xdg", secret=Secret(b"pw", "scrypt"))
    src = tmp_path / "src"
    src.mkdir()
    payload = os.urandom(3 * MiB)
    (src / "secret.bin").write_bytes(payload)
    m = snapshot(repo, src)
    mounter = Mounter(tmp_path, repo.store.url, extra_env={"OGREFS_PASSWORD": "pw"})
    try:
        mp = mounter.mount(m["id"], tmp_path / "mnt", "--cache-dir", str(tmp_path / "chunks"))
        assert (under(mp, src) / "secret.bin").read_bytes() == payload
        # the chunk cache verifies with the repository's keyed ids: a remount is served from it
        mounter.unmount(mp)
        mounter.mount(m["id"], mp, "--cache-dir", str(tmp_path / "chunks"))
        assert (under(mp, src) / "secret.bin").read_bytes() == payload
        st = mounter.status(mp)
        cat = Catalog(repo.catalog_path(m["id"]))
        chunks = len({e.chunk for e in cat.extents(cat.resolve(os.fsencode(src / "secret.bin")).ino)})
        assert st["bytes_fetched"] == 0 and st["cache_hits_disk"] >= chunks >= 1 and st["errors"] == 0
        mounter.unmount(mp)
        mounter.env.pop("OGREFS_PASSWORD")
        res = mounter.cli("mount", m["id"], str(mp), "--read-only", check=False)
        assert res.returncode != 0 and "encrypted" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    finally:
        mounter.cleanup()


def test_status_wait_returns_when_complete_and_fails_with_the_reason(monkeypatch):
    """``ogrefs status --wait``: polls until the copy is complete, or says why it never will be."""
    from ogrefs.mount import status

    def statuses(*seq):
        it = iter(seq)
        monkeypatch.setattr(status, "read_status", lambda mp: next(it))

    running = {"mountpoint": "/m", "materialize": {"mode": "materialize", "state": "running", "complete": False}}
    statuses(running, running, {"mountpoint": "/m", "materialize": {"mode": "materialize", "state": "done",
                                                                     "complete": True}})
    seen = []
    st, problem = status.wait_background(Path("/m"), poll=0, progress=seen.append)
    assert problem is None and st["materialize"]["complete"] and len(seen) == 3

    statuses(running, {"mountpoint": "/m", "materialize": {"mode": "materialize", "state": "stopped",
                                                           "reason": "stopped: the disk of /s is full"}})
    st, problem = status.wait_background(Path("/m"), poll=0)
    assert problem == "/m will not become fully local: stopped: the disk of /s is full"

    statuses({"mountpoint": "/m", "materialize": {"mode": "cache", "state": "done", "complete": False}})
    assert status.wait_background(Path("/m"), poll=0)[1] is None  # a cache-only mount: its prefetch ended


def test_busy_read_only_unmount_says_so_and_keeps_the_mount(tmp_path, tree_repo, mounter):
    src = tmp_path / "src"
    src.mkdir()
    (src / "x").write_text("hello")
    m = snapshot(tree_repo, src)
    mp = mounter.mount(m["id"], tmp_path / "mnt")
    with open(under(mp, src) / "x") as held:  # an open file keeps the mount busy
        res = mounter.cli("unmount", str(mp), check=False)
        assert res.returncode != 0 and "busy" in res.stderr and len(res.stderr.strip().splitlines()) == 1
        assert mounted_fstype(mp) == "fuse.ogrefs" and held.read() == "hello"
    mounter.unmount(mp)
