"""Encryption at rest: keys, wrong passphrases, tampering, swapped objects (CLI, real processes)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ogrefs.repo import codec
from ogrefs.repo import Repository
from ogrefs.repo.keys import Secret

from tests.cli_run import assert_one_line_error, run
from tests.treegen import compare_trees

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
    from ogrefs.repo.catalog import Catalog
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


def _plaintext_config(repo: Path) -> None:
    """What an attacker with write access to the bucket (and no key) writes: a plausible version 1 config."""
    cfg = json.loads((repo / "config").read_text())
    cfg.update(encryption=None, version=1)
    cfg.pop("mac", None)
    (repo / "config").write_text(json.dumps(cfg))


def test_replaced_plaintext_config_is_refused(tmp_path, enc):
    _plaintext_config(tmp_path / "repo")
    assert_one_line_error(run(["snapshots"], enc, check=False), "refusing")
    fresh = dict(enc, OGREFS_CACHE_DIR=str(tmp_path / "fresh"))
    fresh.pop("OGREFS_PASSWORD")
    assert_one_line_error(run(["snapshots"], fresh, check=False), "key objects exist")


@pytest.mark.parametrize("who", ["password given, fresh box", "box that knew it, no password"])
def test_encryption_cannot_be_downgraded_without_the_key(tmp_path, enc, who):
    """Keys, index and snapshots moved aside and the config set to plaintext: nothing plaintext is uploaded."""
    src = _src(tmp_path)
    run(["snapshot", str(src)], enc)
    repo = tmp_path / "repo"
    aside = tmp_path / "aside"
    aside.mkdir()
    for d in ("keys", "index", "snapshots"):
        (repo / d).rename(aside / d)
    _plaintext_config(repo)
    before = {f for f in repo.rglob("*") if f.is_file()}
    env = dict(enc)
    if who.startswith("password"):
        env["OGREFS_CACHE_DIR"] = str(tmp_path / "fresh-cache")
    else:
        env.pop("OGREFS_PASSWORD")
    proc = run(["snapshot", str(src)], env, check=False)
    assert_one_line_error(proc, "refusing")
    assert {f for f in repo.rglob("*") if f.is_file()} == before  # nothing was uploaded
    assert not any(MARKER[:24] in f.read_bytes() for f in repo.rglob("*") if f.is_file())


def test_altered_encrypted_config_fails_its_mac(tmp_path, enc):
    cfg_path = tmp_path / "repo" / "config"
    cfg = json.loads(cfg_path.read_text())
    assert cfg["version"] == 2 and len(cfg["mac"]) == 64
    cfg["compression_level"] = 19
    cfg_path.write_text(json.dumps(cfg))
    assert_one_line_error(run(["snapshots"], enc, check=False), "fails its MAC")


def test_init_encrypt_refuses_an_empty_password(tmp_path):
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("OGREFS_PASSWORD", None)
    (tmp_path / "pw").write_text("\n")
    proc = run(["--password-file", str(tmp_path / "pw"), "init", "--encrypt"], env, check=False)
    assert_one_line_error(proc, "is empty")
    assert not (tmp_path / "repo" / "config").exists()
    from ogrefs.errors import UsageError

    with pytest.raises(UsageError, match="empty passphrase"):  # nor can any other path wrap the key with ""
        Repository.init(str(tmp_path / "repo2"), cache_root=tmp_path / "c", secret=Secret(b"", "scrypt"))
    assert not (tmp_path / "repo2" / "config").exists()
