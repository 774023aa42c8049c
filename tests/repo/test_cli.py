"""End-to-end CLI (tier 5): real processes, JSON output, one-line errors and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.treegen import compare_trees
from tests.cli_run import assert_one_line_error, env, run  # noqa: F401  (env is a fixture)


def test_init_snapshot_list_show_restore_json(tmp_path, env):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a.txt").write_text("alpha")
    (src / "b.bin").write_bytes(os.urandom(100_000))
    out = json.loads(run(["init", "--json"], env).stdout)
    assert len(out["id"]) == 32
    snap = json.loads(run(["snapshot", "--json", "--tag", "t1", str(src)], env).stdout)
    assert len(snap["id"]) == 64 and snap["tags"] == ["t1"] and snap["paths"] == [str(src)]
    listing = json.loads(run(["snapshots", "--json"], env).stdout)
    assert [s["id"] for s in listing] == [snap["id"]]
    assert {"id", "time", "host", "paths", "tags"} <= set(listing[0])
    shown = json.loads(run(["show", "--json", snap["id"][:8]], env).stdout)
    assert shown["id"] == snap["id"] and shown["totals"]["files"] == 2
    restored = json.loads(run(["restore", "--json", "latest", str(tmp_path / "out")], env).stdout)
    assert restored["failed"] == {}
    assert compare_trees(src, tmp_path / "out" / str(src).lstrip("/")) == []
    human = run(["snapshots"], env).stdout
    assert snap["id"][:12] in human and "t1" in human
    check = json.loads(run(["check", "--read-data", "--json"], env).stdout)
    assert check["ok"] and check["blobs"] >= 2


@pytest.mark.parametrize("level", ["0", "3"])
def test_a_repository_made_to_store_chunks_raw_stores_them_raw_and_restores_exactly(tmp_path, env, level):
    """`init --compression-level 0` (docs/format.md: for few cores on a fast link): even text that zstd would
    shrink tenfold is stored as it is, and reads back exactly; the default level compresses it."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "code.py").write_bytes(b"def f(x):\n    return x * 2  # the same line again and again\n" * 40_000)
    (src / "noise.bin").write_bytes(os.urandom(300_000))
    run(["init", "--compression-level", level], env)
    run(["snapshot", str(src)], env)
    st = json.loads(run(["stats", "--mode", "raw-data", "--json"], env).stdout)
    if level == "0":
        assert st["total_stored_size"] >= st["total_size"] > 2_000_000  # (a codec byte a chunk more)
    else:
        assert st["total_stored_size"] < st["total_size"] * 0.5
    run(["restore", "latest", str(tmp_path / "out")], env)
    assert compare_trees(src, tmp_path / "out" / str(src).lstrip("/")) == []
    assert json.loads(run(["check", "--read-data", "--json"], env).stdout)["ok"]


def test_diff_reports_files_and_bytes(tmp_path, env):
    src = tmp_path / "src"
    src.mkdir()
    (src / "keep").write_text("same")
    (src / "change").write_text("before")
    (src / "gone").write_text("bye")
    run(["init"], env)
    a = json.loads(run(["snapshot", "--json", str(src)], env).stdout)["id"]
    (src / "change").write_text("after!!")
    (src / "gone").unlink()
    (src / "new").write_bytes(b"n" * 1000)
    b = json.loads(run(["snapshot", "--json", str(src)], env).stdout)["id"]
    d = json.loads(run(["diff", "--json", a, b], env).stdout)["files"]
    assert d["added"] == [f"{src}/new"]
    assert d["removed"] == [f"{src}/gone"]
    assert f"{src}/change" in d["changed"] and f"{src}/keep" not in d["changed"]
    assert d["bytes"]["added"] == 1000


@pytest.mark.parametrize(
    "args, needle",
    [
        (["snapshots"], "no ogrefs repository"),
        (["show", "latest"], "no ogrefs repository"),
    ],
)
def test_missing_repo_is_one_line(env, args, needle):
    assert_one_line_error(run(args, env, check=False), needle)


def test_user_errors_are_one_line(tmp_path, env):
    run(["init"], env)
    assert_one_line_error(run(["init"], env, check=False), "already a repository")
    assert_one_line_error(run(["show", "deadbeef"], env, check=False), "no snapshot matches")
    assert_one_line_error(run(["show", "latest"], env, check=False), "no snapshots yet")
    assert_one_line_error(run(["snapshot", str(tmp_path / "nope")], env, check=False), "no such file")
    assert_one_line_error(run(["restore", "zzz", str(tmp_path / "o")], env, check=False), "not a snapshot id")
    no_repo = dict(env)
    no_repo.pop("OGREFS_REPO")
    assert_one_line_error(run(["snapshots"], no_repo, check=False), "--repo")


def test_unknown_format_version_is_refused(tmp_path, env):
    run(["init"], env)
    cfg_path = tmp_path / "repo" / "config"
    cfg = json.loads(cfg_path.read_text())
    cfg["version"] = 99
    cfg_path.write_text(json.dumps(cfg))
    assert_one_line_error(run(["snapshots"], env, check=False), "format version 99 is not supported")


def test_unreadable_file_exit_code(tmp_path, env):
    """An unreadable file is reported, the snapshot is saved, and the exit code is 3."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok").write_text("ok")
    (src / "secret").write_text("no")
    run(["init"], env)
    # Root reads everything, so make open() fail for one path in the child process.
    code = (
        "import os, ogrefs.snapshot.pipeline as s\n"
        "real = os.open\n"
        "def fake(p, *a, **k):\n"
        "    if os.fsencode(p).endswith(b'/secret'): raise PermissionError(13, 'Permission denied', p)\n"
        "    return real(p, *a, **k)\n"
        "s.os.open = fake\n"
        "from ogrefs.cli.app import main\n"
        f"main(['snapshot', {str(src)!r}])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert f"could not read {src}/secret: Permission denied" in proc.stderr
    listing = json.loads(run(["snapshots", "--json"], env).stdout)
    assert len(listing) == 1


def test_permission_denied_repo(tmp_path, env):
    run(["init"], env)
    ro = dict(env, OGREFS_REPO="/proc/ogrefs-repo")
    proc = run(["init"], ro, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.s3
def test_cli_over_s3(tmp_path, seaweed):
    """The same commands against the real S3 server, configured the standard way."""
    env = dict(os.environ, **seaweed.env(), OGREFS_CACHE_DIR=str(tmp_path / "cache"))
    env["OGREFS_REPO"] = f"s3://{seaweed.new_bucket()}/team/repo"
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(3 * 1024 * 1024))
    run(["init"], env)
    snap = json.loads(run(["snapshot", "--json", str(src)], env).stdout)
    run(["restore", snap["id"][:6], str(tmp_path / "out")], env)
    assert compare_trees(src, tmp_path / "out" / str(src).lstrip("/")) == []
    assert json.loads(run(["check", "--read-data", "--json"], env).stdout)["ok"]
    missing = dict(env, OGREFS_REPO=f"s3://{seaweed.new_bucket()}/nothing-here")
    assert_one_line_error(run(["snapshots"], missing, check=False), "no ogrefs repository")
