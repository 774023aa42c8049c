"""Issue 12's lab, part 3: box B boots with systemd-nspawn and the shipped unit mounts box A's snapshot at /.

B's root gets contrib/ogrefs-resume.service, enabled, with /etc/ogrefs/env
naming the file:// repository under /srv (a bind mount, like the chroot lab)
and box A.  The boot must finish (the unit must not hang PID 1), B must stay
B (hostname, driver, disks) with A's project back and training resuming,
and the box must power off (the unit's ExecStop unmounts) within a timeout.
"""

from __future__ import annotations

import shutil
import time
from contextlib import contextmanager

import pytest

from tests.lab import fixtures, roots
from tests.lab.nspawn import box_b, nspawn_missing
from tests.lab.providers import PROVIDERS

pytestmark = [pytest.mark.lab, pytest.mark.fuse, pytest.mark.slow]

A, B = PROVIDERS["a"], PROVIDERS["b"]


@pytest.fixture(scope="module")
def lab():
    reason = nspawn_missing()
    if reason:
        fixtures.skip_or_fail(reason)
    return fixtures.lab_roots()


@pytest.fixture(scope="module")
def snaps(tmp_path_factory):
    return fixtures.SnapshotsOfA(tmp_path_factory.mktemp("lab-a"))


def install_unit(root, box_name: str) -> None:
    unit = root / "etc/systemd/system/ogrefs-resume.service"
    shutil.copy(roots.REPO / "contrib/ogrefs-resume.service", unit)
    wants = root / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    (wants / unit.name).symlink_to("/etc/systemd/system/ogrefs-resume.service")
    env = root / "etc/ogrefs/env"
    env.parent.mkdir(parents=True, exist_ok=True)
    env.write_text(f"OGREFS_REPO=file:///srv/ogrefs\nOGREFS_BOX={box_name}\n")
    env.chmod(0o600)


@contextmanager
def boot_b(lab, snaps, tmp_path, python_not_b: bool = False):
    """Box A's snapshot (made once for the module, a copy of its repository for this test); box B, with the
    unit enabled, boots; yields (NspawnBox, SnapshotA)."""
    snap = snaps.copy(lab["a"], tmp_path / "srv", python_not_b)
    root = fixtures.prepared_box(lab["b"], tmp_path / "b")
    install_unit(root, A.box)  # the user names box A on B: its name as `ogrefs snapshots` lists it
    box = box_b(root, snap.repo_dir, tmp_path, B)
    try:
        box.boot()
        yield box, snap
    finally:
        box.close()


def test_b_boots_with_the_shipped_unit_and_powers_off(lab, snaps, tmp_path):
    with boot_b(lab, snaps, tmp_path) as (box, snap):
        unit = box.sh("systemctl is-active ogrefs-resume.service", check=False).stdout.strip()
        journal = box.out("journalctl -b -u ogrefs-resume.service --no-pager | tail -n 30", check=False)
        assert unit == "active", f"unit {unit}, boot {box.state}:\n{journal}"
        assert box.out("cat /etc/hostname; hostname") == f"{B.hostname}\n{B.hostname}\n"
        assert f"Driver Version: {B.driver}" in box.out("nvidia-smi")
        assert box.out(f"cat /mnt/scratch/{B.hostname}.txt") == "B's local NVMe\n"
        assert box.out(fixtures.PROJECT_SUMS, timeout=60) == snap.project_sums
        assert box.out("cd /opt/project && .venv/bin/python train.py 3").splitlines()[0] == (
            "resumed from step 100 loss 0.4321")
        assert box.out("journalctl -b --no-pager -n 5 >/dev/null && echo journal").strip() == "journal"
        box.poweroff()


