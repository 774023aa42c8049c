"""Which paths a snapshot visits: roots, excludes, mounts and the whole-box rules.

Mount points are decided by file-system type, never in silence: every mount
point the walk does not descend into is reported by :meth:`WalkRules.not_descended`
with its type and the reason, and the snapshot lists it in its manifest
(``skipped_mounts``).

* A whole-box snapshot descends into every *local disk* file system (ext4,
  xfs, btrfs, ... : a GPU box's ``/data`` or ``/workspace`` on a second NVMe
  is part of the box) and into ogrefs' own writable overlays (the box runs
  from a snapshot); it skips pseudo file systems (kernel views, tmpfs),
  network file systems, foreign FUSE file systems and overlays ogrefs did not
  make (container layers).
* A snapshot of named paths descends into everything below them except kernel
  views and ogrefs' own lazy FUSE lowers (the user named the paths).
* ``--one-file-system`` stays on the file system of each root: every other
  mount point below it is recorded as an empty directory and listed.

Roots themselves are always walked, whatever they are mounted from.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field

#: Never part of a whole-box snapshot: kernel views and volatile state (recorded as empty directories).
WHOLE_BOX_SKIP = (b"/proc", b"/sys", b"/dev", b"/run", b"/tmp", b"/var/tmp", b"/var/run", b"/var/lock",
                  b"/lost+found")

#: Kernel views: never descended into, whatever the snapshot.
KERNEL_FS = {"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "securityfs", "debugfs", "tracefs",
             "pstore", "bpf", "mqueue", "hugetlbfs", "configfs", "fusectl", "autofs", "binfmt_misc", "efivarfs",
             "nsfs", "rpc_pipefs", "selinuxfs", "ramfs"}
#: Memory and image file systems: not a disk of the box.
VOLATILE_FS = {"tmpfs", "squashfs", "iso9660", "erofs", "cramfs"}
#: Disk file systems: the box's own data, part of a whole-box snapshot.
LOCAL_DISK_FS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "jfs", "reiserfs", "bcachefs", "nilfs2",
                 "vfat", "exfat", "ntfs", "ntfs3", "hfsplus", "udf"}
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "9p", "afs", "lustre", "beegfs",
              "gpfs", "virtiofs", "orangefs", "ocfs2", "gfs2", "davfs"}
#: FUSE file systems that reach the network (named so the reason says so).
NETWORK_FUSE = {"fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone", "fuse.goofys", "fuse.juicefs",
                "fuse.glusterfs", "fuse.cephfs", "fuse.mountpoint-s3", "fuse.blobfuse2", "fuse.davfs2"}
OGREFS_FUSE = "fuse.ogrefs"


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


@dataclass(frozen=True)
class MountPoint:
    path: bytes
    fstype: str
    source: str
    options: str = ""  # the super block's options (an overlay's lowerdir=..., upperdir=...)
    mount_id: int | None = None  # mountinfo's first field


def mount_table() -> dict[bytes, MountPoint]:
    """The mount visible at each mount point this process sees (the last one stacked there wins)."""
    out: dict[bytes, MountPoint] = {}
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
            for line in fh:
                parts = line.split()
                try:
                    sep = parts.index("-")
                except ValueError:
                    continue
                point = _unescape_mountinfo(parts[4])
                source = parts[sep + 2] if len(parts) > sep + 2 else ""
                options = parts[sep + 3] if len(parts) > sep + 3 else ""
                out[point] = MountPoint(point, parts[sep + 1], source, options,
                                        int(parts[0]) if parts[0].isdigit() else None)
    except OSError:
        pass
    return out


def mounts() -> list[tuple[bytes, str]]:
    """(mount point, fs type) for every mount this process sees."""
    return [(m.path, m.fstype) for m in mount_table().values()]


def skip_reason(m: MountPoint, *, whole_box: bool, own_layers: frozenset[bytes]) -> str | None:
    """Why the walk does not descend into mount point ``m`` (None: it descends)."""
    t = m.fstype
    if m.path in own_layers:
        return None  # an ogrefs writable overlay: the box runs from it (snapshot.py knows how to read it)
    if t in KERNEL_FS:
        return "kernel file system"
    if t == OGREFS_FUSE:
        return "ogrefs mount of a snapshot already in a repository"
    if not whole_box:
        return None
    if t in VOLATILE_FS:
        return "memory or image file system, not a disk of this box"
    if t in NETWORK_FS or t in NETWORK_FUSE:
        return "network file system"
    if t.startswith("fuse"):
        return "FUSE file system not made by ogrefs"
    if t == "overlay":
        return "overlay not made by ogrefs (container layers)"
    if t in LOCAL_DISK_FS or m.source.startswith("/dev/"):
        return None
    return f"file system type {t!r} is not known to be a local disk"


@dataclass
class WalkRules:
    """Decides, per path, whether the walker descends or records."""

    excludes: list[str] = field(default_factory=list)
    skip_paths: set[bytes] = field(default_factory=set)
    cross_mounts: bool = True
    whole_box: bool = False
    own_layers: frozenset[bytes] = frozenset()
    table: dict[bytes, MountPoint] = field(default_factory=dict)
    #: (file name, required first bytes or None): a directory holding such a file is excluded (patterns.py)
    exclude_if_present: list[tuple[bytes, bytes | None]] = field(default_factory=list)

    @classmethod
    def for_whole_box(cls, excludes: list[str], extra_skip: list[bytes], cross_mounts: bool,
                      own_layers: frozenset[bytes] = frozenset()) -> "WalkRules":
        skip = set(WHOLE_BOX_SKIP) | {os.path.normpath(p) for p in extra_skip}
        return cls(excludes=excludes, skip_paths=skip, cross_mounts=cross_mounts, whole_box=True,
                   own_layers=own_layers, table=mount_table())

    @classmethod
    def for_paths(cls, excludes: list[str], cross_mounts: bool,
                  own_layers: frozenset[bytes] = frozenset()) -> "WalkRules":
        return cls(excludes=excludes, cross_mounts=cross_mounts, own_layers=own_layers, table=mount_table())

    def not_descended(self, path: bytes, *, is_root: bool, dev: int, root_dev: int) -> dict[str, str] | None:
        """None if the walk descends into directory ``path``; else {path, type, reason} to report.

        ``dev`` is the directory's st_dev, ``root_dev`` that of the root it was reached from.
        """
        m = self.table.get(path)
        if path in self.skip_paths:
            return {"path": os.fsdecode(path), "type": m.fstype if m else "directory",
                    "reason": "kernel view or volatile path, recorded empty"}
        if is_root:
            return None
        if not self.cross_mounts and (m is not None or dev != root_dev):
            return {"path": os.fsdecode(path), "type": m.fstype if m else "?",
                    "reason": "another file system (--one-file-system)"}
        if m is None:
            return None
        why = skip_reason(m, whole_box=self.whole_box, own_layers=self.own_layers)
        return None if why is None else {"path": os.fsdecode(path), "type": m.fstype, "reason": why}

    def submount(self, path: bytes) -> bool:
        """A mount point other than ogrefs' own overlays (a disk mounted inside, a directory bound back): it
        shows its own file system, never the mounted snapshot's catalog (snapshot/untouched.py)."""
        return path in self.table and path not in self.own_layers

    def descend(self, path: bytes) -> bool:
        """False for directories that are recorded empty (volatile paths and skipped mount points)."""
        return self.not_descended(path, is_root=False, dev=0, root_dev=0) is None

    def excluded(self, path: bytes, names=None) -> bool:
        """True if ``path`` must not be recorded at all (``--exclude`` patterns, ``--exclude-if-present``).

        ``names``: its names when known without looking (patterns.marked_directory).
        """
        if self.exclude_if_present:
            from ogrefs.snapshot.patterns import marked_directory

            if marked_directory(path, self.exclude_if_present, names):
                return True
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
