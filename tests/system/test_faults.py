"""Faults survived, measured: snapshots interrupted everywhere, reads that lie, stores that go away.

After every fault the same three things are proved on a *clean* view of the
repository (a fresh cache, a plain RetryingStore):

* ``check_repository(read_data=True)`` finds no problem;
* every snapshot in the repository restores bit for bit (``compare_trees``);
* a failed run left no manifest, and the rerun uploaded only what was missing
  (every chunk already in a pack that survived the failure is reused).

Store faults come from :class:`ogrefs.store.FaultyStore` wrapped around a real
backend (file, or S3 on SeaweedFS); process faults are a SIGKILL of
``python -m ogrefs snapshot`` at seeded points; outages are the SeaweedFS
server stopped and started again.  docs/reliability.md maps each fault to its
test here.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import blake3
import pytest

from ogrefs.repo.catalog import Catalog
from ogrefs.maint.check import check_repository
from ogrefs.repo import Repository
from ogrefs.repo.locks import read_locks
from ogrefs.restore import Restorer
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot
from ogrefs.errors import OgrefsError
from ogrefs.store import FaultyStore, RetryingStore, StoreError, TransientError, open_store
from ogrefs.store.base import Store

from tests.treegen import compare_trees

MiB = 1024 * 1024
PACK = 1 * MiB


def make_tree(root: Path, seed: int = 7) -> None:
    """About 9 MiB in 14 files of seeded random bytes (so chunking, and the put count, are the same every run)."""
    rng = random.Random(seed)
    (root / "sub" / "deeper").mkdir(parents=True)
    sizes = [3 * MiB, 1536 * 1024, 1 * MiB, 700_000, 400_000, 300_000, 200_000, 100_000, 5000, 17, 0]
    for i, size in enumerate(sizes):
        (root / f"f{i:02d}.bin").write_bytes(rng.randbytes(size))
    (root / "sub" / "same-as-f05.bin").write_bytes((root / "f05.bin").read_bytes())  # dedup inside the run
    (root / "sub" / "deeper" / "text.py").write_text("print('hello')\n" * 5000)
    (root / "sub" / "big.bin").write_bytes(rng.randbytes(2 * MiB))


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults") / "src"
    make_tree(root)
    return root


@pytest.fixture(scope="module")
def put_count(tree, tmp_path_factory) -> int:
    """How many puts one clean snapshot of ``tree`` makes (lock, packs, per-pack indexes, index, catalog, manifest)."""
    d = tmp_path_factory.mktemp("count")
    Repository.init(f"file://{d}/repo", cache_root=d / "c", pack_target_size=PACK)
    counting = FaultyStore(open_store(f"file://{d}/repo", retry=False))
    repo = Repository.open(f"file://{d}/repo", store=counting, cache_root=d / "c")
    _snap(repo, tree)
    assert counting.calls["put"] >= 12, "the tree should make several packs"
    return counting.calls["put"]


def _snap(repo: Repository, src: Path, **kw) -> dict:
    return take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True, workers=2, **kw))


def _faulty_repo(url: str, cache: Path, **faults) -> tuple[Repository, FaultyStore]:
    """The repository at ``url`` seen through a FaultyStore (and no retries unless the caller adds them)."""
    faulty = FaultyStore(open_store(url, retry=False), **faults)
    return Repository.open(url, store=faulty, cache_root=cache), faulty


def _pack_chunks(repo: Repository) -> dict[str, set[bytes]]:
    """Every pack in the store and the chunk ids its own header lists."""
    names = [k.rsplit("/", 1)[1] for k in repo.store.list("packs/")]
    return {n: {cid for cid, *_ in repo.read_pack_header(n)} for n in names}


def verify(url: str, tmp: Path, sources: dict[str, Path] | Path) -> Repository:
    """check --read-data is clean and every snapshot restores bit for bit (on a fresh cache)."""
    repo = Repository.open(url, cache_root=tmp / f"verify-{time.monotonic_ns()}")
    report = check_repository(repo, read_data=True)
    assert report.problems == []
    for sid in repo.snapshot_ids():
        src = sources if isinstance(sources, Path) else sources[sid]
        out = tmp / f"restored-{sid[:12]}-{time.monotonic_ns()}"
        r = Restorer(Catalog(repo.catalog_path(sid)), repo.read_pack_range, os.fsencode(out), workers=4)
        r.run()
        assert not r.failed and not r.skipped
        assert compare_trees(src, out / str(src).lstrip("/")) == []
    return repo


def rerun_reuses(url: str, tmp: Path, src: Path) -> dict:
    """Snapshot again on a clean store; assert that no chunk already in a surviving pack was uploaded again."""
    repo = Repository.open(url, cache_root=tmp / "rerun-cache")
    before = _pack_chunks(repo)
    survived = set().union(*before.values()) if before else set()
    m = _snap(repo, src)
    chunks = {c for c, *_ in Catalog(repo.catalog_path(m["id"])).all_blobs()}
    assert m["totals"]["new_chunks"] == len(chunks - survived)
    for chunk, pack, *_ in Catalog(repo.catalog_path(m["id"])).all_blobs():
        if chunk in survived:
            assert pack in before, "a chunk that survived in a pack was uploaded again"
    return m


# -- snapshot: a failing put anywhere ------------------------------------------------------------------

def _consolidated_index() -> Callable[[str], bool]:
    """The run's consolidated index object: the first ``index/`` key that names no pack put before it."""
    packs: set[str] = set()

    def where(key: str) -> bool:
        if key.startswith("packs/"):
            packs.add(key.rsplit("/", 1)[1])
        return key.startswith("index/") and key[len("index/"):] not in packs

    return where


