"""Lab fixtures shared by tests/test_lab_*.py: cached roots, box A's snapshot, box B copies.

Prerequisites that may truly be absent (root, debootstrap with a reachable
Debian mirror when the roots are not cached yet, systemd-nspawn) skip the lab
with the reason; with CI=true they fail instead, since CI must run it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from . import roots
from .box import Box
from .providers import PROVIDERS

PROJECT_SUMS = "cd /opt/project && find . -type f -print0 | sort -z | xargs -0 sha256sum"
#: Drops the page cache of box A's project in the box (POSIX_FADV_DONTNEED through dd), so that reading it
#: goes through the mount again. Not /proc/sys/vm/drop_caches: that drops every file's pages on the machine,
#: under the tests that run beside the lab and judge what the page cache holds (tests/pagecache.py).
DROP_PROJECT_PAGES = "sync && find /opt/project -type f -exec dd if={} iflag=nocache count=0 status=none ';'"
# What box B's own files are, read before anything is mounted (one command, compared after the mount).
IDENTITY_FILES = (
    "/etc/hostname", "/etc/machine-id", "/etc/hosts", "/etc/resolv.conf", "/etc/fstab",
    "/etc/network/interfaces", "/etc/systemd/network/10-cloud.network", "/etc/netplan/50-cloud-init.yaml",
    "/var/lib/cloud/instance/instance-id", "/var/lib/cloud/data/instance-id",
    "/etc/ssh/ssh_host_ed25519_key", "/etc/ssh/ssh_host_ed25519_key.pub", "/etc/ssh/ssh_host_ecdsa_key",
    "/etc/ssh/ssh_host_ecdsa_key.pub", "/etc/passwd", "/etc/group", "/etc/shadow",
    "/etc/sudoers.d/90-cloud-init-users", "/home/admin/.ssh/authorized_keys",
)


def skip_or_fail(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"lab prerequisite missing in CI: {reason}")
    pytest.skip(reason)


def _mirror_reachable(suite: str = roots.SUITE) -> str | None:
    try:
        with urllib.request.urlopen(f"{roots.MIRROR}/dists/{suite}/Release", timeout=15) as resp:
            resp.read(64)
    except OSError as exc:
        return f"the Debian mirror {roots.MIRROR} is unreachable ({exc}); the lab roots cannot be built"
    return None


def lab_roots(suite: str = roots.SUITE) -> dict[str, Path]:
    """Boxes A and B of Debian ``suite`` (roots.SUITES), built if missing (or the lab skipped, with the reason)."""
    reason = roots.check_prerequisites()
    if reason:
        skip_or_fail(reason)
    if not (roots.cache_root() / f"base-{roots.base_recipe_hash(suite)}").is_dir():
        roots.ensure_host_tools()
        if shutil.which("debootstrap") is None:
            skip_or_fail("debootstrap is not installed and could not be installed")
        reason = _mirror_reachable(suite)
        if reason:
            skip_or_fail(reason)
    return roots.box_roots(lambda m: print(f"lab: {m}"), suite)


def prebuild_lab_roots(suites: tuple[str, ...] = (roots.SUITE,)) -> None:
    """Build the roots of ``suites`` now if they can be (tests/conftest.py's collection hook); else leave it
    to lab_roots()."""
    if roots.check_prerequisites():
        return
    for suite in suites:
        if not (roots.cache_root() / f"base-{roots.base_recipe_hash(suite)}").is_dir():
            roots.ensure_host_tools()
            if shutil.which("debootstrap") is None or _mirror_reachable(suite):
                return
        try:
            roots.box_roots(lambda m: print(f"lab: {m}", flush=True), suite)
        except Exception as exc:  # lab_roots() builds again in the test and reports it there
            print(f"lab: building the {suite} roots before the tests failed: {exc}", flush=True)


def file_sums(box: Box, paths: tuple[str, ...] = IDENTITY_FILES) -> dict[str, str]:
    """sha256 (or "absent") of each path, as the box sees it."""
    script = "; ".join(f"if [ -e {p} ]; then sha256sum {p}; else echo absent {p}; fi" for p in paths)
    out = {}
    for line in box.out(script).splitlines():
        digest, path = line.split(None, 1)
        out[path] = digest
    return out


@dataclass
class SnapshotA:
    repo_dir: Path
    manifest: dict
    project_sums: str
    box_sums: dict[str, str]


#: Makes box A's /usr/bin/python3 no Python (as a snapshot of another release's Python is not B's): its venv's
#: interpreter, /opt/ogrefs/venv/bin/python, the same path as B's, resolves to it too.
NOT_A_PYTHON = ("printf '#!/bin/sh\\necho Python 3.99 of another release >&2\\nexit 1\\n' > /usr/bin/python3.new && "
                "chmod 0755 /usr/bin/python3.new && mv /usr/bin/python3.new /usr/bin/python3")
#: A's own ogrefs on its Python 3.11 by name, once its python3 is no Python.
A_OGREFS_BY_NAME = ("/usr/bin/python3.11 -c 'import sys; sys.path[:0] = [\"/opt/ogrefs/src\"]; import site; "
                    "site.addsitedir(\"/opt/ogrefs/venv/lib/python3.11/site-packages\"); sys.argv[0] = \"ogrefs\"; "
                    "from ogrefs.cli.entry import main; main()'")


def snapshot_box_a(root: Path, repo_dir: Path, python_not_b: bool = False) -> SnapshotA:
    """Box A snapshots itself as a whole box from inside, with its own ogrefs on Debian's Python.

    ``python_not_b``: A's ``/usr/bin/python3`` is first made no Python (:data:`NOT_A_PYTHON`).
    """
    box = Box(root, PROVIDERS["a"], repo_dir, scratch_file="A's scratch disk\n").start()
    try:
        ogrefs = "ogrefs"
        if python_not_b:
            box.sh(NOT_A_PYTHON)
            ogrefs = A_OGREFS_BY_NAME
        box.sh(f"{ogrefs} -q init")
        manifest = json.loads(box.out(f"{ogrefs} -q snapshot --whole-box --json", timeout=300))
        return SnapshotA(repo_dir, manifest, box.out(PROJECT_SUMS), file_sums(box))
    finally:
        box.close()


def prepared_box(cached: Path, dest: Path) -> Path:
    root = roots.copy_box(cached, dest)
    roots.install_ogrefs(root)
    return root


class SnapshotsOfA:
    """Box A's whole-box snapshot, made once per cached root and variant for a module's tests.

    Copying box A and snapshotting it from inside takes 10-20 s, the same for
    every test that only boots B against it. Each test gets its own copy of
    the repository (``cp -a``, under a second): a mount writes into it (its
    trace, its lock), and no test may see another's. A's copy is removed once
    snapshotted; the repository is all a test needs of it.
    """

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self._made: dict[tuple[str, bool], SnapshotA] = {}

    def copy(self, cached: Path, dest: Path, python_not_b: bool = False) -> SnapshotA:
        key = (str(cached), python_not_b)
        if key not in self._made:
            n = len(self._made)
            root = prepared_box(cached, self._workdir / f"a{n}")
            self._made[key] = snapshot_box_a(root, self._workdir / f"srv{n}", python_not_b)
            shutil.rmtree(root)
        made = self._made[key]
        subprocess.run(["cp", "-a", str(made.repo_dir), str(dest)], check=True, timeout=300)
        return dataclasses.replace(made, repo_dir=dest)
