"""``finalize`` killed with SIGKILL before each of its steps: the box shows, with no rerun (tier 5, issue 46).

A step is anything finalize does that another process could see: each
mount(2), umount2(2) and move_mount(2) (mountsys' system calls), each
``os.replace`` (overlays.json, the registration, top-files.json) and each
signal sent. The harness (``tests/killsteps.py``, test-only: nothing in
ogrefs knows of it) wraps those and SIGKILLs the finalize process right before the
k-th; a first run with no kill counts them. For every k, in a fresh private
mount namespace and a fresh state directory below the overlaid ``var`` (so
the local copy needs its own layer, the /var case of docs/mount.md):

- right after the kill, each overlaid directory shows the snapshot with the
  box's writes and the disk this box mounted inside ``mnt`` after the mount,
  readable and writable: no rerun needed;
- the rerun of ``finalize`` then completes (exit 0) or says it is already
  done, and nothing of the FUSE lower is left mounted, its daemon gone;
- nothing written before or after the kill is lost.
"""

from __future__ import annotations

import re
import shutil
import sys

import pytest

from ..killsteps import KILLER
from .test_box_mount import OGREFS, PY, _kill_leftovers, in_namespace, whole  # noqa: F401  (whole is a fixture)

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing"),
]

def _shows_the_box(box, tmp, k: int) -> str:
    """A shell function's body: every overlaid directory shows the snapshot, the box's writes and its later
    disk (unless $disk is empty), and takes a write; one && chain, so it fails where a check fails (in
    ``shows || ...``, bash ignores ``set -e`` inside the function)."""
    return " && ".join([
        f'test "$(cat {box}/usr/marker)" = "snap"',
        f'test "$(cat {box}/usr/written)" = "kept {k}"',
        f'test "$(cat {box}/var/lib/app/written)" = "kept {k}"',
        f'test "$(cat {box}/var/lib/app/data)" = "app data"',
        f'test "$(cat {box}/mnt/from-snapshot)" = "snap mnt"',
        f'{{ test -z "$disk" || test "$(cat {box}/mnt/later/f)" = "on the disk"; }}',
        f"cmp {box}/usr/lib/pkg/big.bin {tmp}/expected-big.bin",
        f'echo "also $1" > {box}/usr/also-$1'])


def _cycle(whole, killer, k: int, beneath: bool = True, **env_extra: str) -> str | None:
    """Mount, write, finalize killed before step k, look, rerun, look again, unmount; None, or what failed.

    ``beneath`` False: as on a kernel without MOVE_MOUNT_BENEATH, where a kill between an old overlay's
    unmount and the new one's mount leaves the box's own directory shown until the rerun (docs/mount.md):
    such a k is listed in ``windows-<k>``, not failed; the rerun must repair it.
    """
    box, tmp, snap = whole["box"], whole["tmp"], whole["snap"]
    state = f"{box}/var/lib/ogrefs/mounts/k{k}"
    run = tmp / f"run-{k}"  # the registration: of this k alone
    env = dict(whole["env"], KILL_AT=str(k), KILL_LOG=str(tmp / f"steps-{k}.txt"), OGREFS_RUNTIME_DIR=str(run))
    if not beneath:
        env["KILL_NO_BENEATH"] = "1"
    env.update(env_extra)
    # the old order detaches a disk mounted inside an overlay with it, and only the killed process held
    # its copy: killed then, the disk is no longer mounted there (its files are on it, not lost)
    window = f"{{ touch {tmp}/window-{k}; mountpoint -q {box}/mnt/later || disk=; }}" if not beneath else "false"
    proc = in_namespace(env, f"""
        shows() {{ {_shows_the_box(box, tmp, k)}; }}
        disk=1
        {OGREFS} mount {snap} / --state-dir {state} > /dev/null
        timeout 60 {OGREFS} status / --wait > /dev/null
        echo "kept {k}" > {box}/usr/written
        echo "kept {k}" > {box}/var/lib/app/written
        mkdir -p {box}/mnt/later && mount -t tmpfs later-disk {box}/mnt/later   # a disk mounted after the mount
        echo on the disk > {box}/mnt/later/f
        daemon=$({PY} -c "import json,glob; print(json.load(open(glob.glob('{run}/mounts/*[0-9a-f].json')[0]))['pid'])")
        rc=0; timeout 90 {sys.executable} {killer} finalize / > /dev/null 2> {tmp}/killed.err || rc=$?
        # killed; or (k > 0) done before step k: its daemon exited by itself before the SIGTERM of k = last
        test $rc = {137 if k else 0} || {{ test $rc = 0 && test "$(wc -l < {tmp}/steps-{k}.txt)" -lt {k}; }} \
            || {{ echo "finalize ended $rc, not killed at step {k}" >&2; cat {tmp}/killed.err >&2; exit 1; }}
        shows killed || {window} || {{ echo "after the kill at step {k}: the box does not show" >&2; \
            tail -n 3 {tmp}/steps-{k}.txt >&2; grep " {box}" /proc/self/mountinfo >&2; exit 1; }}
        rc=0; {OGREFS} finalize / > /dev/null 2> {tmp}/rerun.err || rc=$?
        test $rc = 0 || grep -q "already finalized" {tmp}/rerun.err || {{ cat {tmp}/rerun.err >&2; exit 1; }}
        fails grep "Traceback" {tmp}/rerun.err >&2
        shows rerun
        ! grep -F " {box}/" /proc/self/mountinfo | grep fuse.ogrefs >&2 \
            || {{ echo "step {k}: a FUSE mount is left" >&2; exit 1; }}
        {PY} -c "import sys; from ogrefs.box.records import pid_alive; sys.exit(pid_alive($daemon))" \
            || {{ echo "step {k}: the daemon $daemon still runs" >&2; exit 1; }}
        test -e {tmp}/window-{k} || test "$(cat {box}/usr/also-killed)" = "also killed"  # written after the kill
        ! ls -A {run}/stage 2> /dev/null | grep . >&2 || {{ echo "step {k}: the staging directory is left" >&2; exit 1; }}
        test -z "$disk" || umount {box}/mnt/later
        {OGREFS} unmount /
        test "$(cat {box}/usr/marker)" = "host"
        ! grep -E " - [a-z.]+ ogrefs" /proc/self/mountinfo | grep -F -e " {box}/" -e " {run}/" >&2 \
            || {{ echo "step {k}: left mounted after the unmount" >&2; exit 1; }}
    """, check=False)
    _kill_leftovers(run / "mounts")  # a failed k leaves its daemon and keeper: the next starts clean
    if proc.returncode == 0:
        return None
    if not k:
        return f"the whole run (no kill): {proc.stderr.strip()}"
    done = (tmp / f"steps-{k}.txt").read_text().splitlines()
    step = done[k - 1] if len(done) >= k else f"not reached: {done[-1:]}"
    return f"killed before step {k} ({step}): {proc.stderr.strip()}"