# name -> the faults that fail that put, from the put count of a clean run: a position where the order of the puts
# is fixed, the object itself where threads put side by side (the catalog beside the consolidated index)
PUT_POINTS: dict[str, Callable[[int], dict[str, Any]]] = {
    "lock": lambda n: {"fail_puts": {1}},
    "first-pack": lambda n: {"fail_puts": {2}},
    "early": lambda n: {"fail_puts": {3}},
    "middle": lambda n: {"fail_puts": {n // 2}},
    "late": lambda n: {"fail_puts": {n - 4}},
    "consolidated-index": lambda n: {"fail_put_where": _consolidated_index()},
    "catalog": lambda n: {"fail_put_where": lambda key: key.startswith("catalogs/")},
    "manifest": lambda n: {"fail_puts": {n}},
}


#: the points named by their object: the failed put's key (in the injected error's message) starts with this
NAMED_BY_KEY = {"consolidated-index": "index/", "catalog": "catalogs/"}


def _fail_put_then_rerun(url: str, tmp: Path, tree: Path, faults: dict[str, Any], named: str | None = None) -> None:
    Repository.init(url, cache_root=tmp / "c0", pack_target_size=PACK)
    repo, faulty = _faulty_repo(url, tmp / "c1", **faults)
    with pytest.raises(TransientError, match="injected failure of put #") as failed:
        _snap(repo, tree)
    if named is not None:  # the object the point names failed, not another put at the same moment
        assert str(failed.value).rsplit("(", 1)[1].startswith(named)
    assert faulty.injected["put"] == 1
    clean = Repository.open(url, cache_root=tmp / "c2")
    assert clean.snapshot_ids() == [], "a failed run must not leave a manifest"
    m = rerun_reuses(url, tmp, tree)
    verify(url, tmp, {m["id"]: tree})


@pytest.mark.parametrize("point", list(PUT_POINTS))
def test_put_failure_at_each_point_then_rerun_file(point, tree, put_count, tmp_path):
    _fail_put_then_rerun(f"file://{tmp_path}/repo", tmp_path, tree, PUT_POINTS[point](put_count),
                         NAMED_BY_KEY.get(point))


@pytest.mark.s3
@pytest.mark.parametrize("point", ["first-pack", "middle", "catalog", "manifest"])
def test_put_failure_at_each_point_then_rerun_s3(point, tree, put_count, tmp_path, seaweed, monkeypatch):
    seaweed.ensure_running()
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    url = f"s3://{seaweed.new_bucket()}/repo"
    _fail_put_then_rerun(url, tmp_path, tree, PUT_POINTS[point](put_count), NAMED_BY_KEY.get(point))


def test_delete_failure_at_commit_then_rerun(store_url, tree, tmp_path):
    """The per-pack index objects are deleted after the consolidated one is written: a failure there."""
    Repository.init(store_url, cache_root=tmp_path / "c0", pack_target_size=PACK)
    repo, faulty = _faulty_repo(store_url, tmp_path / "c1")
    faulty.fail_next(1, ops={"delete"})
    with pytest.raises(TransientError):
        _snap(repo, tree)
    assert faulty.injected["delete"] == 1
    assert Repository.open(store_url, cache_root=tmp_path / "c2").snapshot_ids() == []
    m = rerun_reuses(store_url, tmp_path, tree)
    assert m["totals"]["new_chunks"] == 0  # every pack was uploaded before the failure
    verify(store_url, tmp_path, {m["id"]: tree})


class _LoseAckOf(FaultyStore):
    """Commits the put of the first key with ``prefix``, then reports a failure (timeout after commit)."""

    def __init__(self, inner: Store, prefix: str) -> None:
        super().__init__(inner)
        self.prefix = prefix
        self.lost: list[str] = []

    def put(self, key: str, data: bytes) -> None:
        super().put(key, data)
        if key.startswith(self.prefix) and not self.lost:
            self.lost.append(key)
            raise TransientError(f"{self.url}: injected lost acknowledgement of put {key}")


@pytest.mark.parametrize("prefix", ["locks/", "packs/", "index/", "catalogs/", "snapshots/"])
def test_lost_ack_without_retries_leaves_only_complete_snapshots(prefix, tree, tmp_path):
    """The store committed a put but the caller saw an error and gave up.

    Whatever the object was, the repository stays valid; if it was the manifest,
    the snapshot exists (the caller cannot know) and it is complete.  A lost
    lock is removed again, so it does not hold back prune for half an hour.
    """
    url = f"file://{tmp_path}/repo"
    Repository.init(url, cache_root=tmp_path / "c0", pack_target_size=PACK)
    lossy = _LoseAckOf(open_store(url, retry=False), prefix)
    repo = Repository.open(url, store=lossy, cache_root=tmp_path / "c1")
    with pytest.raises(TransientError, match="lost acknowledgement"):
        _snap(repo, tree)
    assert lossy.lost
    clean = Repository.open(url, cache_root=tmp_path / "c2")
    assert len(clean.snapshot_ids()) == (1 if prefix == "snapshots/" else 0)
    assert list(clean.store.list("locks/")) == []
    m = rerun_reuses(url, tmp_path, tree)
    verify(url, tmp_path, tree)
    assert m["id"] in clean.snapshot_ids()


def test_transient_errors_and_lost_acks_with_retries_are_invisible(store_url, tree, tmp_path):
    """25 % of calls fail and 25 % of puts lose their acknowledgement: the snapshot and a restore succeed."""
    Repository.init(store_url, cache_root=tmp_path / "c0", pack_target_size=PACK)
    # at most 4 faults of the rates in a row on one key, 12 attempts: no run of draws can make it give up
    # (without the limit a put failed 12 times in a row about once in a few hundred runs: 0.44 ** 12 a put)
    faulty = FaultyStore(open_store(store_url, retry=False), seed=11, error_rate=0.25, lost_ack_rate=0.25,
                         latency=(0.0, 0.002), streak_limit=4)
    retrying = RetryingStore(faulty, attempts=12, sleep=lambda s: None)
    repo = Repository.open(store_url, store=retrying, cache_root=tmp_path / "c1")
    m = _snap(repo, tree)
    assert faulty.injected["put"] >= 2 and faulty.injected["lost_ack"] >= 2
    out = tmp_path / "out"
    # the restore's reads meet failures whatever the seeded draws left for them (how many calls the snapshot
    # made moves the generator: a change to pack sealing once left the restore none at all)
    reads_failed = lambda: faulty.injected["get_range"] + faulty.injected["open_range"]  # noqa: E731
    before = reads_failed()
    faulty.fail_next(2, ops={"get_range", "open_range"})
    r = Restorer(Catalog(repo.catalog_path(m["id"])), repo.read_pack_range, os.fsencode(out), workers=4)
    r.run()
    assert not r.failed and reads_failed() - before >= 2  # the restore's own reads failed and were retried
    assert compare_trees(tree, out / str(tree).lstrip("/")) == []
    verify(store_url, tmp_path, tree)


# -- restore: reads that come back wrong --------------------------------------------------------------

def _restore_through(repo: Repository, sid: str, store: Store, out: Path) -> Restorer:
    r = Restorer(Catalog(repo.catalog_path(sid)), lambda p, o, n: store.get_range(f"packs/{p[:2]}/{p}", o, n),
                 os.fsencode(out), workers=4)
    r.run()
    return r


class _FirstReadLies(FaultyStore):
    """The first range read of each pack returns flipped or truncated bytes; later reads tell the truth."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.seen: set[str] = set()
        self.lies = 0
        self._mu = threading.Lock()

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        data = self.inner.get_range(key, offset, length)
        with self._mu:
            first = key not in self.seen
            self.seen.add(key)
            if first:
                self.lies += 1
                lie = self.lies
        if first:
            return data[: len(data) // 2] if lie % 2 else bytes([data[0] ^ 1]) + data[1:]
        return data


def test_restore_refetches_a_blob_that_fails_verification(store_url, tree, tmp_path):
    """A bit flipped or a body cut short on the way is not a bad pack: one more fetch, then the right bytes."""
    repo = Repository.init(store_url, cache_root=tmp_path / "c0", pack_target_size=PACK)
    m = _snap(repo, tree)
    liar = _FirstReadLies(open_store(store_url, retry=False))
    r = _restore_through(repo, m["id"], liar, tmp_path / "out")
    assert liar.lies >= 3 and r.stats.refetched >= liar.lies
    assert not r.failed
    assert compare_trees(tree, tmp_path / "out" / str(tree).lstrip("/")) == []


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_restore_with_random_corrupt_and_truncated_reads_never_writes_wrong_bytes(seed, tree, tmp_path):
    """Reads corrupted or cut short at random, twice in a row sometimes: every file is either exact or reported and absent."""
    url = f"file://{tmp_path}/repo"
    repo = Repository.init(url, cache_root=tmp_path / "c0", pack_target_size=PACK)
    m = _snap(repo, tree)
    faulty = FaultyStore(open_store(url, retry=False), seed=seed, corrupt_rate=0.35, truncate_rate=0.25,
                         ops={"get_range"})
    out = tmp_path / "out"
    r = _restore_through(repo, m["id"], faulty, out)
    assert faulty.injected["corrupt"] + faulty.injected["truncate"] >= 2
    assert r.stats.refetched >= 1
    restored = out / str(tree).lstrip("/")
    for dirpath, _, files in os.walk(tree):
        for name in files:
            src = Path(dirpath) / name
            dst = restored / src.relative_to(tree)
            if os.fsencode(dst) in r.failed:
                assert not dst.exists(), f"{dst} failed but was left behind"
            else:
                assert dst.read_bytes() == src.read_bytes(), f"{dst} holds wrong bytes"
    assert len(r.failed) < 14  # the re-fetch rescues most files


# -- snapshot: the process killed at seeded points -----------------------------------------------------

SITECUSTOMIZE = '''
import os, time
_log = os.environ.get("OGREFS_TEST_PUTLOG")
if _log:
    def _hook(cls):
        orig = cls.put
        delay = float(os.environ.get("OGREFS_TEST_PUT_DELAY", "0"))
        def put(self, key, data):
            orig(self, key, data)
            with open(_log, "a") as fh:
                fh.write(key + "\\n")
            time.sleep(delay)
        cls.put = put
    from ogrefs.store import file as _file
    _hook(_file.FileStore)
    if os.environ.get("OGREFS_TEST_BACKEND") == "s3":
        from ogrefs.store import s3 as _s3
        _hook(_s3.S3Store)
'''


def _kill_after_puts(url: str, tmp: Path, src: Path, k: int, env: dict[str, str] | None = None) -> list[str]:
    """Run ``python -m ogrefs snapshot`` and SIGKILL it once ``k`` puts have completed; returns the keys put."""
    hooks = tmp / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    putlog = tmp / "puts.log"
    putlog.write_text("")
    env = dict(os.environ, **(env or {}), OGREFS_REPO=url, OGREFS_CACHE_DIR=str(tmp / "killed-cache"),
               PYTHONPATH=str(hooks), OGREFS_TEST_PUTLOG=str(putlog), OGREFS_TEST_PUT_DELAY="0.3",
               OGREFS_TEST_BACKEND=url.partition("://")[0])
    proc = subprocess.Popen([sys.executable, "-m", "ogrefs", "-q", "snapshot", str(src)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if len(putlog.read_text().splitlines()) >= k:
                break
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, f"the snapshot ended on its own: {proc.stderr.read()!r}"
    return putlog.read_text().splitlines()


def _kill_points(put_count: int) -> list[int]:
    rng = random.Random(2026)
    return sorted(rng.sample(range(1, put_count - 2), 3)) + [put_count - 1]  # the last: catalog put, no manifest


@pytest.mark.parametrize("which", [0, 1, 2, 3])
def test_sigkill_at_seeded_points_then_rerun(which, tree, put_count, tmp_path):
    url = f"file://{tmp_path}/repo"
    Repository.init(url, cache_root=tmp_path / "c0", pack_target_size=PACK)
    k = _kill_points(put_count)[which]
    done = _kill_after_puts(url, tmp_path, tree, k)
    assert len(done) >= k and not any(key.startswith("snapshots/") for key in done)
    if which == 3:  # killed after the catalog was stored, before the manifest
        assert any(key.startswith("catalogs/") for key in done)
    assert Repository.open(url, cache_root=tmp_path / "c1").snapshot_ids() == []
    m = rerun_reuses(url, tmp_path, tree)
    if sum(key.startswith("packs/") for key in done) >= 2:
        assert m["totals"]["new_chunks"] < m["totals"]["chunks"]  # the killed run's packs were reused
    verify(url, tmp_path, {m["id"]: tree})


@pytest.mark.s3
def test_sigkill_over_s3_then_rerun(tree, put_count, tmp_path, seaweed, monkeypatch):
    seaweed.ensure_running()
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    url = f"s3://{seaweed.new_bucket()}/repo"
    Repository.init(url, cache_root=tmp_path / "c0", pack_target_size=PACK)
    done = _kill_after_puts(url, tmp_path, tree, put_count // 2, env=seaweed.env())
    assert not any(key.startswith("snapshots/") for key in done)
    m = rerun_reuses(url, tmp_path, tree)
    assert m["totals"]["new_chunks"] < m["totals"]["chunks"]
    verify(url, tmp_path, {m["id"]: tree})


# -- snapshot: the S3 server goes away ---------------------------------------------------------------

class _AfterPuts(FaultyStore):
    """Runs ``action`` (once) right after the ``n``-th successful put of a pack."""

    def __init__(self, inner: Store, n: int, action) -> None:
        super().__init__(inner)
        self.n = n
        self.action = action
        self.packs = 0
        self._mu = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        super().put(key, data)
        if key.startswith("packs/"):
            with self._mu:
                self.packs += 1
                fire = self.packs == self.n
            if fire:
                self.action()


@pytest.mark.s3
@pytest.mark.timeout(240)
def test_s3_server_stopped_mid_snapshot(tree, tmp_path, seaweed, monkeypatch):
    """Twice: an outage longer than the retries (clean failure, no manifest), then one the retries ride out."""
    seaweed.ensure_running()
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    url = f"s3://{seaweed.new_bucket()}/repo"
    Repository.init(url, cache_root=tmp_path / "c0", pack_target_size=PACK)
    try:
        # 1. the server dies after the third pack and stays down: a one-line StoreError, nothing committed
        gate = _AfterPuts(open_store(url, retry=False), 3, lambda: seaweed.stop(grace=0))
        repo = Repository.open(url, store=RetryingStore(gate, attempts=3, base_delay=0.05), cache_root=tmp_path / "c1")
        with pytest.raises(TransientError) as info:
            _snap(repo, tree)
        assert "\n" not in str(info.value) and not seaweed.running
        seaweed.start()
        assert Repository.open(url, cache_root=tmp_path / "c2").snapshot_ids() == []

        # 2. the server dies after the second pack and is back ~1 s later: the retries carry the snapshot through.
        # (start() runs on this thread: the server dies with the thread that started it, PR_SET_PDEATHSIG.)
        before = _pack_chunks(Repository.open(url, cache_root=tmp_path / "c3"))
        survived = set().union(*before.values())
        down = threading.Event()
        gate = _AfterPuts(open_store(url, retry=False), 2, lambda: (seaweed.stop(grace=0), down.set()))
        repo = Repository.open(url, store=RetryingStore(gate, attempts=40, base_delay=0.1, max_delay=1.0),
                               cache_root=tmp_path / "c4")
        result: dict = {}

        def run() -> None:
            try:
                result["manifest"] = _snap(repo, tree)
            except BaseException as exc:  # noqa: BLE001 - reported below
                result["error"] = exc

        worker = threading.Thread(target=run)
        worker.start()
        assert down.wait(120), "the snapshot never reached its second pack"
        time.sleep(1.0)
        assert worker.is_alive() and not result  # still retrying, not failed
        seaweed.start()
        worker.join(120)
        assert "error" not in result, result.get("error")
        m = result["manifest"]
        chunks = {c for c, *_ in Catalog(repo.catalog_path(m["id"])).all_blobs()}
        assert survived and m["totals"]["new_chunks"] == len(chunks - survived)  # run 1's packs were reused
        verify(url, tmp_path, {m["id"]: tree})
    finally:
        seaweed.ensure_running()


# -- the mount: the store goes away, the daemon is killed -------------------------------------------------

needs_fuse = pytest.mark.skipif(not os.path.exists("/dev/fuse") or os.geteuid() != 0, reason="needs /dev/fuse and root")


class _Mount:
    """``python -m ogrefs mount`` in a subprocess; :meth:`close` always leaves no mount behind."""

    def __init__(self, tmp: Path, url: str, env: dict[str, str] | None = None) -> None:
        self.url = url
        self.mp = tmp / "mnt"
        self.mp.mkdir(exist_ok=True)
        self.env = dict(os.environ, **(env or {}), OGREFS_RUNTIME_DIR=str(tmp / "run"),
                        OGREFS_CACHE_DIR=str(tmp / "xdg"))

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        res = subprocess.run([sys.executable, "-m", "ogrefs", "--repo", self.url, *args], env=self.env,
                             capture_output=True, text=True, timeout=120)
        assert not check or res.returncode == 0, f"ogrefs {args}: {res.stderr}"
        return res

    def mount(self, snap: str, *opts: str) -> Path:
        self.cli("mount", snap, str(self.mp), "--read-only", *opts)
        return self.mp

    def status(self) -> dict:
        """The daemon's status as written after this call (it rewrites it every 0.5 s)."""
        since = time.time()
        while True:
            st = json.loads(self.cli("status", str(self.mp), "--json").stdout)
            if st["time"] > since or time.time() > since + 30:
                return st
            time.sleep(0.2)

    def close(self) -> None:
        from ogrefs.box.mountsys import mounted_fstype

        if mounted_fstype(self.mp) is not None and self.cli("unmount", str(self.mp), check=False).returncode:
            subprocess.run(["umount", "-l", str(self.mp)], capture_output=True)


def _read(path: Path, result: dict) -> None:
    try:
        result["data"] = path.read_bytes()
    except OSError as exc:
        result["error"] = exc


@pytest.mark.s3
@pytest.mark.fuse
@needs_fuse
@pytest.mark.timeout(240)
def test_mount_read_fails_with_eio_after_the_retry_window_then_works_again(tmp_path, seaweed, monkeypatch):
    """The store is gone longer than --retry-for: EIO, not a hang; once it is back the same read succeeds."""
    seaweed.ensure_running()
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    url = f"s3://{seaweed.new_bucket()}/repo"
    repo = Repository.init(url, cache_root=tmp_path / "c0", pack_target_size=PACK)
    src = tmp_path / "src"
    src.mkdir()
    first, later = os.urandom(MiB), os.urandom(2 * MiB)
    (src / "first.bin").write_bytes(first)
    (src / "later.bin").write_bytes(later)
    m = _snap(repo, src)
    mnt = _Mount(tmp_path, url, seaweed.env())
    try:
        base = mnt.mount(m["id"], "--retry-for", "3") / str(src).lstrip("/")
        assert (base / "first.bin").read_bytes() == first
        seaweed.stop(grace=0)
        t0 = time.monotonic()
        result: dict = {}
        _read(base / "later.bin", result)
        waited = time.monotonic() - t0
        assert isinstance(result.get("error"), OSError) and result["error"].errno == 5, result  # EIO
        assert 2.5 <= waited < 60, f"failed after {waited:.1f} s with --retry-for 3"
        seaweed.start()
        again: dict = {}
        _read(base / "later.bin", again)
        assert again.get("data") == later, again.get("error")
        st = mnt.status()
        assert st["read_errors"] >= 1 and st["errors"] >= 1
    finally:
        seaweed.ensure_running()
        mnt.close()


@pytest.mark.fuse
@needs_fuse
@pytest.mark.timeout(180)
def test_mount_daemon_sigkill_then_remount_serves_correct_bytes(tree, tmp_path):
    """kill -9 of the daemon mid-read; unmount the dead mount; remount on the same chunk cache.

    The cache never holds half a chunk (write to tmp, fsync, rename), and a
    chunk damaged on disk behind its back is detected and fetched again.
    """
    from ogrefs.box.mountsys import mounted_fstype

    url = f"file://{tmp_path}/repo"
    repo = Repository.init(url, cache_root=tmp_path / "c0", pack_target_size=PACK)
    m = _snap(repo, tree)
    cache = tmp_path / "chunks"
    mnt = _Mount(tmp_path, url)
    try:
        base = mnt.mount(m["id"], "--cache-dir", str(cache)) / str(tree).lstrip("/")
        assert (base / "f01.bin").read_bytes() == (tree / "f01.bin").read_bytes()
        pid = mnt.status()["pid"]
        result: dict = {}
        reader = threading.Thread(target=_read, args=(base / "f00.bin", result))
        reader.start()
        time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        reader.join(60)
        assert not reader.is_alive()
        assert "error" in result or result.get("data") == (tree / "f00.bin").read_bytes()  # never wrong bytes
        assert mounted_fstype(mnt.mp) == "fuse.ogrefs"  # the dead mount is still there ...
        mnt.cli("unmount", str(mnt.mp))  # ... and unmount clears it
        assert mounted_fstype(mnt.mp) is None

        # every chunk the dead daemon left in the cache is whole
        cached = list((cache / "data").rglob("*"))
        files = [p for p in cached if p.is_file()]
        assert files, "the first read should have filled the cache"
        for p in files:
            assert blake3.blake3(p.read_bytes()).hexdigest() == p.name, f"half or wrong chunk {p}"
        # damage one behind the cache's back: the remounted daemon must notice, not serve it
        victim = files[0]
        victim.write_bytes(victim.read_bytes()[:1000])

        mnt.mount(m["id"], "--cache-dir", str(cache))
        for dirpath, _, names in os.walk(tree):
            for name in names:
                p = Path(dirpath) / name
                assert (base / p.relative_to(tree)).read_bytes() == p.read_bytes(), p
        assert mnt.status()["errors"] == 0
    finally:
        mnt.close()


# -- local disks that are full (small tmpfs mounts) ----------------------------------------------------


def _fill(path: Path) -> Path:
    """Fill the file system holding ``path`` (a filler file); returns the filler."""
    filler = path / "filler"
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass
    return filler


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_repository_disk_full_mid_snapshot_then_space_freed(tree, tmp_path, small_fs):
    """The file store's disk fills up during a snapshot: a one-line StoreError, no manifest; rerun after freeing space."""
    disk = small_fs(24 * MiB)
    url = f"file://{disk}/repo"
    Repository.init(url, cache_root=tmp_path / "c0", pack_target_size=PACK)
    ballast = disk / "ballast"
    ballast.write_bytes(b"\0" * (19 * MiB))  # about 5 MiB left: the ~10 MiB snapshot cannot fit
    repo = Repository.open(url, cache_root=tmp_path / "c1")
    with pytest.raises(StoreError) as info:
        _snap(repo, tree)
    assert "\n" not in str(info.value) and "space" in str(info.value).lower()
    assert Repository.open(url, cache_root=tmp_path / "c2").snapshot_ids() == []
    ballast.unlink()
    m = rerun_reuses(url, tmp_path, tree)
    assert m["totals"]["new_chunks"] < m["totals"]["chunks"]  # what fitted before was kept and reused
    verify(url, tmp_path, {m["id"]: tree})


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_restore_target_disk_full_leaves_no_wrong_file(tree, tmp_path, small_fs):
    """Restoring ~10 MiB into 4 MiB (the free-space check overridden, as --force does): files that do not
    fit are reported and removed, the others are exact."""
    url = f"file://{tmp_path}/repo"
    repo = Repository.init(url, cache_root=tmp_path / "c0", pack_target_size=PACK)
    m = _snap(repo, tree)
    disk = small_fs(4 * MiB)
    r = Restorer(Catalog(repo.catalog_path(m["id"])), repo.read_pack_range, os.fsencode(disk / "out"), workers=4,
                 check_space=False)
    r.run()
    assert r.failed and all("No space left" in why for why in r.failed.values())
    restored = disk / "out" / str(tree).lstrip("/")
    exact = 0
    for dirpath, _, names in os.walk(tree):
        for name in names:
            src = Path(dirpath) / name
            dst = restored / src.relative_to(tree)
            if os.fsencode(dst) in r.failed:
                assert not dst.exists()
            else:
                assert dst.read_bytes() == src.read_bytes(), dst
                exact += 1
    assert exact >= 1  # and no file holds wrong bytes


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_cache_disk_full_during_snapshot_is_a_clean_error(tree, tmp_path, small_fs):
    disk = small_fs(2 * MiB)
    url = f"file://{tmp_path}/repo"
    Repository.init(url, cache_root=tmp_path / "c0", pack_target_size=PACK)
    repo = Repository.open(url, cache_root=disk / "cache")
    repo.index  # the index cache fits; the snapshot's catalog will not, once the disk is full
    _fill(disk)
    with pytest.raises(OgrefsError) as info:  # one line naming the cache, never a sqlite3 traceback
        _snap(repo, tree)
    assert "local cache" in str(info.value) and "\n" not in str(info.value)
    # the repository lock is given back (in a long-lived process, the agent, a lock left held would be
    # refreshed for as long as it lives, and prune would wait on it)
    assert read_locks(repo.store, repo.meta_codec) == []
    assert not [t for t in threading.enumerate() if t.name == "ogrefs-lock" and t.is_alive()]


@pytest.mark.fuse
@needs_fuse
@pytest.mark.timeout(180)
def test_mount_chunk_cache_on_a_full_disk_still_serves_correct_bytes(tree, tmp_path, small_fs):
    """The chunk cache cannot be written (its disk is full): reads are served from the store, correctly."""
    url = f"file://{tmp_path}/repo"
    repo = Repository.init(url, cache_root=tmp_path / "c0", pack_target_size=PACK)
    m = _snap(repo, tree)
    disk = small_fs(1 * MiB)
    cache = disk / "chunks"
    mnt = _Mount(tmp_path, url)
    try:
        base = mnt.mount(m["id"], "--cache-dir", str(cache)) / str(tree).lstrip("/")
        _fill(disk)
        for dirpath, _, names in os.walk(tree):
            for name in names:
                p = Path(dirpath) / name
                assert (base / p.relative_to(tree)).read_bytes() == p.read_bytes(), p
        st = mnt.status()
        assert st["errors"] == 0 and st["read_errors"] == 0
        assert st["cache_write_errors"] >= 1
    finally:
        mnt.close()
