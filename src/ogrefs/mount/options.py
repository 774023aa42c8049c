"""What the user asked of a mount (``ogrefs mount``, ``run``, ``shell``): frozen, never rewritten.

What the caller resolves from it before the fork (the snapshot's id, the
FUSE mountpoint, the overlays, the state directory, the lock) is a
:class:`ogrefs.mount.plan.MountPlan`; what the daemon changes while it runs
belongs to the daemon (daemon.py). Keeping the three apart means every
process reads the same request, and nothing reads a field half-resolved.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class MountOptions:
    repo_url: str
    snapshot: str  # a snapshot id or selector; the plan holds the id it resolved to
    mountpoint: Path  # where the user sees the tree (a writable mount puts overlays there)
    s3_endpoint: str | None = None
    cache_root: Path | None = None  # repository cache (catalogs, manifests); default: XDG cache
    chunk_cache: Path | None = None  # default: <cache root>/chunks
    cache_size: int | None = None  # bytes; default: 10 GiB or a quarter of free space
    foreground: bool = False
    allow_other: bool = False
    retry_for: float = 60.0
    max_requests: int = 8
    memory_cache: int = 128 * 1024 * 1024
    readahead_kb: int = 16384  # kernel read-ahead of the mount (bdi), best effort
    log_level: str = "INFO"
    # writable mounts (issue 4): kernel overlayfs over the FUSE lower, see overlay.py
    read_only: bool = True
    state_dir: Path | None = None  # default: /var/lib/ogrefs/mounts/<snapshot>-<target key>
    force: bool = False  # allow covering /proc, /sys, /dev, /run, /boot, / as a whole
    materialize: bool = True  # writable mounts: copy everything to <state>/tree in the background
    passthrough: bool = True  # writable mounts: complete local copies read by the kernel (mount/passthrough.py)
    save_trace: bool | None = None  # record and store the access trace (default: writable mounts do)
    replay_trace: bool = True  # prefetch in the order of the recorded access trace, if there is one
    prefetch: bool | None = None  # fetch hints/trace in the background (default: writable yes, read-only no)
    encrypt_cache: bool = False  # seal chunk-cache files with a key derived from the repository key
    host_rules: tuple[Any, ...] | None = None  # writable mounts at /: hostpaths.Rule list (None: the defaults)
    no_fuse: bool = False  # write the snapshot into place instead of mounting it (inplace.py); automatic where
    # FUSE or mounting is not allowed
    ready_when_prepared: bool = False  # no-FUSE: return once the directories are made, not the working set in place
    # (`ogrefs run` starting its own copy: its supervised job waits for each path itself)
    data_only: bool = False  # at /: leave the snapshot's system directories (overlay.SYSTEM_DIRS) to this box
    inject_driver: bool = False  # run/shell: this box's running driver through its linker cache (driverlibs.py)
    merge_host: bool = False  # run/shell, data paths at /: this box's entries show where the snapshot has none
    box_root: bool = False  # writable: assemble a whole root at the mountpoint (ogrefs run/shell), host paths on
