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
import subprocess
import sys

import pytest

from tests import REPO_ROOT
from tests.nsbox import OGREFS, OURS, box, in_namespace, none_mounted  # noqa: F401  (box is a fixture)

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


def test_a_disk_ogrefs_never_mounted_survives_unmount(box):
    tmp = box["tmp"]
    in_namespace(box, f"""
        mkdir -p {tmp}/disk
        mount -t tmpfs boxdisk {tmp}/disk                  # the box's own disk
        echo data > {tmp}/disk/file
        set +e
        {OGREFS} unmount {tmp}/disk 2> {tmp}/plain.err; echo $? > {tmp}/plain.rc
        {OGREFS} unmount --lazy {tmp}/disk 2> {tmp}/lazy.err; echo $? > {tmp}/lazy.rc
        {OGREFS} unmount --lazy --if-mounted {tmp}/disk 2> {tmp}/if.err; echo $? > {tmp}/if.rc
        set -e
        test "$(cat {tmp}/disk/file)" = data                 # still mounted, still the box's
        awk '{{print $5}}' /proc/self/mountinfo | grep -qx {tmp}/disk
    """)
    for name, code in (("plain", "2"), ("lazy", "2"), ("if", "0")):
        assert (tmp / f"{name}.rc").read_text().strip() == code, name
        line = _one_line((tmp / f"{name}.err").read_text())
        assert f"{tmp}/disk is not mounted by ogrefs (tmpfs from boxdisk is mounted there" in line, line
        assert "nothing was unmounted" in line, line


def test_lazy_unmount_of_root_without_an_ogrefs_mount_leaves_the_mount_table_alone(box):
    """The unit's ExecStop after a manual unmount: before, the box's whole root tree was detached."""
    tmp = box["tmp"]
    in_namespace(box, f"""
        cat /proc/self/mountinfo > {tmp}/before
        set +e
        {OGREFS} unmount --lazy / --timeout 5 2> {tmp}/err; echo $? > {tmp}/rc
        set -e
        cat /proc/self/mountinfo > {tmp}/after
    """)
    assert (tmp / "before").read_text() == (tmp / "after").read_text()
    assert (tmp / "rc").read_text().strip() == "2"
    assert "/ is not mounted by ogrefs" in _one_line((tmp / "err").read_text())


def test_unmount_of_a_dead_mount_clears_its_record_and_touches_nothing(box):
    """A writable mount whose daemon was killed: its keeper took everything down, the registration stayed.

    ``unmount`` clears the record (the documented step after detach.sh) and says so; from then on
    nothing of ogrefs' is at the path: a plain ``unmount`` exits 2, ``--if-mounted`` 0, both touch nothing.
    """
    proj, tmp, snap = box["proj"], box["tmp"], box["snap"]
    in_namespace(box, f"""
        mount -t tmpfs fresh-box {proj.parent}
        {OGREFS} mount {snap} / --no-materialize
        {_pids(tmp)}
        kill -9 "$pid"
        timeout 20 tail --pid="$keeper" -f /dev/null      # the keeper detaches the overlays and leaves
        cat /proc/self/mountinfo > {tmp}/before
        {OGREFS} unmount / 2> {tmp}/err
        set +e
        {OGREFS} unmount / 2> {tmp}/again.err; echo $? > {tmp}/again.rc
        {OGREFS} unmount --if-mounted / 2> {tmp}/if.err; echo $? > {tmp}/if.rc
        set -e
        cat /proc/self/mountinfo > {tmp}/after
    """)
    assert (tmp / "before").read_text() == (tmp / "after").read_text()
    assert "its record is cleared" in _one_line((tmp / "err").read_text())
    assert not [p for p in (tmp / "run" / "mounts").glob("*.json") if not p.name.endswith(".status.json")]
    for name, code in (("again", "2"), ("if", "0")):
        assert (tmp / f"{name}.rc").read_text().strip() == code, name
        assert "/ is not mounted by ogrefs (" in _one_line((tmp / f"{name}.err").read_text()), name


