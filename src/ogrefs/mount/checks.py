"""What a mount checks in the calling process before it opens the repository or forks.

Each check raises with a one-line reason (UsageError) or returns it, so a
mount that cannot work fails at once, in the user's terminal, rather than in
a daemon's log. Runs in the calling thread; no state.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

from typing import TYPE_CHECKING, Any

from ogrefs.box.overlay import is_system, normalized
from ogrefs.box.records import Registration, pid_alive
from ogrefs.errors import UsageError
from ogrefs.box.mountsys import mounted_fstype

if TYPE_CHECKING:
    from ogrefs.mount.options import MountOptions


def fuse_problem() -> str | None:
    """Why a FUSE mount cannot work on this machine, or None."""
    if not os.path.exists("/dev/fuse"):
        return "FUSE is not available: /dev/fuse is missing (load the fuse module, or give the container the device)"
    if os.geteuid() != 0:
        if not os.access("/dev/fuse", os.R_OK | os.W_OK):
            return "FUSE is not available: no permission to open /dev/fuse"
        if shutil.which("fusermount3") is None:
            return "FUSE is not available: fusermount3 is not installed (package fuse3)"
    try:  # imported here on purpose: whether pyfuse3 loads is the question (the CLI works without it)
        from ogrefs.mount import fuse_ops  # noqa: F401
    except ImportError as exc:
        return f"FUSE support is not installed: pyfuse3 cannot be loaded ({exc})"
    except Exception as exc:  # noqa: BLE001 - a broken install: a pyfuse3 directory without its compiled module
        # (then a namespace package, which imports and has nothing in it), one built for another libfuse
        where = getattr(sys.modules.get("pyfuse3"), "__path__", None)
        return (f"FUSE support is broken: pyfuse3{f' in {list(where)[0]}' if where else ''} loads but is not "
                f"usable ({type(exc).__name__}: {exc}); reinstall it (pip install --force-reinstall pyfuse3)")
    return None


def check_mountpoint(mountpoint: Path) -> Path:
    """The absolute mountpoint of a FUSE mount: an existing, empty directory nothing is mounted on."""
    mp = Path(os.path.abspath(mountpoint))
    try:
        st = os.stat(mp)
    except FileNotFoundError:
        raise UsageError(f"mountpoint {mp} does not exist") from None
    except OSError as exc:
        raise UsageError(f"mountpoint {mp} is not usable ({exc.strerror}); a stale mount? try `ogrefs unmount {mp}`") \
            from None
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"mountpoint {mp} is not a directory")
    if mounted_fstype(mp) is not None:
        raise UsageError(f"{mp} is already a mount point")
    try:
        with os.scandir(mp) as it:
            if next(it, None) is not None:
                raise UsageError(f"mountpoint {mp} is not empty")
    except PermissionError:
        raise UsageError(f"mountpoint {mp} cannot be read (permission denied)") from None
    return mp


def check_target(target: Path) -> Path:
    """The absolute target of a writable mount: an existing directory that is no ogrefs mount already.

    Unlike a FUSE mountpoint it may be non-empty (its content stays visible below the snapshot's).
    """
    target = Path(os.path.abspath(target))
    info = Registration.for_mountpoint(target).read() or {}
    # A daemon that a lazy unmount detached (or whose keeper found it dead) no longer holds the
    # mountpoint; if it still holds the state directory, the state lock waits for it (bounded).
    going = info.get("detached") or info.get("died")
    if mounted_fstype(target) == "fuse.ogrefs" or (pid_alive(info.get("pid") or 0) and not going):
        raise UsageError(f"{target} is already an ogrefs mount; `ogrefs unmount {target}` first")
    if not os.path.exists(target):  # as a read-only mount: a typo must not create a directory
        raise UsageError(f"mountpoint {target} does not exist (create it first)")
    if not os.path.isdir(target):
        raise UsageError(f"{target} is not a directory")
    return target


def check_release(manifest: dict[str, Any], target: Path, opts: MountOptions) -> None:
    """At ``/``: refuse a snapshot of another OS release over this box's system directories (one line).

    Two releases' ``/usr`` never mix: this box's running programs (PID 1,
    sshd, getty, this ogrefs) would exec the snapshot's programs and load its
    libraries, and its own ``ldconfig`` would point the snapshot's programs at
    the wrong ones (docs/mount.md, "A box of another release"). The line names
    what works instead: the snapshot's programs in a root of their own
    (``ogrefs run``/``shell``) and its data paths at their places
    (``--data-only``). There is no override: ``--force`` does not mix releases.
    A snapshot that records no OS release is refused the same way (nothing
    proves it is this box's). Mounts elsewhere, and snapshots of data paths
    only, are not checked.
    """
    if normalized(str(target)) != "/" or opts.data_only:
        return
    if not (manifest.get("whole_box") or any(is_system(p) for p in manifest.get("paths") or [])):
        return
    from ogrefs.inspect.machine import machine_info
    from ogrefs.inspect.release import release_differences, release_name

    snap = (manifest.get("environment") or {}).get("machine") or {}
    here = machine_info()
    if (snap.get("os") or {}).get("id"):
        diffs = release_differences(snap, here)
        if not diffs:
            return
        what = f"it is {release_name(snap)} and this box is {release_name(here)} ({'; '.join(diffs)})"
    else:
        what = "it records no OS release to compare with this box's"
    sid = manifest["id"][:12]
    raise UsageError(
        f"refusing to mount snapshot {sid} at /: {what}; one release's programs do not run on the other's "
        f"libraries, so neither /usr may cover the other; run its programs in a root of their own with "
        f"`ogrefs run {sid} -- CMD` or `ogrefs shell {sid}`, and bring its data (/home, /root, /opt, /srv, ...) "
        f"back to their places with `ogrefs mount --data-only {opts.snapshot} /`")
