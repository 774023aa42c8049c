"""Which snapshot a command takes: a bare `latest` passes over partial snapshots; --path/--tag/--host narrow
every command that takes a snapshot; ids in either case (tier 5: the real entry point)."""

from __future__ import annotations

import json

from tests.cli_run import assert_one_line_error, env, run  # noqa: F401  (env is a fixture)


def _box(tmp_path):
    box = tmp_path / "box"
    (box / "proj").mkdir(parents=True)
    (box / "etc.conf").write_text("outside proj")
    (box / "proj" / "train.py").write_text("print(1)")
    return box


def _snap(env, *args) -> dict:
    return json.loads(run(["snapshot", "--json", *args], env).stdout)


def test_latest_passes_over_a_later_snapshot_of_a_subdirectory(tmp_path, env):
    box = _box(tmp_path)
    run(["init"], env)
    whole = _snap(env, str(box))
    part = _snap(env, str(box / "proj"))
    out = tmp_path / "out"
    proc = run(["restore", "latest", str(out)], env)
    assert (out / str(box).lstrip("/") / "etc.conf").read_text() == "outside proj"
    assert f"passed over, the newest {part['id'][:12]}" in proc.stderr  # the pick is said, not silent
    assert json.loads(run(["show", "--json", "latest"], env).stdout)["id"] == whole["id"]
    # --path picks the partial one, on every command that takes a snapshot
    sub = ["--path", str(box / "proj")]
    assert json.loads(run(["show", "--json", "latest", *sub], env).stdout)["id"] == part["id"]
    listed = run(["ls", "latest", *sub], env).stdout.split()
    assert str(box / "proj" / "train.py") in listed and str(box / "etc.conf") not in listed
    assert run(["dump", "latest", str(box / "etc.conf"), "--path", str(box)], env).stdout == "outside proj"
    stats = json.loads(run(["stats", "--json", *sub], env).stdout)
    assert stats["snapshots"] == 1
    assert [s["id"] for s in json.loads(run(["snapshots", "--json", *sub], env).stdout)] == [part["id"]]


def test_tag_and_host_narrow_latest_and_ids_must_match(tmp_path, env):
    box = _box(tmp_path)
    env["OGREFS_BOX"] = "gpu1"  # both snapshots are of this box, taken on two hosts
    run(["init"], env)
    nightly = _snap(env, str(box), "--tag", "nightly", "--tag", "keep")
    later = _snap(env, str(box), "--tag", "adhoc", "--host", "otherhost")
    assert json.loads(run(["show", "--json", "latest"], env).stdout)["id"] == later["id"]
    assert json.loads(run(["show", "--json", "latest", "--tag", "nightly", "--tag", "keep"], env).stdout)["id"] \
        == nightly["id"]
    env2 = dict(env, OGREFS_BOX="elsewhere")  # --host picks that host's newest, whatever box this one is
    assert json.loads(run(["show", "--json", "latest", "--host", "otherhost"], env2).stdout)["id"] == later["id"]
    assert_one_line_error(run(["show", "latest", "--tag", "nope"], env, check=False), "matches --tag nope")
    assert_one_line_error(run(["show", nightly["id"][:10], "--tag", "adhoc"], env, check=False),
                          "does not match --tag adhoc")


def test_upper_case_ids_are_ids(tmp_path, env):
    box = _box(tmp_path)
    run(["init"], env)
    snap = _snap(env, str(box))
    for name in (snap["id"].upper(), snap["id"][:10].upper()):
        assert json.loads(run(["show", "--json", name], env).stdout)["id"] == snap["id"]


def test_a_new_box_that_names_no_box_or_a_wrong_one_gets_one_line_listing_the_boxes(tmp_path, env):
    """Issue 47: on a brand-new box `latest` (and the unit without OGREFS_BOX) is this machine's own box, which
    has nothing; the one line says so, lists every box of the repository and what to type."""
    box = _box(tmp_path)
    env.pop("OGREFS_BOX", None)
    run(["init"], env)
    for name in ("trainer", "eval-box"):
        _snap(dict(env, OGREFS_BOX=name), str(box))
    new = run(["show", "latest"], env, check=False)
    assert_one_line_error(new, "has no snapshot of this machine's own box ")
    line = new.stderr.strip()
    assert "(OGREFS_BOX is not set)" in line and "boxes here: eval-box, trainer;" in line
    assert "BOX:latest, or OGREFS_BOX=BOX (in /etc/ogrefs/env for the units)" in line
    for how in (["restore", "typo:latest", str(tmp_path / "r")], ["restore", "latest", str(tmp_path / "r")]):
        wrong = run(how, dict(env, OGREFS_BOX="typo"), check=False)
        assert_one_line_error(wrong, "has no snapshot of box 'typo'; boxes here: eval-box, trainer;")
    unit_style = run(["show", ":latest-checkpoint"], env, check=False)  # the unit's ${OGREFS_BOX}:… when unset
    assert_one_line_error(unit_style, "this machine's own box")
    assert "BOX:latest-checkpoint" in unit_style.stderr
    assert json.loads(run(["show", "--json", "trainer:latest"], env).stdout)["box"] == "trainer"