def test_unmount_completes_on_a_full_state_disk(box):
    """Issue 51.2: before, the overlays came down, then "No space left on device" on every retry."""
    proj, tmp, snap = box["proj"], box["tmp"], box["snap"]
    in_namespace(box, f"""
        mkdir -p {tmp}/state
        mount -t tmpfs -o size=16m statedisk {tmp}/state      # the state directory's own small disk
        mount -t tmpfs fresh-box {proj.parent}
        {OGREFS} mount {snap} / --no-materialize
        {_pids(tmp)}
        fails dd if=/dev/zero of={proj}/filler bs=1M 2>/dev/null  # writes land in the upper dir: full to the brim
        fails sh -c 'printf x > {tmp}/state/one-more' 2>/dev/null   # not a byte more (an empty file would fit)
        rm -f {tmp}/state/one-more
        echo $pid > {tmp}/pid
        {OGREFS} unmount / --timeout 30 2> {tmp}/err
        fails kill -0 "$pid" 2>/dev/null                     # the daemon is gone
        {none_mounted(tmp, OURS)}
        {OGREFS} mounts --json > {tmp}/mounts.json
        test -s {tmp}/state/*/upper/0/filler                  # what was written is kept
        set +e
        {OGREFS} unmount / 2> {tmp}/again.err; echo $? > {tmp}/again.rc
    """)
    assert "No space" not in (tmp / "err").read_text()
    assert [m["state"] for m in json.loads((tmp / "mounts.json").read_text())] == ["unmounted"]
    assert (tmp / "again.rc").read_text().strip() == "2"
    assert "is not mounted by ogrefs" in _one_line((tmp / "again.err").read_text())


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
        {none_mounted(f"{tmp}/earlier")}
        test -e {proj}/small.txt                             # the writable mount lives on
        {OGREFS} unmount /
    """)
    assert (tmp / "err").read_text() == ""


@pytest.mark.parametrize("mode", ["--read-only", "--no-materialize"])
def test_unmount_names_the_namespace_that_still_holds_the_mount(box, mode):
    """A mount namespace cloned while the mount existed (here ``unshare --mount``; a container, or a service with a
    private /tmp started then) keeps a copy of it: once unmounted here, the kernel keeps the FUSE connection for
    that copy, so the daemon serves it and does not exit.  Before, ``unmount`` said only "has not exited after
    N s"; it names the process whose namespace holds it, and where; the daemon exits once that namespace is gone."""
    tmp, snap = box["tmp"], box["snap"]
    in_namespace(box, f"""
        mkdir -p {tmp}/ro
        {OGREFS} mount {snap} {tmp}/ro {mode}             # read-only, or writable (the FUSE mount is its lower)
        {_pids(tmp)}
        unshare --mount --propagation private sleep 120 &
        holder=$!
        echo $holder > {tmp}/holder
        timeout 10 sh -c 'until [ "$(readlink /proc/'$holder'/ns/mnt)" != "$(readlink /proc/$$/ns/mnt)" ]; do sleep 0.05; done'
        set +e
        {OGREFS} unmount {tmp}/ro --timeout 2 2> {tmp}/err; echo $? > {tmp}/rc
        {OGREFS} unmount {tmp}/ro --timeout 1 2> {tmp}/again.err; echo $? > {tmp}/again.rc  # gone from here now
        set -e
        {none_mounted(f"{tmp}/ro")}
        kill -0 "$pid"                                        # the daemon serves the other namespace's copy
        kill $holder; wait $holder || true
        timeout 20 tail --pid="$pid" -f /dev/null             # and exits once that namespace is gone
    """)
    holder = (tmp / "holder").read_text().strip()
    point = f"{tmp}/ro" if mode == "--read-only" else f"{tmp}/state/"  # (a writable mount's lower: its state's)
    for name in ("", "again."):  # the first unmount, and one after it when the mount is no longer here
        assert (tmp / f"{name}rc").read_text().strip() != "0", name
        line = _one_line((tmp / f"{name}err").read_text())
        assert f"the mount namespace of pid {holder} (sleep) still has it, at {point}" in line, line
        assert f"nsenter -t {holder} -m umount {point}" in line, line


def test_a_daemon_keeps_only_the_other_mounts_it_runs_from(tmp_path):
    """mountsys.detach_ogrefs_mounts: every ogrefs overlay goes but one over a path kept; the box's own stay."""
    for d in ("lower", "upper-a", "work-a", "upper-b", "work-b", "a", "b", "disk"):
        (tmp_path / d).mkdir()
    (tmp_path / "lower" / "sub").mkdir()
    script = f"""
import json, sys
sys.path.insert(0, {str(REPO_ROOT / "src")!r})
from ogrefs.box import mountsys
t = {str(tmp_path)!r}
for x in "ab":
    mountsys.overlay(f"{{t}}/{{x}}", f"lowerdir={{t}}/lower,upperdir={{t}}/upper-{{x}},workdir={{t}}/work-{{x}}")
mountsys.mount("boxdisk", f"{{t}}/disk", "tmpfs")
gone = mountsys.detach_ogrefs_mounts([f"{{t}}/a/sub"])
left = {{r.point: (r.fstype, r.source) for r in mountsys.mount_table() if r.point.startswith(t)}}
print(json.dumps([gone, left]))
"""
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    gone, left = json.loads(out)
    assert gone == [f"{tmp_path}/b"]
    assert left == {f"{tmp_path}/a": ["overlay", "ogrefs"], f"{tmp_path}/disk": ["tmpfs", "boxdisk"]}