def test_booted_b_stops_and_restarts_the_unit(lab, snaps, tmp_path):
    """In the booted box: stopping the unit detaches everything (B is pure B, no crash), starting mounts again."""
    with boot_b(lab, snaps, tmp_path) as (box, snap):
        assert box.out(fixtures.PROJECT_SUMS, timeout=60) == snap.project_sums
        stop = box.sh("systemctl stop ogrefs-resume.service", timeout=120, check=False)
        assert stop.returncode == 0, f"{stop.returncode}: {stop.stderr}"
        assert box.out("grep -c -E ' (overlay|fuse[.a-z]*) ' /proc/self/mounts || true").strip() == "0"
        assert box.out("test -e /opt/project || echo gone").strip() == "gone"
        assert box.out("systemctl is-active ogrefs-resume.service", check=False).strip() == "inactive"
        box.sh("systemctl start ogrefs-resume.service", timeout=200)
        assert box.out(fixtures.PROJECT_SUMS, timeout=60) == snap.project_sums
        assert f"Driver Version: {B.driver}" in box.out("nvidia-smi")
        box.poweroff()


def test_restart_while_a_service_started_on_the_old_tree_runs_is_refused_naming_it(lab, snaps, tmp_path):
    """A service started after the mount runs the snapshot's /usr: after `systemctl stop` it keeps the old
    (lazily detached) tree and its daemon alive, so `systemctl start` must fail promptly and cleanly with one
    line naming it (no second writer of the same state); once it is stopped, start mounts again."""
    with boot_b(lab, snaps, tmp_path) as (box, snap):
        box.sh("systemd-run --unit=old-tree-user --property=WorkingDirectory=/opt/project sleep 600", timeout=60)
        holder = box.out("systemctl show -p MainPID --value old-tree-user.service").strip()
        stop = box.sh("systemctl stop ogrefs-resume.service", timeout=120, check=False)
        assert stop.returncode == 0, f"{stop.returncode}: {stop.stderr}"
        start = box.sh("systemctl start ogrefs-resume.service", timeout=200, check=False)
        assert start.returncode != 0
        assert box.out("systemctl is-active ogrefs-resume.service", check=False).strip() == "failed"
        said = [ln for ln in box.out("journalctl -b -u ogrefs-resume.service --no-pager -o cat").splitlines()
                if ln.startswith("ogrefs: ")]
        assert said and "unmounted lazily" in said[-1] and f"{holder} sleep" in said[-1], said
        assert "Traceback" not in box.out("journalctl -b -u ogrefs-resume.service --no-pager -o cat")
        assert box.out("test -e /opt/project || echo gone").strip() == "gone"  # nothing mounted by the refusal
        box.sh("systemctl stop old-tree-user.service", timeout=60)
        box.sh("systemctl reset-failed ogrefs-resume.service && systemctl start ogrefs-resume.service", timeout=200)
        assert box.out(fixtures.PROJECT_SUMS, timeout=60) == snap.project_sums
        box.poweroff()


ON_OVERLAY = ("python3 -c 'import os, sys\n"
              "ids = {l.split()[0] for l in open(\"/proc/self/mountinfo\") if \" - overlay ogrefs \" in l}\n"
              "fd = os.open(\"/proc/%s/exe\" % sys.argv[1], os.O_PATH)\n"
              "mid = [l.split()[1] for l in open(\"/proc/self/fdinfo/%d\" % fd) if l.startswith(\"mnt_id:\")][0]\n"
              "print(\"overlay\" if mid in ids else \"own\", len(ids))' ")


