"""Issue 47's lab: box B's ``ogrefs`` command never depends on the snapshot it serves.

Box A's snapshot has a ``/usr/bin/python3`` that is not a Python (as a
snapshot of another release's or another version's Python is not B's), so
A's venv interpreter ``/opt/ogrefs/venv/bin/python`` — the same path as B's —
resolves to it too once A is mounted at ``/`` on B. A snapshots itself with
its Python 3.11 named explicitly. After ``ogrefs mount A:latest /`` on B,
B's ``status``, ``mounts`` and ``unmount`` (typed as ``ogrefs``, i.e.
``/usr/local/bin/ogrefs``, installed the README's way) must still work: they
run B's own interpreter and venv around the overlays (box/owncli.py). Before,
they ran A's ``python3`` and failed. Every step has a timeout.
"""

from __future__ import annotations

import json

import pytest

from tests.lab import fixtures
from tests.lab.box import Box
from tests.lab.providers import PROVIDERS
from .test_lab_mount_b import MOUNT_TIMEOUT_S, SNAP, lab, mount, mounts_of_kind  # noqa: F401

pytestmark = [pytest.mark.lab, pytest.mark.fuse, pytest.mark.slow]
A, B = PROVIDERS["a"], PROVIDERS["b"]

@pytest.fixture(scope="module")
def snap_broken_python(lab, tmp_path_factory):
    root = fixtures.prepared_box(lab["a"], tmp_path_factory.mktemp("lab-a") / "root")
    return fixtures.snapshot_box_a(root, tmp_path_factory.mktemp("lab-srv") / "ogrefs", python_not_b=True).repo_dir


def test_status_mounts_and_unmount_run_b_own_python_whatever_the_snapshot_python(lab, snap_broken_python, tmp_path):
    box = Box(fixtures.prepared_box(lab["b"], tmp_path / "root"), B, snap_broken_python,
              scratch_file="B's local NVMe\n").start()
    try:
        mount(box, "ogrefs")
        # what B's paths show now: A's python3, which is no Python, also as the venv's interpreter
        broken = box.sh("/opt/ogrefs/venv/bin/python -c 1", check=False)
        assert broken.returncode != 0 and "Python 3.99 of another release" in broken.stderr
        status = box.sh("ogrefs status / --json", timeout=60)
        assert json.loads(status.stdout)["mountpoint"] == "/", status.stderr
        listed = json.loads(box.out("ogrefs mounts --json", timeout=60))
        assert [(m["state"], m["target"]) for m in listed if m["state"] == "mounted"] == [("mounted", "/")]
        res = box.sh("ogrefs unmount /", timeout=MOUNT_TIMEOUT_S)
        assert "Traceback" not in res.stderr
        assert mounts_of_kind(box, "overlay", "fuse") == []
        assert box.out("/opt/ogrefs/venv/bin/python -c 'print(1)'") == "1\n"  # B's own again
        assert box.out("ls /run/ogrefs/rescue 2>/dev/null | wc -l").strip() == "0"  # the way around is gone
    finally:
        box.close()


AGENT = ("Package: provider-agent\nStatus: install ok installed\nPriority: optional\nSection: admin\n"
         "Maintainer: lab <lab@example.org>\nArchitecture: amd64\nVersion: 3.1\nDescription: B's provider's agent\n")


def test_b_dpkg_knows_b_own_packages_after_the_mount(lab, snap_broken_python, tmp_path):
    """Issue 47: a package only box B has (a provider's agent) keeps its files visible below the overlays, so
    B's dpkg must still list it and own its files; a package both have is A's (its files cover B's)."""
    root = fixtures.prepared_box(lab["b"], tmp_path / "root")
    with open(root / "var/lib/dpkg/status", "a") as fh:
        fh.write("\n" + AGENT)
    (root / "var/lib/dpkg/info/provider-agent.list").write_text("/.\n/usr\n/usr/bin\n/usr/bin/provider-agent\n")
    (root / "usr/bin/provider-agent").write_text("#!/bin/sh\necho agent of B\n")
    (root / "usr/bin/provider-agent").chmod(0o755)
    box = Box(root, B, snap_broken_python, scratch_file="B's local NVMe\n").start()
    try:
        mount(box, "ogrefs")
        assert box.out("provider-agent") == "agent of B\n"
        assert box.out("dpkg-query -W -f '${Version} ${Status}' provider-agent") == "3.1 install ok installed"
        assert box.out("dpkg -S /usr/bin/provider-agent").startswith("provider-agent: ")
        assert box.out("dpkg-query -W -f '${Version}' nvidia-driver-lab") == f"{B.driver}-1"  # the driver: B's
        assert box.out("dpkg --audit; echo audit $?").strip().endswith("audit 0")
    finally:
        box.close()
