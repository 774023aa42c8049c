"""Which paths a snapshot visits: roots, excludes, mounts and the whole-box rules."""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field

#: Never part of a whole-box snapshot: kernel views and volatile state.
WHOLE_BOX_SKIP = (b"/proc", b"/sys", b"/dev", b"/run", b"/tmp", b"/var/tmp", b"/var/run", b"/var/lock",
                  b"/lost+found", b"/mnt", b"/media")

PSEUDO_FS = {"proc", "sysfs", "devtmpfs", "devpts", "tmpfs", "cgroup", "cgroup2", "securityfs", "debugfs",
             "tracefs", "pstore", "bpf", "mqueue", "hugetlbfs", "configfs", "fusectl", "autofs", "binfmt_misc",
             "efivarfs", "overlay", "fuse.ogrefs", "nsfs", "rpc_pipefs", "squashfs"}


def _unescape_mountinfo(field: str) -> bytes:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    out = bytearray()
    raw = field.encode("utf-8", "surrogateescape")
    i = 0
    while i < len(raw):
        if raw[i : i + 1] == b"\\" and i + 3 < len(raw) + 0 and raw[i + 1 : i + 4].isdigit():
            out.append(int(raw[i + 1 : i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return bytes(out)


def mounts() -> list[tuple[bytes, str]]:
    """(mount point, fs type) for every mount this process sees."""
    out = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
            for line in fh:
                parts = line.split()
                try:
                    sep = parts.index("-")
                except ValueError:
                    continue
                out.append((_unescape_mountinfo(parts[4]), parts[sep + 1]))
    except OSError:
        pass
    return out


@dataclass
class WalkRules:
    """Decides, per path, whether the walker descends or records."""

    excludes: list[str] = field(default_factory=list)
    skip_paths: set[bytes] = field(default_factory=set)
    cross_mounts: bool = True
    whole_box: bool = False

    @classmethod
    def for_whole_box(cls, excludes: list[str], extra_skip: list[bytes], cross_mounts: bool) -> "WalkRules":
        skip = set(WHOLE_BOX_SKIP) | {os.path.normpath(p) for p in extra_skip}
        if not cross_mounts:
            for point, fstype in mounts():
                if point != b"/":
                    skip.add(point)
        else:
            for point, fstype in mounts():
                if fstype in PSEUDO_FS and point != b"/":
                    skip.add(point)
        return cls(excludes=excludes, skip_paths=skip, cross_mounts=cross_mounts, whole_box=True)

    def descend(self, path: bytes) -> bool:
        """False for directories that are recorded empty (mount points of pseudo file systems)."""
        return path not in self.skip_paths

    def excluded(self, path: bytes) -> bool:
        """True if ``path`` must not be recorded at all (``--exclude`` patterns)."""
        if not self.excludes:
            return False
        text = os.fsdecode(path)
        base = os.path.basename(text)
        for pattern in self.excludes:
            if fnmatch.fnmatchcase(text, pattern) or fnmatch.fnmatchcase(base, pattern):
                return True
            if pattern.endswith("/") and fnmatch.fnmatchcase(text + "/", "*" + pattern):
                return True
        return False
