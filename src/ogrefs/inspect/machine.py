"""Facts about the running machine: host, OS, kernel, CPU, memory.

Everything comes from files under /etc, /proc and /usr and from :mod:`os`;
nothing is executed.  Missing files give ``None`` fields, never errors.
"""

from __future__ import annotations

import math
import os
import platform
import socket

from ogrefs.inspect.files import open_regular
from ogrefs.inspect.release import system_versions

__all__ = ["cpu_quota", "machine_info", "read_os_release", "usable_cpus"]


def read_os_release(path: str = "/etc/os-release") -> dict:
    """The os-release fields ogrefs shows (``{}`` when unreadable)."""
    fields: dict[str, str] = {}
    try:
        with open_regular(path, "r", follow=True, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.strip()
                if not line or line.startswith("#") or "=" not in line:
                    continue
                key, _, value = line.partition("=")
                value = value.strip()
                if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                    value = value[1:-1]
                fields[key.strip()] = value
    except OSError:
        return {}
    return {
        k.lower(): fields[k]
        for k in ("PRETTY_NAME", "ID", "VERSION_ID", "VERSION_CODENAME")
        if k in fields
    }


def _cpu_model(path: str = "/proc/cpuinfo") -> str | None:
    try:
        with open_regular(path, "r", follow=True, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                # x86: "model name"; arm64: often only "CPU part" / none
                if key.strip() in ("model name", "Model", "cpu model", "Hardware"):
                    return value.strip() or None
    except OSError:
        pass
    return platform.processor() or None


def _memory_bytes(path: str = "/proc/meminfo") -> int | None:
    try:
        with open_regular(path, "r", follow=True, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    parts = line.split()
                    return int(parts[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_small(path: str, limit: int = 256) -> str | None:
    try:
        with open_regular(path, "r", follow=True, encoding="utf-8", errors="replace") as f:
            return f.read(limit)
    except OSError:
        return None


def _quota_in(directory: str, v2: bool) -> float | None:
    """The CPU limit one cgroup directory sets, in CPUs; None for none (or nothing readable there)."""
    if v2:
        text = _read_small(os.path.join(directory, "cpu.max"))  # "max 100000" or "350000 100000"
        fields = text.split() if text else []
        quota, period = (fields + ["max", "0"])[:2]
    else:
        quota = (_read_small(os.path.join(directory, "cpu.cfs_quota_us")) or "-1").strip()  # -1: none
        period = (_read_small(os.path.join(directory, "cpu.cfs_period_us")) or "0").strip()
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """How many CPUs this process's cgroups let it use (``docker run --cpus 3.5``, a pod's CPU limit: 3.5), or
    None where no limit is set.  cgroup v2 (``cpu.max``) or v1 (``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``); the process's own cgroup and every one above it count, the tightest wins.  In a
    container without a cgroup namespace the path ``/proc/self/cgroup`` names (``/docker/<id>``) is not
    below the mount, whose top is the container's own cgroup: the parts that exist are read."""
    text = _read_small(proc_cgroup, 64 * 1024)
    if text is None:
        return None
    limits = []
    for line in text.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        v2 = hier == "0" and controllers == ""
        if v2:
            base = root if os.path.exists(os.path.join(root, "cgroup.controllers")) else os.path.join(root, "unified")
        elif "cpu" in controllers.split(","):
            base = os.path.join(root, controllers)
            if not os.path.isdir(base):
                base = os.path.join(root, "cpu")
        else:
            continue
        parts = [p for p in path.split("/") if p and p not in (".", "..")]
        for n in range(len(parts), -1, -1):
            limit = _quota_in(os.path.join(base, *parts[:n]), v2)
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), no more than its cgroups' CPU limit rounded up: on a
    container limited to 8 CPUs of a 128-core host, 8 (``os.cpu_count()`` says 128).  At least 1."""
    return _usable(cpu_quota())


def _usable(quota: float | None) -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    if quota is not None:
        n = min(n, math.ceil(quota))
    return max(1, n)


def machine_info() -> dict:
    """Hostname, OS release (with glibc, systemd's major and OpenSSH: inspect/release.py), kernel, architecture,
    CPU and memory."""
    uname = os.uname()
    quota = cpu_quota()
    return {
        "hostname": socket.gethostname() or uname.nodename,
        "os": read_os_release(),
        **system_versions(),
        "kernel": uname.release,
        "arch": uname.machine,
        "cpu": {"model": _cpu_model(), "count": os.cpu_count(), "usable": _usable(quota), "quota": quota},
        "memory_bytes": _memory_bytes(),
    }
