"""A snapshot's access traces follow it: ``tag`` (a new id) carries them, ``forget`` removes them (tier 5)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.nsbox import OGREFS, box, in_namespace  # noqa: F401  (box is a fixture)

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not os.path.exists("/dev/fuse") and not os.environ.get("CI"), reason="no /dev/fuse here"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing"),
]


def _traces(box: dict, snap_id: str) -> list[str]:
    d = box["tmp"] / "repo" / "traces" / snap_id
    return sorted(os.listdir(d)) if d.is_dir() else []


def _ogrefs(box: dict, *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "ogrefs", *args], env=box["env"], check=True, capture_output=True,
                          text=True, timeout=120).stdout


def test_a_mount_of_a_retagged_snapshot_replays_the_trace_of_the_old_id_and_forget_removes_it(box):
    proj, tmp, snap = box["proj"], box["tmp"], box["snap"]
    in_namespace(box, f"""
        mount -t tmpfs fresh-box {proj.parent}
        {OGREFS} mount {snap} / --no-materialize
        cat {proj}/random.bin {proj}/dir/nested/deeper/leaf.py > /dev/null
        {OGREFS} unmount /                              # saves the trace of what was read
    """)
    recorded = _traces(box, snap)
    assert len(recorded) == 1
    moved = json.loads(_ogrefs(box, "tag", snap, "--add", "keep", "--json"))["changed"][0]
    new = moved["new"]
    assert _traces(box, new) == recorded and _traces(box, snap) == []  # same name: traces sort by age
    in_namespace(box, f"""
        mount -t tmpfs fresh-box {proj.parent}
        rm -rf {tmp}/state {tmp}/cache                  # a fresh box again
        {OGREFS} mount {new} / --no-materialize
        {OGREFS} status / --json > {tmp}/status.json
        {OGREFS} unmount /
    """)
    st = json.loads((tmp / "status.json").read_text())
    assert st["snapshot"] == new and st["trace_replayed"] >= 2  # the trace recorded under the old id
    _ogrefs(box, "forget", new)
    assert _traces(box, new) == []  # no trace is left that no snapshot will replay
