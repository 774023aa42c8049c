"""ls, find, dump, stats, cat, copy, tag through the real entry point, on file and S3 repositories."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from tests.cli_run import assert_one_line_error
from tests.treegen import compare_trees


def ogrefs(args: list[str], env: dict, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "ogrefs", *args], env=env, capture_output=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"ogrefs {' '.join(args)} failed ({proc.returncode}): {proc.stderr.decode()}")
    return proc


def out(args: list[str], env: dict) -> str:
    return ogrefs(args, env).stdout.decode()


@pytest.fixture
def box(tmp_path, store_url):
    """A repository (file or S3) with one snapshot of a small tree: files, a hole, links."""
    env = dict(os.environ, OGREFS_REPO=store_url, OGREFS_CACHE_DIR=str(tmp_path / "cache"))
    src = tmp_path / "src"
    (src / "code" / "pkg").mkdir(parents=True)
    (src / "code" / "train.py").write_text("print('train')\n")
    (src / "code" / "pkg" / "util.py").write_text("x = 1\n")
    (src / "weights.bin").write_bytes(os.urandom(2_500_000))
    with open(src / "sparse", "wb") as fh:
        fh.write(b"head")
        fh.seek(3_000_000)
        fh.write(b"tail")
    os.link(src / "weights.bin", src / "weights.hardlink")
    os.symlink("code/train.py", src / "latest.py")
    ogrefs(["init"], env)
    snap = json.loads(out(["snapshot", "--json", str(src)], env))
    return env, src, snap


def test_ls_lists_the_tree_a_path_and_long_and_json(box):
    env, src, snap = box
    names = out(["ls", "latest"], env).splitlines()
    for rel in ("code", "code/train.py", "code/pkg/util.py", "weights.bin", "sparse", "latest.py"):
        assert f"{src}/{rel}" in names
    direct = out(["ls", snap["id"][:8], f"{src}/code"], env).splitlines()
    assert direct == [f"{src}/code", f"{src}/code/pkg", f"{src}/code/train.py"]  # not recursive with a path
    assert f"{src}/code/pkg/util.py" in out(["ls", "latest", f"{src}/code", "--recursive"], env).splitlines()
    long = out(["ls", "-l", "latest", f"{src}/code"], env)
    assert "-rw-r--r--" in long and " 15 " in long and f"{src}/code/train.py" in long
    link = [line for line in out(["ls", "--long", "latest"], env).splitlines() if "latest.py" in line][0]
    assert link.startswith("l") and link.endswith("-> code/train.py")
    lines = [json.loads(x) for x in out(["ls", "--json", "latest", f"{src}/weights.bin"], env).splitlines()]
    assert lines[0]["struct_type"] == "snapshot" and lines[0]["id"] == snap["id"]
    assert lines[1]["path"] == f"{src}/weights.bin" and lines[1]["size"] == 2_500_000 and lines[1]["type"] == "file"
    assert_one_line_error(_text(ogrefs(["ls", "latest", f"{src}/nope"], env, check=False)), "no such path")


def _text(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode())


def test_find_searches_every_snapshot(box):
    env, src, snap = box
    (src / "code" / "eval.py").write_text("print('eval')\n")
    second = json.loads(out(["snapshot", "--json", str(src)], env))
    found = json.loads(out(["find", "--json", "*.py"], env))
    by_snap = {r["snapshot"]: sorted(m["path"] for m in r["matches"]) for r in found}
    assert by_snap[snap["id"]] == sorted([f"{src}/code/train.py", f"{src}/code/pkg/util.py", f"{src}/latest.py"])
    assert f"{src}/code/eval.py" in by_snap[second["id"]]
    human = out(["find", "eval.py"], env)
    assert second["id"][:12] in human and snap["id"][:12] not in human
    only = json.loads(out(["find", "--json", "-s", snap["id"][:10], f"{src}/code/*"], env))  # a / matches the path
    assert [r["hits"] for r in only] == [3]


def test_dump_writes_a_file_or_a_tar(box, tmp_path):
    env, src, snap = box
    assert ogrefs(["dump", "latest", f"{src}/weights.bin"], env).stdout == (src / "weights.bin").read_bytes()
    assert ogrefs(["dump", "latest", f"{src}/sparse"], env).stdout == (src / "sparse").read_bytes()
    tar_bytes = ogrefs(["dump", "latest", str(src)], env).stdout
    dest = tmp_path / "untar"
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        tar.extractall(dest, filter="fully_trusted")
    assert compare_trees(src, dest / str(src).lstrip("/"), times=False, check_holes=False) == []
    assert os.stat(dest / str(src).lstrip("/") / "weights.hardlink").st_ino == \
        os.stat(dest / str(src).lstrip("/") / "weights.bin").st_ino
    proc = _text(ogrefs(["dump", "latest", f"{src}/missing"], env, check=False))
    assert_one_line_error(proc, "no such path")


def test_dump_of_a_directory_carries_xattrs_as_gnu_tar_reads_them(box, tmp_path):
    """SCHILY.xattr.NAME records with the raw value (binary too, no hdrcharset), names escaped as GNU tar's."""
    env, src, _snap = box
    odd = os.fsencode(src) + b"/caf\xc3\xa9-" + b"n" * 120  # a long non-ASCII name: the pax path record
    with open(odd, "wb") as fh:
        fh.write(b"odd")
    attrs = {src / "code" / "train.py": {b"user.note": b"a=b%c", b"user.bin": b"\x00\xff\x01\n", b"user.k=v%": b"1"},
             src / "code": {b"user.dir": b"yes"}, odd: {b"user.odd": b"\xfe"}}
    for path, items in attrs.items():
        for name, value in items.items():
            os.setxattr(path, name, value)
    ogrefs(["snapshot", str(src)], env)
    tar_bytes = ogrefs(["dump", "latest", str(src)], env).stdout
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        seen = {m.name.encode("utf-8", "surrogateescape"): {k.encode(): v.encode("utf-8", "surrogateescape")
                                                             for k, v in m.pax_headers.items()} for m in tar}
    assert "hdrcharset" not in {k.decode() for h in seen.values() for k in h}
    rel = os.fsencode(src).lstrip(b"/")
    assert seen[rel + b"/code/train.py"][b"SCHILY.xattr.user.bin"] == b"\x00\xff\x01\n"
    assert seen[rel + b"/code/train.py"][b"SCHILY.xattr.user.k%3Dv%25"] == b"1"
    assert seen[rel + b"/code"][b"SCHILY.xattr.user.dir"] == b"yes"
    assert b"SCHILY.xattr.user.dir" not in seen[rel + b"/weights.bin"]
    dest = tmp_path / "gnutar"
    dest.mkdir()
    proc = subprocess.run(["tar", "--xattrs", "--xattrs-include=*", "-xf", "-", "-C", str(dest)], input=tar_bytes,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr  # no warning about unknown keywords
    for path, items in attrs.items():
        back = os.fsencode(dest) + b"/" + os.fsencode(path).lstrip(b"/")
        assert {n: os.getxattr(back, n) for n in os.listxattr(back) if n.startswith("user.")} == \
            {n.decode(): v for n, v in items.items()}
    assert open(os.fsencode(dest) + odd, "rb").read() == b"odd"


def test_stats_in_both_modes(box):
    env, src, snap = box
    st = json.loads(out(["stats", "--json"], env))
    assert st["mode"] == "restore-size" and st["snapshots"] == 1
    assert st["total_size"] == 2_500_000 + 15 + 6 + 3_000_004  # what a restore writes: a hard link once
    raw = json.loads(out(["stats", "--mode", "raw", "--json", snap["id"][:8]], env))
    assert raw["total_blob_count"] >= 3 and 2_500_000 < raw["total_size"] < 2_600_000
    assert raw["total_stored_size"] > 0
    assert "total size" in out(["stats"], env)


def test_cat_config_snapshot_and_a_verified_chunk(box):
    env, src, snap = box
    assert json.loads(out(["cat", "config"], env))["format"] == "ogrefs-repository"
    assert json.loads(out(["cat", "snapshot", snap["id"][:8]], env))["id"] == snap["id"]
    ls = [json.loads(x) for x in out(["ls", "--json", "latest", f"{src}/code/train.py"], env).splitlines()]
    assert ls[1]["size"] == 15
    index_names = [k for k in os.listdir(env["OGREFS_REPO"][7:] + "/index")] if env["OGREFS_REPO"].startswith(
        "file://") else []
    if index_names:
        rows = json.loads(out(["cat", "index", index_names[0]], env))
        chunk = rows[0]["chunk"]
        data = ogrefs(["cat", "blob", chunk], env).stdout
        assert len(data) == rows[0]["raw_len"]
    assert_one_line_error(_text(ogrefs(["cat", "snapshot"], env, check=False)), "needs a name")


def test_tag_add_remove_set_gives_a_new_id(box, tmp_path):
    env, src, snap = box
    changed = json.loads(out(["tag", "latest", "--add", "keep", "--add", "gpu", "--json"], env))["changed"]
    assert changed[0]["old"] == snap["id"] and changed[0]["tags"] == ["keep", "gpu"]
    new = changed[0]["new"]
    listing = json.loads(out(["snapshots", "--json"], env))
    assert [(s["id"], s["tags"]) for s in listing] == [(new, ["keep", "gpu"])]
    assert json.loads(out(["show", "--json", new[:8]], env))["original"] == snap["id"]
    third = json.loads(out(["tag", new[:8], "--remove", "gpu", "--json"], env))["changed"][0]
    assert third["tags"] == ["keep"]
    fourth = json.loads(out(["tag", "latest", "--set", "release", "--json"], env))["changed"][0]
    assert fourth["tags"] == ["release"]
    assert json.loads(out(["show", "--json", "latest"], env))["original"] == snap["id"]
    ogrefs(["restore", "latest", str(tmp_path / "out")], env)
    assert compare_trees(src, tmp_path / "out" / str(src).lstrip("/")) == []
    assert json.loads(out(["check", "--json"], env))["ok"]
    assert_one_line_error(_text(ogrefs(["tag", "latest"], env, check=False)), "nothing to change")


@pytest.mark.parametrize("src_enc, dst_enc", [(False, False), (False, True), (True, False), (True, True)])
def test_copy_sends_only_missing_chunks(box, tmp_path, src_enc, dst_enc):
    env, src, snap = box  # the destination is the fixture's repository (file or S3)
    if dst_enc:  # the fixture's repository is plain: make a fresh encrypted destination next to it
        env = dict(env, OGREFS_REPO=env["OGREFS_REPO"].rstrip("/") + "-enc", OGREFS_PASSWORD="dst pw")
        ogrefs(["init", "--encrypt"], env)
    source = dict(env, OGREFS_REPO=str(tmp_path / "source"), OGREFS_PASSWORD="src pw")
    source.pop("OGREFS_S3_ENDPOINT", None)
    ogrefs(["init", *(["--encrypt"] if src_enc else [])], source)
    first = json.loads(ogrefs(["snapshot", "--json", str(src)], source).stdout)
    (src / "more.bin").write_bytes(os.urandom(200_000))  # below the minimum chunk size: one chunk
    second = json.loads(ogrefs(["snapshot", "--json", str(src)], source).stdout)
    args = ["copy", "--json", "--from-repo", str(tmp_path / "source")]
    copy_env = dict(env, OGREFS_FROM_PASSWORD="src pw")
    report = json.loads(ogrefs([*args, first["id"][:10]], copy_env).stdout)
    assert report["copied"] == [first["id"]]
    if not dst_enc:  # the fixture's snapshot of the same tree put every chunk there already
        assert report["chunks_sent"] == 0 and report["chunks_present"] >= 3
    else:
        assert report["chunks_sent"] >= 3
    report = json.loads(ogrefs(args, copy_env).stdout)
    assert report["skipped"] == [first["id"]] and report["copied"] == [second["id"]]
    assert report["chunks_sent"] == 1 and report["chunks_present"] >= 3  # only more.bin's chunk travels
    assert json.loads(ogrefs(args, copy_env).stdout)["copied"] == []
    ogrefs(["restore", second["id"][:10], str(tmp_path / "out")], env)
    assert compare_trees(src, tmp_path / "out" / str(src).lstrip("/")) == []
    assert json.loads(ogrefs(["check", "--read-data", "--json"], env).stdout)["ok"]
    wrong = dict(copy_env, OGREFS_FROM_PASSWORD="nope")
    if src_enc:
        assert ogrefs(args, wrong, check=False).returncode == 12
