"""Trust under attack and faults (issue 14, items 3, 5, 6, 7, 9, 11, 15): cached objects verified,
bounded decompression, sealed metadata, one bad object never blocks a box, extents that lay out a file.

Real processes and a real file store throughout; the mount tests mount FUSE.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from ogrefs.repo import codec
from ogrefs.repo.catalog import Catalog
from ogrefs.lazy.fetch.chunkcache import ChunkCache
from ogrefs.repo import Repository
from ogrefs.repo.keys import Secret

from tests.cli_run import assert_one_line_error, run
from tests.treegen import compare_trees

MiB = 1024 * 1024
PW = "correct horse battery staple"
fuse = pytest.mark.skipif(not os.path.exists("/dev/fuse") and not os.environ.get("CI"), reason="no /dev/fuse here")


@pytest.fixture(params=["plain", "encrypted"])
def box(request, tmp_path) -> dict:
    """A repository with one snapshot of two files whose contents differ, and the env to use it."""
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("OGREFS_PASSWORD", None)
    if request.param == "encrypted":
        env["OGREFS_PASSWORD"] = PW
        run(["-q", "init", "--encrypt"], env)
    else:
        run(["-q", "init"], env)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(300_000))
    (src / "b.bin").write_bytes(os.urandom(300_000))
    snap = json.loads(run(["-q", "snapshot", "--json", str(src)], env).stdout)["id"]
    repo = _open(tmp_path, env)
    return {"env": env, "src": src, "snap": snap, "tmp": tmp_path, "repo": repo, "kind": request.param}


def _open(tmp_path: Path, env: dict, cache: str = "api-cache") -> Repository:
    secret = Secret(env["OGREFS_PASSWORD"].encode(), "scrypt") if env.get("OGREFS_PASSWORD") else None
    return Repository.open(env["OGREFS_REPO"], cache_root=tmp_path / cache, secret=secret)


def _swap_extents_in_cached_catalog(box: dict) -> Path:
    """Damage the box's cached catalog so that a.bin's extent points at b.bin's chunk: wrong bytes, valid SQLite."""
    cached = next((box["tmp"] / "cache" / "repos").glob(f"*/catalogs/{box['snap']}.sqlite"))
    db = sqlite3.connect(cached)
    a_ino, b_ino = (db.execute("SELECT d.ino FROM dirents d WHERE d.name=?", (n,)).fetchone()[0]
                    for n in (b"a.bin", b"b.bin"))
    b_blob = db.execute("SELECT blob FROM extents WHERE ino=?", (b_ino,)).fetchone()[0]
    db.execute("UPDATE extents SET blob=? WHERE ino=?", (b_blob, a_ino))
    db.commit()
    db.close()
    return cached


def _rel(src: Path) -> str:
    return str(src).lstrip("/")