def wait_settled(box: NspawnBox, timeout: float = 150.0) -> str:
    """The unit's state once its restart is over, asked by short commands: a shell that lived through the
    restart would itself hold the old tree (and be named by the refused start)."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = box.out("systemctl is-active ogrefs-resume.service", check=False).strip()
        if state in ("active", "failed"):
            break
        time.sleep(1)
    return state


def test_restart_of_the_unit_works_with_sshd_running(lab, snaps, tmp_path):
    """sshd's listener started before the mount (the unit is ordered after it): it runs this box's own sshd and
    holds nothing of the old tree, so `systemctl restart` (from a login that then leaves) mounts again, twice."""
    with boot_b(lab, snaps, tmp_path) as (box, snap):
        sshd = box.out("systemctl show -p MainPID --value ssh.service").strip()
        assert box.out(ON_OVERLAY + sshd).split()[0] == "own"
        gettys = box.out("pgrep -x agetty || true").split()  # nspawn's console getty (console-getty.service)
        assert gettys, box.out("systemctl list-units --all --no-pager '*getty*'", check=False)
        where = [box.out(ON_OVERLAY + pid).split()[0] for pid in gettys]
        assert where == ["own"] * len(gettys), box.out(  # a restarted getty, or one exec'd after the overlays?
            "systemctl show -p NRestarts -p ExecMainPID -p ExecMainStartTimestampMonotonic 'console-getty.service'; "
            "journalctl -b -o short-monotonic --no-pager -u console-getty.service -u ogrefs-resume.service | "
            "tail -n 20", check=False)
        for _ in range(2):
            box.sh("systemctl --no-block restart ogrefs-resume.service", timeout=60)
            state = wait_settled(box)
            said = box.out("journalctl -b -u ogrefs-resume.service --no-pager -o cat | grep '^ogrefs: ' | tail -n 1",
                           check=False)
            assert state == "active", said
            assert box.out(fixtures.PROJECT_SUMS, timeout=60) == snap.project_sums
        box.poweroff()


def test_finalize_of_the_booted_box_once_its_local_copy_is_complete(lab, snaps, tmp_path):
    """Issue 47: on a booted box journald writes its journal under /var on B's own disk (opened before the
    mount): no writer on the overlays. Once `status --wait` says the copy is complete, `finalize /` from a
    login of the box works, and the box runs on with no daemon."""
    with boot_b(lab, snaps, tmp_path) as (box, snap):
        wait = box.sh("ogrefs status / --wait --timeout 400", timeout=420, check=False)
        assert wait.returncode == 0, wait.stdout[-1000:] + wait.stderr[-1000:]
        fin = box.sh("ogrefs finalize /", timeout=120, check=False)
        assert fin.returncode == 0 and "Traceback" not in fin.stderr, fin.stderr
        assert box.out("grep -c ' fuse.ogrefs ' /proc/self/mounts || true").strip() == "0"
        assert box.out(fixtures.PROJECT_SUMS, timeout=60) == snap.project_sums
        assert "finalized" in box.out("ogrefs mounts", timeout=60)
        box.poweroff()


def test_the_unit_stops_and_ogrefs_answers_whatever_the_snapshot_python(lab, snaps, tmp_path):
    """Issue 47: A's python3 (and so the venv interpreter at B's path) is no Python; B's `ogrefs status` and the
    unit's ExecStop still run B's own ogrefs (box/owncli.py), and the stop leaves pure B."""
    with boot_b(lab, snaps, tmp_path, python_not_b=True) as (box, snap):
        assert box.out("systemctl is-active ogrefs-resume.service", check=False).strip() == "active"
        assert box.sh("/opt/ogrefs/venv/bin/python -c 1", check=False).returncode != 0  # A's python3 now
        assert '"mountpoint": "/"' in box.out("ogrefs status / --json", timeout=60)
        stop = box.sh("systemctl stop ogrefs-resume.service", timeout=120, check=False)
        assert stop.returncode == 0, stop.stderr
        journal = box.out("journalctl -b -u ogrefs-resume.service --no-pager -o cat", check=False)
        assert "Traceback" not in journal and "ModuleNotFoundError" not in journal, journal[-2000:]
        assert box.out("grep -c -E ' (overlay|fuse[.a-z]*) ' /proc/self/mounts || true").strip() == "0"
        assert box.out("/opt/ogrefs/venv/bin/python -c 'print(1)'") == "1\n"
        box.poweroff()
