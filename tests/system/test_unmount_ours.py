"""``unmount`` touches only what ogrefs mounted, finishes on a full state disk, and no daemon pins another mount.

Tier 5, each in a private mount namespace (``unshare --mount --propagation
private``): whatever a regression detaches there, this machine's own mounts
stay. Issue 46 (``unmount`` of the box's root or of a disk ogrefs never
mounted detached it) and issue 51 (items 2 and 3).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from tests.nsbox import OGREFS, box, in_namespace  # noqa: F401  (box is a fixture)

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not os.path.exists("/dev/fuse") and not os.environ.get("CI"), reason="no /dev/fuse here"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing"),
]


def _pids(tmp) -> str:
    """Shell lines setting $pid and $keeper: the daemon's and the keeper's pid from the mount's registration."""
    read = (f"import json,pathlib; r=[p for p in pathlib.Path('{tmp}/run/mounts').glob('*.json') "
            f"if not p.name.endswith('.status.json')]; print(json.loads(r[0].read_text()).get")
    return f"pid=$({sys.executable} -c \"{read}('pid'))\")\nkeeper=$({sys.executable} -c \"{read}('keeper_pid'))\")"


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


@pytest.mark.parametrize("first", ["--read-only", "--no-materialize"])
def test_a_writable_mount_made_later_does_not_pin_an_earlier_one(box, first):
    """Issue 51.3: the later writable mount's daemon copied the namespace with the earlier mount in it."""
    proj, tmp, snap = box["proj"], box["tmp"], box["snap"]
    in_namespace(box, f"""
        mkdir -p {tmp}/earlier
        {OGREFS} mount {snap} {tmp}/earlier {first}          # read-only, or writable at a directory
        mount -t tmpfs fresh-box {proj.parent}
        {OGREFS} mount {snap} / --no-materialize
        {OGREFS} unmount {tmp}/earlier --timeout 20 2> {tmp}/err  # before: "... has not exited after 20 s"
        ! awk '{{print $5}}' /proc/self/mountinfo | grep -q "^{tmp}/earlier"
        test -e {proj}/small.txt                             # the writable mount lives on
        {OGREFS} unmount /
    """)
    assert (tmp / "err").read_text() == ""
