"""Issue 47's lab of releases: box A and box B of two Debian releases (12 bookworm, 13 trixie), both directions.

Box A (a chroot of one release) snapshots itself as a whole box; box B (the
other release) boots with systemd under nspawn with the shipped unit enabled
and naming box A, as a user who carries on on a new provider would set it up.
What must hold, each step under a timeout:

* the unit's ``ogrefs mount A:latest /`` refuses with one line naming both
  releases and the modes that work; the boot finishes; B mounted nothing;
* B stays usable: its tools (sed, ps, apt-get), its sshd binary (``sshd -t``),
  systemctl, the ogrefs CLI, its own os-release;
* A's training resumes in the mode the line names: ``ogrefs run`` (A's
  userland in its own root, with B's hostname and B's driver, which lies
  where no default rule looks and reaches A's root through B's linker cache,
  in A's own linker cache);
* ``ogrefs mount --data-only A:latest /`` brings A's project and /root back
  at their places, B still usable while it is mounted and after the unmount;
* B powers off.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.lab import fixtures
from tests.lab.nspawn import NspawnBox, box_b, nspawn_missing
from tests.lab.providers import PROVIDERS
from .test_lab_nspawn import install_unit

pytestmark = [pytest.mark.lab, pytest.mark.fuse, pytest.mark.slow]

A, B = PROVIDERS["a"], PROVIDERS["b"]
VERSION = {"bookworm": "12", "trixie": "13"}
STEP_TIMEOUT_S = 120
#: The repository and box as the unit has them (/etc/ogrefs/env), for the commands a user types.
ENV = "set -a && . /etc/ogrefs/env && set +a && "
#: What "B is usable" means: its own tools and libraries load, its sshd binary runs, systemd answers.
USABLE = ("sed --version | head -n 1 >/dev/null && ps -p 1 -o comm= && apt-get -v | head -n 1 >/dev/null && "
          "/usr/sbin/sshd -t && echo sshd-ok && systemctl is-system-running; "
          ". /etc/os-release && echo \"VERSION_ID=$VERSION_ID\" && /usr/local/bin/ogrefs mounts >/dev/null && "
          "echo cli-ok")


@pytest.fixture(scope="module")
def releases():
    reason = nspawn_missing()
    if reason:
        fixtures.skip_or_fail(reason)
    return {suite: fixtures.lab_roots(suite) for suite in VERSION}


@pytest.fixture(scope="module")
def snaps(tmp_path_factory):
    return fixtures.SnapshotsOfA(tmp_path_factory.mktemp("lab-a"))


def driver_elsewhere(root: Path) -> str:
    """Move B's driver libraries where the default host-path rules do not look (as a runfile installer or
    another distribution's packages may put them), named in B's linker configuration; returns the directory."""
    rel = "usr/lib64/nvidia-lab"
    (root / rel).mkdir(parents=True)
    lib = root / "usr/lib/x86_64-linux-gnu"
    for path in [*lib.glob("libcuda.so*"), *lib.glob("libnvidia-ml.so*")]:
        path.rename(root / rel / path.name)
    (root / "etc/ld.so.conf.d/nvidia-lab.conf").write_text(f"/{rel}\n")
    subprocess.run(["ldconfig", "-r", str(root)], check=True, timeout=60)
    return f"/{rel}"


def assert_b_usable(box: NspawnBox, b_suite: str) -> None:
    lines = box.out(USABLE, timeout=STEP_TIMEOUT_S).split()
    assert lines[0] == "systemd" and lines[1] == "sshd-ok", lines
    assert lines[2] in ("running", "degraded"), lines  # degraded: the lab's fake fstab (remount-fs)
    assert lines[3:] == [f"VERSION_ID={VERSION[b_suite]}", "cli-ok"], lines


@pytest.mark.parametrize("a_suite,b_suite", [("bookworm", "trixie"), ("trixie", "bookworm")])
def test_another_release_keeps_b_usable_and_resumes_a_in_its_own_root(releases, snaps, tmp_path, a_suite, b_suite):
    snap = snaps.copy(releases[a_suite]["a"], tmp_path / "srv")
    sid = snap.manifest["id"]
    recorded = snap.manifest["environment"]["machine"]
    assert recorded["os"]["version_id"] == VERSION[a_suite] and recorded["glibc"] and recorded["systemd"]
    root = fixtures.prepared_box(releases[b_suite]["b"], tmp_path / "b")
    install_unit(root, A.box)
    drivers = driver_elsewhere(root)  # found through B's linker cache: the toolkit's way (inspect/driverlibs.py)
    box = box_b(root, snap.repo_dir, tmp_path, B)
    try:
        box.boot()
        assert f"Driver Version: {B.driver}" in box.out("nvidia-smi")  # B's own, from there
        # the unit refused, with one line naming both releases and the modes that work; nothing mounted
        assert box.out("systemctl is-active ogrefs-resume.service", check=False).strip() == "failed"
        journal = box.out("journalctl -b -u ogrefs-resume.service --no-pager -o cat", check=False)
        said = [ln for ln in journal.splitlines() if ln.startswith("ogrefs: ")]
        assert len(said) == 1 and "Traceback" not in journal, journal
        assert f"refusing to mount snapshot {sid[:12]} at /: it is Debian GNU/Linux {VERSION[a_suite]}" in said[0]
        assert f"this box is Debian GNU/Linux {VERSION[b_suite]}" in said[0]
        assert f"`ogrefs run {sid[:12]} -- CMD`" in said[0] and "--data-only" in said[0], said[0]
        assert box.out("grep -c -E ' (overlay|fuse[.a-z]*) ' /proc/self/mounts || true").strip() == "0"
        assert_b_usable(box, b_suite)

        # A's training, in the mode the line names: A's userland in its own root, B's identity and driver
        inside = ("sh -c '. /etc/os-release && echo $VERSION_ID && cat /etc/hostname && "
                  "nvidia-smi | grep -o \"Driver Version: [0-9.]*\" && ldconfig -p | grep -c " + drivers + " && "
                  "cd /opt/project && .venv/bin/python train.py 2'")
        res = box.sh(f"{ENV}ogrefs -q run {sid[:12]} -- {inside}", timeout=STEP_TIMEOUT_S, check=False)
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
        lines = res.stdout.splitlines()
        assert lines[:5] == [VERSION[a_suite], B.hostname, f"Driver Version: {B.driver}", "4",
                             "resumed from step 100 loss 0.4321"], res.stdout + res.stderr
        assert lines[5].startswith("saved step 102 ")
        assert_b_usable(box, b_suite)

        # A's data paths back at their places, B's system its own meanwhile and after
        box.sh(f"{ENV}ogrefs -q mount --data-only {A.box}:latest /", timeout=STEP_TIMEOUT_S)
        assert box.out(fixtures.PROJECT_SUMS, timeout=STEP_TIMEOUT_S) == snap.project_sums
        assert box.out("cat /root/notes.txt").strip() == "box A's notes"
        assert_b_usable(box, b_suite)
        assert box.out("cat /etc/hostname") == f"{B.hostname}\n"
        box.sh("ogrefs unmount /", timeout=STEP_TIMEOUT_S)
        assert box.out("test -e /opt/project || echo gone").strip() == "gone"
        assert_b_usable(box, b_suite)
        box.poweroff()
    finally:
        box.close()


@pytest.mark.parametrize("suite", list(VERSION))
def test_the_same_release_mounts_at_root_and_b_keeps_logins_and_tools(releases, snaps, tmp_path, suite):
    """The same release (12 on 12, 13 on 13): the unit mounts A at /, A's training resumes there natively,
    and what B runs keeps working on A's /usr: its tools, systemctl, the CLI, and an ssh login through
    B's sshd (which executes the sshd program at its path for each login: the snapshot's now)."""
    snap = snaps.copy(releases[suite]["a"], tmp_path / "srv")
    root = fixtures.prepared_box(releases[suite]["b"], tmp_path / "b")
    install_unit(root, A.box)
    box = box_b(root, snap.repo_dir, tmp_path, B)
    key = tmp_path / "scratch/lab-key"  # the scratch disk: B's, at /mnt/scratch, whatever is mounted at /
    subprocess.run(["ssh-keygen", "-q", "-N", "", "-t", "ed25519", "-f", str(key)], check=True, timeout=60)
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
    try:
        box.boot()
        unit = box.out("systemctl is-active ogrefs-resume.service", check=False).strip()
        journal = box.out("journalctl -b -u ogrefs-resume.service --no-pager -o cat | tail -n 20", check=False)
        assert unit == "active", journal
        assert box.out(fixtures.PROJECT_SUMS, timeout=STEP_TIMEOUT_S) == snap.project_sums
        assert box.out("cd /opt/project && .venv/bin/python train.py 2", timeout=STEP_TIMEOUT_S).splitlines()[0] == (
            "resumed from step 100 loss 0.4321")
        assert_b_usable(box, suite)
        login = box.sh("ssh -i /mnt/scratch/lab-key -o BatchMode=yes -o StrictHostKeyChecking=no "
                       "-o UserKnownHostsFile=/dev/null -o ConnectTimeout=20 root@127.0.0.1 "
                       "'cat /etc/hostname; cat /root/notes.txt'", timeout=STEP_TIMEOUT_S, check=False)
        assert login.returncode == 0, login.stderr + box.out("journalctl -b -u ssh --no-pager | tail -n 20",
                                                             check=False)
        assert login.stdout.splitlines() == [B.hostname, "box A's notes"], login.stdout
        box.poweroff()
    finally:
        box.close()