def test_finalize_killed_before_each_step_leaves_the_box_shown(whole):
    """With MOVE_MOUNT_BENEATH (this kernel's): the box shows right after every kill."""
    killer = whole["tmp"] / "killer.py"
    killer.write_text(KILLER)
    assert _cycle(whole, killer, 0) is None  # a whole run: counts the steps
    steps = (whole["tmp"] / "steps-0.txt").read_text().splitlines()
    assert len(steps) >= 10, steps  # 3 overlays, each put up and taken down, and the FUSE lower
    failed = [why for k in range(1, len(steps) + 1) if (why := _cycle(whole, killer, k))]
    assert not failed, "\n".join(failed)


def test_without_move_beneath_the_old_order_is_repaired_by_the_rerun_at_every_step(whole):
    """As on a kernel before 6.5: the old order (detach, then mount) for every overlay. The box may show its
    own directory only right after an old overlay's unmount (the documented window); the rerun of
    finalize repairs every kill point, the FUSE lower and its daemon go, nothing is lost."""
    killer = whole["tmp"] / "killer.py"
    killer.write_text(KILLER)
    assert _cycle(whole, killer, 0, beneath=False) is None
    steps = (whole["tmp"] / "steps-0.txt").read_text().splitlines()
    assert not any("/stage/" in s for s in steps), steps  # nothing put together aside
    failed = [why for k in range(1, len(steps) + 1) if (why := _cycle(whole, killer, k, beneath=False))]
    assert not failed, "\n".join(failed)
    windows = sorted(int(p.name.split("-")[1]) for p in whole["tmp"].glob("window-*"))
    assert windows, "the old order shows the box's own directory somewhere: this test must see it"
    after = [steps[k - 2] for k in windows]  # the step done last before each such kill
    assert all(" umount2 " in s or " mount " in s for s in after), after


def test_where_the_kernel_refuses_to_move_beneath_the_old_order_is_taken(whole):
    """move_mount(2) may refuse MOVE_MOUNT_BENEATH at a target (EINVAL, e.g. for propagation it would
    not do): nothing of the staged overlay was seen, and that target takes the old order; finalize ends."""
    killer = whole["tmp"] / "killer.py"
    killer.write_text(KILLER)
    assert _cycle(whole, killer, 0, KILL_BENEATH_REFUSED="1") is None
    steps = (whole["tmp"] / "steps-0.txt").read_text().splitlines()
    staged = [s for s in steps if re.search(r"mount b'.*/stage/[0-9a-f]+/[0-9]+'$", s)]
    assert len(staged) == 3, steps  # each overlay put together aside, then not moved beneath
    box = whole["box"]
    for d in ("mnt", "usr", "var"):  # each old one then detached by its path, the new one mounted there
        assert any(s.endswith(f"umount2 b'{box}/{d}'") for s in steps), steps
