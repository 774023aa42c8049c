"""Facts about the running machine: host, OS, kernel, CPU, memory.

Everything comes from files under /etc, /proc and /usr and from :mod:`os`;
nothing is executed.  Missing files give ``None`` fields, never errors.
"""

from __future__ import annotations

import os
import platform
import socket

from ogrefs.inspect.files import open_regular
from ogrefs.inspect.release import system_versions

__all__ = ["machine_info", "read_os_release"]


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


def machine_info() -> dict:
    """Hostname, OS release (with glibc, systemd's major and OpenSSH: inspect/release.py), kernel, architecture,
    CPU and memory."""
    uname = os.uname()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    return {
        "hostname": socket.gethostname() or uname.nodename,
        "os": read_os_release(),
        **system_versions(),
        "kernel": uname.release,
        "arch": uname.machine,
        "cpu": {"model": _cpu_model(), "count": os.cpu_count(), "usable": usable},
        "memory_bytes": _memory_bytes(),
    }
