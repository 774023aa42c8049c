"""Which OS release a root's programs belong to: glibc, systemd's major, OpenSSH; and whether two agree.

A whole box mounted at ``/`` puts its ``/usr`` under the programs this box
already runs (PID 1, journald, sshd, getty, this box's ogrefs). Within one
release that is what a package upgrade does to a live box; across releases
it is a box that cannot start a program: a Debian 12 ``/usr`` on a Debian 13
box left 49 library links pointing at 13's libraries over 12's glibc 2.36
(``GLIBC_2.38 not found`` in sed, ps, systemctl, sshd, numpy), systemd
could start no service (``systemd-executor`` needs ``GLIBC_2.41``); the other
way B's sshd re-exec'd A's newer one (``-R not supported here``: locked out).
So a snapshot records these versions (``machine`` in the environment, beside
``os``), and a mount at ``/`` compares them with this box's
(:func:`release_differences`).

Everything is read from files (the C library's version banner, the name of
systemd's shared library, OpenSSH's version string in ``sshd``); nothing is
executed, and a missing file gives ``None``, never an error.
"""

from __future__ import annotations

import glob
import os
import re

from ogrefs.inspect.files import open_regular

__all__ = ["glibc_version", "systemd_major", "openssh_version", "release_differences", "release_name"]

#: Where the C library lies on Debian, Ubuntu (multiarch) and RPM distributions (lib64).
LIBC_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "lib/x86_64-linux-gnu",
             "lib/aarch64-linux-gnu", "lib64", "usr/lib", "lib")
_LIBC_BANNER = re.compile(rb"GNU C Library [^\n\x00]*?version (\d+\.\d+)")
_OPENSSH = re.compile(rb"OpenSSH_(\d+\.\d+)")
_SYSTEMD_SHARED = re.compile(r"libsystemd-shared-(\d+)(?:[.-][^/]*)?\.so$")
#: A banner sits in the library's read-only data; this bounds what is read of a huge or hostile file.
MAX_SCAN_BYTES = 16 << 20


def _scan(path: str, pattern: re.Pattern[bytes]) -> str | None:
    """The first group of ``pattern`` in the regular file ``path`` (its first MAX_SCAN_BYTES), or None."""
    try:
        with open_regular(path, "rb", follow=True) as f:
            data = f.read(MAX_SCAN_BYTES)
    except OSError:
        return None
    m = pattern.search(data)
    return m.group(1).decode() if m else None


def glibc_version(root: str = "/") -> str | None:
    """``2.36``: the version in the banner of the root's ``libc.so.6`` (None: no glibc found)."""
    for d in LIBC_DIRS:
        found = _scan(os.path.join(root, d, "libc.so.6"), _LIBC_BANNER)
        if found:
            return found
    return None


def systemd_major(root: str = "/") -> int | None:
    """``252``: from the name of systemd's private shared library (``libsystemd-shared-252.so``), or None."""
    for pattern in ("usr/lib/systemd/libsystemd-shared-*.so", "usr/lib/*/systemd/libsystemd-shared-*.so",
                    "lib/systemd/libsystemd-shared-*.so", "usr/lib64/systemd/libsystemd-shared-*.so"):
        for path in sorted(glob.glob(os.path.join(glob.escape(root), pattern))):
            m = _SYSTEMD_SHARED.search(path)
            if m:
                return int(m.group(1))
    return None


def openssh_version(root: str = "/") -> str | None:
    """``9.2``: the upstream version in the version string in the root's ``sshd`` (the program a running sshd re-executes), or None."""
    for rel in ("usr/sbin/sshd", "sbin/sshd"):
        found = _scan(os.path.join(root, rel), _OPENSSH)
        if found:
            return found
    return None


def system_versions(root: str = "/") -> dict:
    """The fields :func:`ogrefs.inspect.machine.machine_info` records beside ``os``."""
    return {"glibc": glibc_version(root), "systemd": systemd_major(root), "openssh": openssh_version(root)}


def release_name(machine: dict) -> str:
    """``Debian GNU/Linux 12 (bookworm), glibc 2.36, systemd 252``: what of a machine record is known."""
    osr = machine.get("os") or {}
    name = osr.get("pretty_name") or " ".join(x for x in (osr.get("id"), osr.get("version_id")) if x) or "an unknown OS"
    parts = [name]
    if machine.get("glibc"):
        parts.append(f"glibc {machine['glibc']}")
    if machine.get("systemd"):
        parts.append(f"systemd {machine['systemd']}")
    return ", ".join(parts)


def release_differences(snapshot: dict, here: dict) -> list[str]:
    """How the snapshot's machine record and this box's differ in what a mixed ``/usr`` breaks.

    Compared only where both sides recorded it (a snapshot taken before
    glibc and systemd were recorded is still compared by its os-release).
    OpenSSH is compared by upstream version: a running sshd re-executes the
    program at its path for every login, and within one upstream version
    that re-exec works (Debian's point releases keep it).
    """
    out = []
    so, ho = snapshot.get("os") or {}, here.get("os") or {}
    for key, what in (("id", "OS"), ("version_id", "OS version")):
        if so.get(key) and ho.get(key) and so[key] != ho[key]:
            out.append(f"{what} {so[key]} here {ho[key]}")
    for key, what in (("glibc", "glibc"), ("systemd", "systemd"), ("openssh", "OpenSSH")):
        if snapshot.get(key) and here.get(key) and str(snapshot[key]) != str(here[key]):
            out.append(f"{what} {snapshot[key]} here {here[key]}")
    return out
