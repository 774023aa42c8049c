"""Encryption at rest: keys, wrong passphrases, tampering, swapped objects (CLI, real processes)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ogrefs import codec
from ogrefs.repo import Repository
from ogrefs.repo.keys import Secret

from .test_cli import assert_one_line_error, run
from .treegen import compare_trees

MARKER = b"OGREFS-PLAINTEXT-MARKER-" * 100


@pytest.fixture
def enc(tmp_path) -> dict:
    e = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"),
             OGREFS_PASSWORD="correct horse battery staple")
    run(["init", "--encrypt"], e)
    return e


def _src(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "secret.txt").write_bytes(MARKER)
    (src / "ssh_key").write_text("-----BEGIN OPENSSH PRIVATE KEY----- not really\n")
    (src / "weights.bin").write_bytes(os.urandom(2 * 1024 * 1024))
    return src


def test_roundtrip_and_nothing_readable_at_rest(tmp_path, enc):
    src = _src(tmp_path)
    snap = json.loads(run(["snapshot", "--json", str(src)], enc).stdout)
    run(["restore", "latest", str(tmp_path / "out")], enc)
    assert compare_trees(src, tmp_path / "out" / str(src).lstrip("/")) == []
    assert json.loads(run(["check", "--read-data", "--json"], enc).stdout)["ok"]
    # no object holds the plaintext, the path names, or the unkeyed chunk id
    plain_id = codec.chunk_id(MARKER)
    for f in (tmp_path / "repo").rglob("*"):
        if f.is_file():
            body = f.read_bytes()
            assert MARKER[:24] not in body and b"secret.txt" not in body and plain_id not in body, f
            assert b"OPENSSH" not in body
    cfg = json.loads((tmp_path / "repo" / "config").read_text())
    assert cfg["encryption"] == "aes-256-gcm"
    assert snap["paths"] == [str(src)]


def test_keyed_chunk_ids_differ_between_repositories(tmp_path):
    a = Repository.init(str(tmp_path / "a"), cache_root=tmp_path / "c", secret=Secret(b"pw", "scrypt"))
    b = Repository.init(str(tmp_path / "b"), cache_root=tmp_path / "c", secret=Secret(b"pw", "scrypt"))
    assert a.codec.chunk_id(b"x") != b.codec.chunk_id(b"x") != codec.chunk_id(b"x")


def test_wrong_passphrase_fails_at_once(tmp_path, enc):
    wrong = dict(enc, OGREFS_PASSWORD="wrong")
    assert_one_line_error(run(["snapshots"], wrong, check=False), "wrong passphrase")
    none = dict(enc)
    none.pop("OGREFS_PASSWORD")
    assert_one_line_error(run(["snapshots"], none, check=False), "repository is encrypted")


def test_tampered_and_swapped_objects_are_detected(tmp_path, enc):
    src = _src(tmp_path)
    a = json.loads(run(["snapshot", "--json", str(src)], enc).stdout)["id"]
    (src / "more").write_text("x")
    b = json.loads(run(["snapshot", "--json", str(src)], enc).stdout)["id"]
    repo = tmp_path / "repo"
    # a swapped manifest: B's object put under A's key
    (repo / "snapshots" / a).write_bytes((repo / "snapshots" / b).read_bytes())
    fresh = dict(enc, OGREFS_CACHE_DIR=str(tmp_path / "cache2"))
    assert_one_line_error(run(["show", a], fresh, check=False), "authentication failed")
    # a flipped bit inside a blob of a pack: the file it holds fails, nothing wrong is written
    from ogrefs.catalog import Catalog
    from ogrefs.repo.keys import Secret

    r = Repository.open(str(repo), cache_root=tmp_path / "cache3", secret=Secret(enc["OGREFS_PASSWORD"].encode(), "scrypt"))
    cat = Catalog(r.catalog_path(b))
    ext = cat.extents(cat.resolve(os.fsencode(src / "weights.bin")).ino)[0]
    pack = repo / "packs" / ext.pack[:2] / ext.pack
    body = bytearray(pack.read_bytes())
    body[ext.pack_offset + ext.stored_len // 2] ^= 1
    pack.write_bytes(bytes(body))
    proc = run(["restore", b, str(tmp_path / "out")], fresh, check=False)
    assert proc.returncode != 0 and "authentication failed" in proc.stderr
    check = run(["check", "--read-data"], fresh, check=False)
    assert check.returncode != 0 and "authentication failed" in check.stderr


def test_key_add_list_remove_and_key_file(tmp_path, enc):
    keyfile = tmp_path / "raw.key"
    keyfile.write_bytes(os.urandom(64))
    run(["key", "add", "--label", "laptop"], dict(enc, OGREFS_NEW_PASSWORD="second passphrase"))
    run(["key", "add", "--new-key-file", str(keyfile), "--label", "ci"], enc)
    keys = json.loads(run(["key", "list", "--json"], enc).stdout)
    assert len(keys) == 3 and sum(k["current"] for k in keys) == 1
    by_file = dict(enc, OGREFS_KEY_FILE=str(keyfile))
    by_file.pop("OGREFS_PASSWORD")
    assert json.loads(run(["snapshots", "--json"], by_file).stdout) == []
    second = dict(enc, OGREFS_PASSWORD="second passphrase")
    first_id = next(k["id"] for k in keys if k["current"])
    assert_one_line_error(run(["key", "remove", first_id], enc, check=False), "used to open")
    run(["key", "remove", first_id], second)
    assert_one_line_error(run(["snapshots"], enc, check=False), "wrong passphrase")
    assert run(["snapshots"], second).returncode == 0


def test_replaced_plaintext_config_is_refused(tmp_path, enc):
    cfg_path = tmp_path / "repo" / "config"
    cfg = json.loads(cfg_path.read_text())
    cfg["encryption"] = None
    cfg_path.write_text(json.dumps(cfg))
    assert_one_line_error(run(["snapshots"], enc, check=False), "key objects exist")


@pytest.mark.fuse
@pytest.mark.skipif(not os.path.exists("/dev/fuse") and not os.environ.get("CI"), reason="no /dev/fuse here")
def test_encrypted_chunk_cache(tmp_path):
    """--encrypt-cache: nothing in the local cache is readable, and a remount is still served from it."""
    from ogrefs.snapshot import SnapshotOptions, take_snapshot

    from .test_mount import Mounter, under

    repo = Repository.init(f"file://{tmp_path}/enc", cache_root=tmp_path / "xdg", secret=Secret(b"pw", "scrypt"))
    src = _src(tmp_path)
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)]))
    mounter = Mounter(tmp_path, repo.store.url, extra_env={"OGREFS_PASSWORD": "pw"})
    chunks = tmp_path / "chunks"
    try:
        mp = mounter.mount(m["id"], tmp_path / "mnt", "--cache-dir", str(chunks), "--encrypt-cache")
        assert (under(mp, src) / "secret.txt").read_bytes() == MARKER
        mounter.unmount(mp)
        files = [f for f in (chunks / "data").rglob("*") if f.is_file()]
        assert files and not any(MARKER[:24] in f.read_bytes() for f in files)
        assert all(f.stat().st_mode & 0o077 == 0 for f in files)
        mounter.mount(m["id"], mp, "--cache-dir", str(chunks), "--encrypt-cache")
        assert (under(mp, src) / "secret.txt").read_bytes() == MARKER
        st = mounter.status(mp)
        assert st["bytes_fetched"] == 0 and st["cache_hits_disk"] >= 1
        mounter.unmount(mp)
    finally:
        mounter.cleanup()
    plain = Repository.init(f"file://{tmp_path}/plain", cache_root=tmp_path / "xdg2")
    m2 = take_snapshot(plain, SnapshotOptions(paths=[os.fsencode(src)]))
    other = Mounter(tmp_path, plain.store.url)
    (tmp_path / "mnt2").mkdir()
    res = other.cli("mount", m2["id"], str(tmp_path / "mnt2"), "--read-only", "--encrypt-cache", check=False)
    assert res.returncode == 2 and "needs an encrypted repository" in res.stderr
