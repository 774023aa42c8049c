"""``finalize`` killed with SIGKILL before each of its steps: the box shows, with no rerun (tier 5, issue 46).

A step is anything finalize does that another process could see: each
mount(2), umount2(2) and move_mount(2) (mountsys' system calls), each
``os.replace`` (overlays.json, the registration, top-files.json) and each
signal sent. The harness (``KILLER`` below, test-only: nothing in ogrefs
knows of it) wraps those and SIGKILLs the finalize process right before the
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

import shutil
import sys

import pytest

from .test_box_mount import OGREFS, PY, _kill_leftovers, in_namespace, whole  # noqa: F401  (whole is a fixture)

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing"),
]

#: ``python KILLER finalize /``: ogrefs' CLI with every visible step counted into $KILL_LOG, and a SIGKILL
#: of itself right before step $KILL_AT (0: none).
KILLER = r'''
import os, signal, sys
from ogrefs.box import mountsys

AT, LOG, ME = int(os.environ["KILL_AT"]), os.environ["KILL_LOG"], os.getpid()
done = 0


def step(what):
    global done
    done += 1
    with open(LOG, "a") as fh:
        fh.write(f"{done} {what}\n")
    if done == AT:
        os.kill(ME, signal.SIGKILL)


class Counted:
    """mountsys' libc, its mount, umount2 and move_mount counted (open_tree only copies: not a step)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        fn = getattr(self._real, name)
        if name not in ("mount", "umount2", "syscall"):
            return fn

        def call(*args):
            if name != "syscall" or args[0] == mountsys.SYS_MOVE_MOUNT:
                step(f"{name} {args[1] if name == 'mount' else args[0]!r}")
            return fn(*args)
        return call


mountsys._libc = Counted(mountsys._libc)
real_replace, real_kill = os.replace, os.kill


def replace(src, dst, *args, **kwargs):
    step(f"replace {dst}")
    return real_replace(src, dst, *args, **kwargs)


def kill(pid, sig):
    if pid != ME:
        step(f"kill {pid}")
    return real_kill(pid, sig)


os.replace, os.kill = replace, kill
from ogrefs.cli.entry import main
sys.argv[0] = "ogrefs"
main()
'''


def _shows_the_box(box, tmp, k: int) -> str:
    """Shell lines: every overlaid directory shows the snapshot, the box's writes and its later disk."""
    return f"""
        test "$(cat {box}/usr/marker)" = "snap"
        test "$(cat {box}/usr/written)" = "kept {k}"
        test "$(cat {box}/var/lib/app/written)" = "kept {k}"
        test "$(cat {box}/var/lib/app/data)" = "app data"
        test "$(cat {box}/mnt/from-snapshot)" = "snap mnt"
        test "$(cat {box}/mnt/later/f)" = "on the disk"
        cmp {box}/usr/lib/pkg/big.bin {tmp}/expected-big.bin
        echo "also $1" > {box}/usr/also-$1
    """


def _cycle(whole, killer, k: int) -> str | None:
    """Mount, write, finalize killed before step k, look, rerun, look again, unmount; None, or what failed."""
    box, tmp, snap = whole["box"], whole["tmp"], whole["snap"]
    state = f"{box}/var/lib/ogrefs/mounts/k{k}"
    run = tmp / f"run-{k}"  # the registration: of this k alone
    env = dict(whole["env"], KILL_AT=str(k), KILL_LOG=str(tmp / f"steps-{k}.txt"), OGREFS_RUNTIME_DIR=str(run))
    proc = in_namespace(env, f"""
        shows() {{ {_shows_the_box(box, tmp, k)} }}
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
        shows killed || {{ echo "after the kill at step {k}: the box does not show" >&2; \
            tail -n 3 {tmp}/steps-{k}.txt >&2; grep " {box}" /proc/self/mountinfo >&2; exit 1; }}
        rc=0; {OGREFS} finalize / > /dev/null 2> {tmp}/rerun.err || rc=$?
        test $rc = 0 || grep -q "already finalized" {tmp}/rerun.err || {{ cat {tmp}/rerun.err >&2; exit 1; }}
        ! grep "Traceback" {tmp}/rerun.err >&2
        shows rerun
        ! grep -F " {box}/" /proc/self/mountinfo | grep fuse.ogrefs >&2 \
            || {{ echo "step {k}: a FUSE mount is left" >&2; exit 1; }}
        {PY} -c "import sys; from ogrefs.box.records import pid_alive; sys.exit(pid_alive($daemon))" \
            || {{ echo "step {k}: the daemon $daemon still runs" >&2; exit 1; }}
        test "$(cat {box}/usr/also-killed)" = "also killed"
        umount {box}/mnt/later
        {OGREFS} unmount /
        test "$(cat {box}/usr/marker)" = "host"
        ! grep -E " - [a-z.]+ ogrefs" /proc/self/mountinfo | grep -F -e " {box}/" -e " {run}/" >&2 \
            || {{ echo "step {k}: left mounted after the unmount" >&2; exit 1; }}
    """, check=False)
    _kill_leftovers(run / "mounts")  # a failed k leaves its daemon and keeper: the next starts clean
    if proc.returncode == 0:
        return None
    done = (tmp / f"steps-{k}.txt").read_text().splitlines() if k else []
    step = done[k - 1] if len(done) >= k else f"not reached: {done[-1:]}"
    return f"killed before step {k} ({step}): {proc.stderr.strip()}"


def test_finalize_killed_before_each_step_leaves_the_box_shown(whole):
    killer = whole["tmp"] / "killer.py"
    killer.write_text(KILLER)
    assert _cycle(whole, killer, 0) is None  # a whole run: counts the steps
    steps = (whole["tmp"] / "steps-0.txt").read_text().splitlines()
    assert len(steps) >= 10, steps  # 3 overlays, each put up and taken down, and the FUSE lower
    failed = [why for k in range(1, len(steps) + 1) if (why := _cycle(whole, killer, k))]
    assert not failed, "\n".join(failed)