# -- 14.3: every cached object is verified ------------------------------------------------------------
def test_damaged_cached_catalog_restore_check_and_incremental_snapshot(box):
    env, src, tmp = box["env"], box["src"], box["tmp"]
    run(["-q", "restore", "latest", str(tmp / "warm")], env)  # the catalog is in the cache now
    _swap_extents_in_cached_catalog(box)
    proc = run(["-q", "restore", "latest", str(tmp / "out")], env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "damaged" in proc.stderr  # refetched, and said so
    assert compare_trees(src, tmp / "out" / _rel(src)) == []
    _swap_extents_in_cached_catalog(box)
    check = json.loads(run(["check", "--read-data", "--json"], env).stdout)
    assert check["ok"]  # the store is fine: the damaged copy was fetched again, not believed
    _swap_extents_in_cached_catalog(box)
    (src / "c.txt").write_text("new file")
    new = json.loads(run(["-q", "snapshot", "--json", str(src)], env).stdout)["id"]  # reuses the parent's rows
    fresh = dict(env, OGREFS_CACHE_DIR=str(tmp / "fresh"))
    run(["-q", "restore", new, str(tmp / "out2")], fresh)
    assert compare_trees(src, tmp / "out2" / _rel(src)) == []


@pytest.mark.fuse
@fuse
def test_mount_never_serves_a_damaged_cached_catalog(box):
    from tests.mounter import Mounter

    env, src, tmp = box["env"], box["src"], box["tmp"]
    extra = {"OGREFS_PASSWORD": env["OGREFS_PASSWORD"]} if env.get("OGREFS_PASSWORD") else {}
    mounter = Mounter(tmp, env["OGREFS_REPO"], extra_env=extra)
    mounter.env["OGREFS_CACHE_DIR"] = env["OGREFS_CACHE_DIR"]  # the cache whose catalog is damaged
    run(["-q", "restore", "latest", str(tmp / "warm")], env)
    _swap_extents_in_cached_catalog(box)
    try:
        mp = mounter.mount(box["snap"], tmp / "mnt")
        assert (mp / _rel(src) / "a.bin").read_bytes() == (src / "a.bin").read_bytes()
    finally:
        mounter.cleanup()


def test_flipped_bit_in_cached_manifest_is_refetched(box):
    env, tmp = box["env"], box["tmp"]
    run(["-q", "snapshots"], env)
    cached = next((tmp / "cache" / "repos").glob(f"*/manifests/{box['snap']}"))
    body = bytearray(cached.read_bytes())
    body[len(body) // 2] ^= 0x10
    cached.write_bytes(bytes(body))
    listing = json.loads(run(["snapshots", "--json"], env).stdout)
    assert [s["id"] for s in listing] == [box["snap"]]
    run(["-q", "restore", "latest", str(tmp / "out")], env)
    assert compare_trees(box["src"], tmp / "out" / _rel(box["src"])) == []


def test_damaged_row_in_the_index_cache_is_never_used(box):
    """A flipped location in index.sqlite: the next snapshot stores the chunk again rather than point at it."""
    env, src, tmp = box["env"], box["src"], box["tmp"]
    index = next((tmp / "cache" / "repos").glob("*/index.sqlite"))
    db = sqlite3.connect(index)
    assert db.execute("UPDATE chunks SET offset = offset + 1").rowcount >= 2
    db.commit()
    db.close()
    other = tmp / "other"  # same content at other paths: no parent, dedup through the index alone
    other.mkdir()
    (other / "copy.bin").write_bytes((src / "a.bin").read_bytes())
    proc = run(["-q", "snapshot", "--json", str(other)], env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "damaged row" in proc.stderr
    fresh = dict(env, OGREFS_CACHE_DIR=str(tmp / "fresh"))
    run(["-q", "restore", "latest", str(tmp / "out")], fresh)
    assert compare_trees(other, tmp / "out" / _rel(other)) == []


# -- 14.7 and 14.11: one bad object never blocks a box ------------------------------------------------------
def _plant(repo: Repository, key: str, payload: bytes) -> None:
    """An object under ``key`` that is well enveloped for this repository but holds ``payload``."""
    repo.store.put(key, repo.codec.seal(key, payload) if repo.codec.encrypted else codec.wrap(payload))


@pytest.mark.parametrize("what", ["manifest", "index", "trash"])
def test_one_stray_or_damaged_object_is_skipped_and_named(box, what):
    env, src, tmp, repo = box["env"], box["src"], box["tmp"], box["repo"]
    key = {"manifest": "snapshots/" + "ab" * 32, "index": "index/stray", "trash": "trash/" + "cd" * 16}[what]
    repo.store.put(key, b"OGRF\x01\x01" + os.urandom(200))  # damaged: fails its digest / authentication
    (src / "more.txt").write_text("x")
    proc = run(["-q", "snapshot", "--json", str(src)], env, check=False)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and key.split("/")[1][:12] in warnings[0] and "Traceback" not in proc.stderr
    assert "repository" not in warnings[0].split(":")[0]
    proc = run(["-q", "restore", "latest", str(tmp / "out")], env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert compare_trees(src, tmp / "out" / _rel(src)) == []


@pytest.mark.fuse
@fuse
def test_mount_latest_with_a_stray_manifest_index_and_trash_object(box):
    from tests.mounter import Mounter

    env, src, tmp, repo = box["env"], box["src"], box["tmp"], box["repo"]
    for key in ("snapshots/" + "ab" * 32, "index/stray", "trash/" + "cd" * 16):
        repo.store.put(key, b"OGRF\x01\x01" + os.urandom(200))
    extra = {"OGREFS_PASSWORD": env["OGREFS_PASSWORD"]} if env.get("OGREFS_PASSWORD") else {}
    mounter = Mounter(tmp, env["OGREFS_REPO"], extra_env=extra)
    try:
        mp = mounter.mount("latest", tmp / "mnt")
        assert (mp / _rel(src) / "b.bin").read_bytes() == (src / "b.bin").read_bytes()
    finally:
        mounter.cleanup()


@pytest.mark.parametrize("body", [b'{"packs": "nope"}', b'{"packs": {"PACK": "yesterday"}}', b"[1, 2",
                                  b'{"packs": {"PACK": 1e999}}', b'{"packs": {"PACK": 1}, "readers": 5}'])
def test_malformed_trash_record_is_reported_and_deletes_nothing(box, body):
    env, src, tmp, repo = box["env"], box["src"], box["tmp"], box["repo"]
    packs = {k.rsplit("/", 1)[1] for k in repo.store.list("packs/")}
    _plant(repo, "trash/" + "ee" * 16, body.replace(b"PACK", next(iter(packs)).encode()))
    proc = run(["-q", "snapshot", str(src)], env, check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "trash/" + "ee" * 16 in proc.stderr
    proc = run(["prune", "--json"], env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "trash/" + "ee" * 16 in proc.stderr
    assert json.loads(proc.stdout)["deleted"] == 0
    assert packs <= {k.rsplit("/", 1)[1] for k in repo.store.list("packs/")}
    run(["-q", "restore", box["snap"], str(tmp / "out")], env)
    assert (tmp / "out" / _rel(src) / "a.bin").read_bytes() == (src / "a.bin").read_bytes()
    _plant(repo, "trash/" + "ef" * 16, body.replace(b"PACK", next(iter(packs)).encode()))
    check = run(["check"], env, check=False)
    assert check.returncode != 0 and "trash/" + "ef" * 16 in check.stdout + check.stderr


# -- 14.5: bounded decompression --------------------------------------------------------------------------
def _bomb(size: int, with_size: bool = True) -> bytes:
    """A zstd frame of ``size`` zero bytes, made without holding them (tens of KB for a GiB)."""
    comp = zstandard.ZstdCompressor(level=3, write_content_size=with_size)
    zero = bytes(MiB)
    chunks = comp.chunker(size=size if with_size else -1, chunk_size=1 << 20)
    out = []
    for _ in range(size // MiB):
        out.extend(chunks.compress(zero))
    out.extend(chunks.finish())
    return b"".join(out)


@pytest.fixture(scope="module")
def gib_bomb() -> bytes:
    return _bomb(1024 * MiB)


def _max_rss_mib(args: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float]:
    wrapper = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
               "sys.stderr.write(p.stderr); sys.stdout.write(p.stdout); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(p.returncode)")
    proc = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-m", "ogrefs", *args], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    rss = int(lines[-1]) / 1024
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout, "\n".join(lines[:-1])), rss


def _envelope(repo: Repository, key: str, frame: bytes) -> bytes:
    """An envelope for ``key`` whose payload is ``frame`` (a zstd bomb), sealed when the repository is encrypted."""
    if repo.codec.encrypted:
        header = codec.ENVELOPE_MAGIC + bytes([codec.ENVELOPE_VERSION, codec.CODEC_ZSTD | codec.ENCRYPTED_FLAG])
        return header + repo.codec._seal(frame, header + key.encode())
    return codec.ENVELOPE_MAGIC + bytes([codec.ENVELOPE_VERSION, codec.CODEC_ZSTD]) + bytes(32) + frame


@pytest.mark.parametrize("where", ["index", "manifest", "trash", "lock"])
def test_decompression_bombs_are_refused_before_they_inflate(box, gib_bomb, where):
    env, src, repo = box["env"], box["src"], box["repo"]
    if where == "trash" and not repo.config.sealed_metadata and box["kind"] == "encrypted":
        pytest.skip("unreachable")
    key = {"index": "index/bomb", "manifest": "snapshots/" + "ab" * 32, "trash": "trash/" + "cd" * 16,
           "lock": "locks/" + "ef" * 16}[where]
    sealer = repo if where in ("index", "manifest") or repo.config.sealed_metadata else None
    repo.store.put(key, _envelope(sealer, key, gib_bomb) if sealer else
                   codec.ENVELOPE_MAGIC + bytes([codec.ENVELOPE_VERSION, codec.CODEC_ZSTD]) + bytes(32) + gib_bomb)
    (src / "more.txt").write_text("x")
    proc, rss = _max_rss_mib(["-q", "snapshot", str(src)], env)
    assert proc.returncode == 0, proc.stderr
    assert rss < 400, f"{rss:.0f} MiB"  # the bomb would take 1024
    proc, rss = _max_rss_mib(["prune", "-n"], env)
    assert "Traceback" not in proc.stderr and rss < 400, (proc.stderr, rss)


def test_forged_pack_blob_cannot_make_restore_allocate(box, gib_bomb):
    """A blob replaced by a zstd frame claiming 1 GiB: restore refuses it and stays small."""
    env, tmp, repo = box["env"], box["tmp"], box["repo"]
    if repo.codec.encrypted:
        pytest.skip("an encrypted blob is authenticated before anything inflates")
    cat = Catalog(repo.catalog_path(box["snap"]))
    ext = cat.extents(cat.resolve(os.fsencode(box["src"] / "a.bin")).ino)[0]
    pack = Path(repo.store.url[len("file://"):]) / "packs" / ext.pack[:2] / ext.pack
    body = pack.read_bytes()
    forged = bytes([codec.CODEC_ZSTD]) + gib_bomb[:ext.stored_len - 1]
    pack.write_bytes(body[:ext.pack_offset] + forged.ljust(ext.stored_len, b"\0") + body[ext.pack_offset + ext.stored_len:])
    proc, rss = _max_rss_mib(["-q", "restore", "latest", str(tmp / "out")], env)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert rss < 400, f"{rss:.0f} MiB"


def test_locks_and_trash_records_are_sealed_in_encrypted_repositories(tmp_path):
    from ogrefs.maint.prune import prune
    from ogrefs.repo.trash import load_trash
    from ogrefs.repo.locks import LockInfo, _encode, read_locks
    from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot

    repo = Repository.init(str(tmp_path / "repo"), cache_root=tmp_path / "c", secret=Secret(b"pw", "scrypt"),
                           pack_target_size=MiB)
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(os.urandom(2 * MiB))
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    with repo.lock("shared", "snapshot"):
        (key,) = list(repo.store.list("locks/"))
        obj = repo.store.get(key)
        assert obj[5] & codec.ENCRYPTED_FLAG and b"snapshot" not in obj and b"pid" not in obj
        repo.store.delete(f"snapshots/{m['id']}")
        repo.store.delete(f"catalogs/{m['id']}")
        prune(repo)  # the lock defers: a trash record is written
    (trash_key,) = list(repo.store.list("trash/"))
    assert repo.store.get(trash_key)[5] & codec.ENCRYPTED_FLAG
    assert load_trash(repo).marked
    # a lock planted without the key is not a lock here
    planted = LockInfo("ab" * 16, "prune", "prune", "evil", 1, 9e12, 9e12)
    repo.store.put(f"locks/{planted.id}", _encode(planted))
    assert read_locks(repo.store, repo.meta_codec) == []
    assert len(read_locks(repo.store)) == 1  # as an unencrypted reader would have taken it


# -- 14.6: pack headers are sealed ------------------------------------------------------------------------------
def test_pack_headers_are_sealed_and_version_1_repositories_stay_readable(tmp_path):
    from ogrefs.maint.check import check_repository
    from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot

    src = tmp_path / "src"
    src.mkdir()
    sizes = [1234, 56789, 4242]
    for i, n in enumerate(sizes):
        (src / f"small{i}").write_bytes(os.urandom(n))
    secret = Secret(b"pw", "scrypt")
    repo = Repository.init(str(tmp_path / "repo"), cache_root=tmp_path / "c", secret=secret)
    take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    (pack,) = [p for p in (tmp_path / "repo" / "packs").rglob("*") if p.is_file()]
    body = pack.read_bytes()
    assert body[-8:] == b"OGRFPK02"
    header_len = int.from_bytes(body[-12:-8], "little")
    with pytest.raises(zstandard.ZstdError):
        zstandard.ZstdDecompressor().decompress(body[-12 - header_len:-12])
    for n in sizes:  # no blob size can be read from the pack without the key
        assert n.to_bytes(4, "little") not in body[-12 - header_len:]
    assert check_repository(repo, read_data=True).problems == []
    # a version 1 encrypted repository (plaintext pack headers, no MAC) is read and written as before
    cfg = json.loads((tmp_path / "repo" / "config").read_text())
    cfg.update(version=1)
    cfg.pop("mac")
    (tmp_path / "repo" / "config").write_text(json.dumps(cfg))
    old = Repository.open(str(tmp_path / "repo"), cache_root=tmp_path / "other-box", secret=secret)
    (src / "new").write_bytes(os.urandom(999))
    take_snapshot(old, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    headers = sorted(p.read_bytes()[-8:] for p in (tmp_path / "repo" / "packs").rglob("*") if p.is_file())
    assert headers == [b"OGRFPK01", b"OGRFPK02"]
    assert check_repository(old, read_data=True).problems == []
    with pytest.raises(Exception, match="lost its MAC"):  # the box that knew the MAC refuses the old config
        Repository.open(str(tmp_path / "repo"), cache_root=tmp_path / "c", secret=secret)


# -- 14.9: extents must lay out the file ------------------------------------------------------------------------
@pytest.mark.parametrize("forgery", ["beyond the file's size", "longer than its chunk", "overlapping"])
def test_catalog_whose_extents_do_not_lay_out_a_file_is_refused(tmp_path, forgery):
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("OGREFS_PASSWORD", None)
    run(["-q", "init"], env)
    src = tmp_path / "src"
    src.mkdir()
    (src / "six").write_bytes(b"sixsix")
    (src / "big").write_bytes(os.urandom(600_000))
    snap = json.loads(run(["-q", "snapshot", "--json", str(src)], env).stdout)["id"]
    repo = Repository.open(env["OGREFS_REPO"], cache_root=tmp_path / "c2")
    path = tmp_path / "forged.sqlite"
    path.write_bytes(Path(repo.catalog_path(snap)).read_bytes())
    db = sqlite3.connect(path)
    six = db.execute("SELECT ino FROM dirents WHERE name=?", (b"six",)).fetchone()[0]
    big = db.execute("SELECT ino FROM dirents WHERE name=?", (b"big",)).fetchone()[0]
    if forgery == "beyond the file's size":  # a 6-byte file whose one extent sits at 1 TiB
        db.execute("UPDATE extents SET offset=? WHERE ino=?", (2**40, six))
        db.execute("UPDATE inodes SET size=6 WHERE ino=?", (six,))
    elif forgery == "longer than its chunk":
        db.execute("UPDATE extents SET length=length+1000 WHERE ino=?", (six,))
        db.execute("UPDATE inodes SET size=size+1000 WHERE ino=?", (six,))
    else:
        (first,) = db.execute("SELECT min(offset) FROM extents WHERE ino=?", (big,)).fetchone()
        db.execute("INSERT INTO extents SELECT ino, offset+3, length, blob FROM extents WHERE ino=? AND offset=?",
                   (big, first))
    db.commit()
    db.close()
    repo.store.put(f"catalogs/{snap}", codec.wrap(path.read_bytes()))
    check = run(["check", "--read-data"], env, check=False)
    assert check.returncode != 0 and "do not lay out" in check.stdout + check.stderr
    out = tmp_path / "out"
    proc = run(["-q", "restore", snap, str(out)], env, check=False)
    assert_one_line_error(proc, "do not lay out")
    assert not any(f.is_file() and f.stat().st_size > 1_000_000 for f in out.rglob("*")) if out.exists() else True


# -- 14.15: the chunk cache is private ---------------------------------------------------------------------------
def test_chunk_cache_and_its_lru_database_are_private(tmp_path):
    old = os.umask(0o022)
    try:
        cache = ChunkCache(tmp_path / "chunks", 10 * MiB)
        data = os.urandom(1000)
        cache.store(codec.chunk_id(data), data)
        cache.flush()
    finally:
        os.umask(old)
    root = tmp_path / "chunks"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    files = [p for p in root.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"lru.sqlite", "lru.sqlite-wal"}
    for p in files:
        assert p.stat().st_mode & 0o077 == 0, p
    for p in root.rglob("*"):
        if p.is_dir():
            assert stat.S_IMODE(p.stat().st_mode) == 0o700, p
