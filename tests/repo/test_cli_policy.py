"""forget's policy options, key passwd, packaging metadata: through the real entry point."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from tests.cli_run import assert_one_line_error, env, run  # noqa: F401  (env is a fixture)
from tests import REPO_ROOT


def _snap(env: dict, src: Path, host: str, *tags: str) -> str:
    args = ["snapshot", "--json", "--host", host, str(src)] + [a for t in tags for a in ("--tag", t)]
    return json.loads(run(args, env).stdout)["id"]


def test_forget_keep_yearly_within_group_by_host_and_path(tmp_path, env):
    src, other = tmp_path / "src", tmp_path / "other"
    src.mkdir()
    other.mkdir()
    (src / "f").write_text("x")
    (other / "g").write_text("y")
    run(["init"], env)
    a1, a2 = _snap(env, src, "alpha"), _snap(env, src, "alpha")
    b1 = _snap(env, src, "beta")
    o1 = _snap(env, other, "alpha")

    def forget(*args: str) -> dict:
        return json.loads(run(["forget", "--dry-run", "--json", *args], env).stdout)

    out = forget("--keep-yearly", "1")  # one per (host, paths) group: the newest
    assert sorted(out["removed"]) == [a1] and {k["id"] for k in out["kept"]} == {a2, b1, o1}
    assert "yearly" in [r for k in out["kept"] for r in k["reasons"]]
    assert forget("--keep-within", "1d")["removed"] == []
    # --host names a box of its own (alpha-xxxxxxxx, beta-xxxxxxxx), and each box is judged apart: its newest
    # survives even when another box's are newer
    out = forget("--keep-last", "1", "--group-by", "")  # one group per box
    assert sorted(out["removed"]) == sorted([a1, a2])
    out = forget("--keep-last", "1", "--group-by", "paths")
    assert sorted(out["removed"]) == [a1]
    out = forget("--keep-last", "1", "--host", "alpha")  # beta is not considered at all
    assert out["removed"] == [a1] and b1 not in {k["id"] for k in out["kept"]}
    out = forget("--keep-last", "1", "--path", str(src), "--host", "alpha")
    assert out["removed"] == [a1] and {k["id"] for k in out["kept"]} == {a2}
    assert_one_line_error(run(["forget", "--keep-within", "soon"], env, check=False), "not a duration")
    assert_one_line_error(run(["forget", "--keep-last", "1", "--group-by", "box"], env, check=False),
                          "not one of host, paths, tags")
    run(["forget", "--keep-yearly", "1"], env)
    assert {s["id"] for s in json.loads(run(["snapshots", "--json"], env).stdout)} == {a2, b1, o1}


def test_key_passwd_changes_the_passphrase(tmp_path, env):
    old = dict(env, OGREFS_PASSWORD="old secret")
    run(["init", "--encrypt"], old)
    changed = json.loads(run(["key", "passwd", "--json"], dict(old, OGREFS_NEW_PASSWORD="new secret")).stdout)
    new = dict(env, OGREFS_PASSWORD="new secret")
    keys = json.loads(run(["key", "list", "--json"], new).stdout)
    assert [k["id"] for k in keys] == [changed["added"]] and keys[0]["current"]
    proc = run(["snapshots"], old, check=False)
    assert proc.returncode == 12 and "wrong passphrase" in proc.stderr


def test_the_license_field_is_an_spdx_string():
    """setuptools >= 77 warns (three 13-line warnings per install) about a table-form license."""
    meta = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    assert any(r.startswith("setuptools>=77") for r in meta["build-system"]["requires"])


def test_forget_takes_selectors_latest_box_latest_and_latest_checkpoint(tmp_path, env):
    """forget SNAP resolves as show and restore do: `latest` is this box's, never the repository's newest."""
    import shutil

    from tests.unit.test_inspect_checkpoints import hf_checkpoint

    src = tmp_path / "src"
    (src / "run").mkdir(parents=True)
    (src / "f").write_text("x")
    run(["init"], env)
    box_a = dict(env, OGREFS_BOX="a")

    def snap(e: dict) -> str:
        return json.loads(run(["snapshot", "--json", str(src)], e).stdout)["id"]

    a1 = snap(box_a)
    hf_checkpoint(src / "run", 100)
    a2 = snap(box_a)  # holds the coherent checkpoint of step 100
    shutil.rmtree(src / "run" / "checkpoint-100")
    a3 = snap(box_a)  # newer, holds no checkpoint
    b1 = snap(dict(env, OGREFS_BOX="b"))  # the newest of the repository

    def forget(e: dict, *args: str) -> list[str]:
        return json.loads(run(["forget", "--json", *args], e).stdout)["removed"]

    assert forget(box_a, "--dry-run", "latest-checkpoint") == [a2]
    assert forget(box_a, "--dry-run", "a:latest-checkpoint", a2[:10]) == [a2]  # two names of one: once
    assert forget(box_a, "latest", "latest") == [a3]  # this box's newest, not b's
    assert forget(box_a, "b:latest") == [b1]
    assert {s["id"] for s in json.loads(run(["snapshots", "--json"], env).stdout)} == {a1, a2}
    assert_one_line_error(run(["forget", "b:latest"], box_a, check=False), "no snapshot of box 'b'")
    assert_one_line_error(run(["forget", "nope:"], box_a, check=False), "not a snapshot id")
