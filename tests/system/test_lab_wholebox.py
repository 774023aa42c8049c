"""Issue 12's lab, part 1: the two provider boxes and box A's whole-box snapshot from inside.

Real parts: two debootstrap'd Debian 12 roots (tests/lab/roots.py, cached),
differing like two providers' images (tests/lab/providers.py), each with a
fake NVIDIA driver userspace that refuses a kernel module of another version
(tests/lab/fake_nvidia/); box A runs its own ogrefs on Debian's Python 3.11.2
in a chroot inside a private mount namespace (tests/lab/box.py) and
snapshots itself into a file:// repository under /srv and into S3 (the
SeaweedFS fixture, on loopback: the chroot shares the test's network
namespace).  Every step runs under a timeout.  Select with ``-m lab``.
"""

from __future__ import annotations

import json

import pytest

from tests.lab import fixtures
from tests.lab.box import Box
from tests.lab.providers import PROVIDERS

pytestmark = [pytest.mark.lab, pytest.mark.fuse, pytest.mark.slow]

A, B = PROVIDERS["a"], PROVIDERS["b"]
CUINIT = "/usr/bin/python3 -c 'import ctypes; print(ctypes.CDLL(\"libcuda.so.1\").cuInit(0))'"
NVML = ("/opt/ogrefs/venv/bin/python -c 'import pynvml\ntry:\n pynvml.nvmlInit(); "
        "print(pynvml.nvmlSystemGetDriverVersion())\nexcept pynvml.NVMLError as e: print(type(e).__name__)'")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    return fixtures.lab_roots()


@pytest.fixture(scope="module")
def box_a_root(lab, tmp_path_factory):
    return fixtures.prepared_box(lab["a"], tmp_path_factory.mktemp("lab-a") / "root")


@pytest.fixture(scope="module")
def snap_a(box_a_root, tmp_path_factory):
    return fixtures.snapshot_box_a(box_a_root, tmp_path_factory.mktemp("lab-srv") / "ogrefs")


def test_boxes_differ_like_two_providers(lab, tmp_path):
    """The premise: everything issue 12 lists differs between A and B."""
    sums = {}
    for name in ("a", "b"):
        box = Box(lab[name], PROVIDERS[name], tmp_path / "repo").start()
        try:
            sums[name] = fixtures.file_sums(box)
            assert box.out("cat /etc/hostname").strip() == PROVIDERS[name].hostname
            assert box.out("getent passwd 1000 | cut -d: -f1").strip() == PROVIDERS[name].user
            assert box.out("/usr/bin/python3 --version").strip() == "Python 3.11.2"
        finally:
            box.close()
    same = [p for p in fixtures.IDENTITY_FILES if sums["a"][p] == sums["b"][p]]
    assert same == [], f"A and B do not differ in {same}"


@pytest.mark.parametrize("name", ["a", "b"])
def test_fake_driver_refuses_a_kernel_module_of_another_version(lab, tmp_path, name):
    own, other = PROVIDERS[name], PROVIDERS["b" if name == "a" else "a"]
    box = Box(lab[name], own, tmp_path / "repo").start()
    try:
        smi = box.sh("nvidia-smi")
        assert f"Driver Version: {own.driver}" in smi.stdout
        assert box.out(CUINIT).strip() == "0"
        assert box.out(NVML).strip() == own.driver
        assert own.driver in box.out("ldconfig -p | grep libcuda.so.1; readlink -f /usr/lib/x86_64-linux-gnu/libcuda.so.1")
        assert box.out("dpkg-query -W -f '${Version}' nvidia-driver-lab") == f"{own.driver}-1"
        box.sh(f"printf %s '{other.kmod_line()}' > /run/nvidia-lab/version")  # the other provider's kernel module
        smi = box.sh("nvidia-smi", check=False)
        assert (smi.returncode, smi.stdout.strip()) == (18, "Failed to initialize NVML: Driver/library version mismatch")
        assert box.out(CUINIT).strip() == "803"
        assert box.out(NVML).strip() == "NVMLError_LibRmVersionMismatch"
    finally:
        box.close()


def test_whole_box_snapshot_from_inside_into_srv(snap_a):
    """A's own ogrefs, on Debian's Python 3.11.2, snapshots A as a whole box into file:///srv/ogrefs."""
    m = snap_a.manifest
    assert (m["whole_box"], m["paths"], m["host"]) == (True, ["/"], A.hostname)
    assert m["box"] == A.box  # its host name and its own machine id: not a clone's box of the same name
    assert m["totals"]["files"] > 10000 and m["unreadable"] == []
    skipped = {s["path"] for s in m.get("skipped_mounts", [])}
    assert "/mnt/scratch" in skipped, m.get("skipped_mounts")  # another disk (a tmpfs here): listed, not silent
    env = m["environment"]
    assert (env["gpus"]["driver_version"], env["gpus"]["cuda_driver_version"]) == (A.driver, A.cuda_text)
    assert {e["path"]: e["python"] for e in env["python_envs"]}["/opt/project/.venv"] == "3.11.2"
    assert "./train.py" in snap_a.project_sums and "./checkpoints/step-100.pt" in snap_a.project_sums


def test_whole_box_snapshot_from_inside_into_s3(box_a_root, seaweed, tmp_path):
    """The same box snapshots itself into S3 (SeaweedFS on loopback, reached from inside the chroot)."""
    bucket = seaweed.new_bucket()
    env = {**seaweed.env(), "OGREFS_REPO": f"s3://{bucket}/repo"}
    box = Box(box_a_root, A, tmp_path / "unused-repo", env=env).start()
    try:
        box.sh("ogrefs -q init")
        manifest = json.loads(box.out("ogrefs -q snapshot --whole-box --json", timeout=300))
        listed = json.loads(box.out("ogrefs snapshots --json"))
        assert [s["id"] for s in listed] == [manifest["id"]]
        assert listed[0]["host"] == A.hostname
        files = box.out("ogrefs restore latest /tmp/r --include /opt/project >/dev/null && "
                        "cd /tmp/r/opt/project && find . -type f -print0 | sort -z | xargs -0 sha256sum", timeout=300)
        assert files == box.out(fixtures.PROJECT_SUMS)
    finally:
        box.close()
        seaweed.delete_bucket(bucket)
