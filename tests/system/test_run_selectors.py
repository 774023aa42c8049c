"""``ogrefs run`` names its snapshot as every command does: ``latest`` is this box's, ``BOX:latest`` another's (tier 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.system.test_box_mount import pytestmark, whole  # noqa: F401  (whole is a fixture; fuse, unshare)


def test_run_latest_is_this_boxs_snapshot_and_box_latest_names_another(whole):
    box, tmp, snap = whole["box"], whole["tmp"], whole["snap"]
    other_env = dict(os.environ, OGREFS_REPO=str(tmp / "repo"), OGREFS_CACHE_DIR=str(tmp / "othercache"),
                     OGREFS_BOX="other-box")
    other = json.loads(subprocess.run([sys.executable, "-m", "ogrefs", "-q", "snapshot", "--json", str(box / "usr")],
                                      env=other_env, check=True, capture_output=True, text=True, timeout=120).stdout)
    assert other["box"] == "other-box"  # the repository's newest snapshot, holding usr/marker = "host"
    env = dict(whole["env"], OGREFS_RUN_DIR=str(tmp / "runs"))
    env.pop("OGREFS_BOX", None)

    def marker(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ogrefs", "run", name, "--no-host-paths", "--", "cat",
                               f"{box}/usr/marker"], env=env, capture_output=True, text=True, timeout=120)

    mine = marker("latest")
    assert mine.returncode == 0 and mine.stdout == "snap\n", mine.stderr  # this box's: the fixture's snapshot
    theirs = marker("other-box:latest")
    assert theirs.returncode == 0 and theirs.stdout == "host\n", theirs.stderr
    assert snap != other["id"]
