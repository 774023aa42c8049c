"""Writable mounts: kernel overlayfs over the lazy FUSE lower, at the original paths.

Layout of a mount's state directory (``--state-dir``, one per mount)::

    state/lower/            the FUSE mount of the snapshot (read-only, lazy)
    state/upper/<n>/        overlayfs upper dir of overlay n: every write lands here
    state/work/<n>/         overlayfs work dir of overlay n
    state/overlays.json     what is mounted where (for unmount, finalize, resume)

``plan`` decides the overlays: mounting at ``/`` gives one overlay per root
path of the snapshot, at that path (a whole-box snapshot: one per top-level
directory); any other target gets one overlay of the whole snapshot tree.
If a path already exists on this box, its content stays visible *below* the
snapshot's (it becomes the lowest layer). Paths a running system needs
(``/proc``, ``/sys``, ``/dev``, ``/run``, ``/boot``, ``/`` as a whole) are
refused unless ``force``.

Unmounting takes the overlays down in reverse order and keeps the upper
directories: mounting again with the same state directory resumes.
No locks here: the mount daemon's parent process owns these calls.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import OgrefsError, UsageError

PROTECTED = ("/proc", "/sys", "/dev", "/run", "/boot")
#: Top-level directories of a whole-box snapshot that are never overlaid, even with --force.
NEVER = ("/proc", "/sys", "/dev", "/run", "/tmp", "/lost+found")


class OverlayError(OgrefsError):
    """overlayfs refused a mount or an unmount."""


@dataclass(frozen=True)
class Overlay:
    target: str  # where it is mounted
    lower: str  # the snapshot's directory inside the FUSE mount
    upper: str
    work: str
    keep_existing: bool  # the target's previous content is the lowest layer


def _protected(path: str) -> str | None:
    if path == "/":
        return "/ as a whole"
    for p in PROTECTED:
        if path == p or path.startswith(p + "/"):
            return p
    return None


def plan(roots: list[str], lower_root: Path, target: Path, state_dir: Path, force: bool = False,
         top_level: list[str] | None = None) -> list[Overlay]:
    """The overlays that show the snapshot at ``target``; raises UsageError for protected paths.

    ``top_level``: names of the snapshot's top-level directories (for a
    whole-box snapshot), read from the catalog before anything is mounted.
    """
    target_s = os.path.abspath(str(target))
    if target_s != "/":
        why = _protected(target_s)
        if why and not force:
            raise UsageError(f"refusing to cover {target_s} on a running system (protected: {why}); "
                             "mount elsewhere, or add --force")
        return [Overlay(target_s, str(lower_root), str(state_dir / "upper" / "0"), str(state_dir / "work" / "0"),
                        keep_existing=False)]
    paths: list[str] = []
    for root in sorted(set(roots)):
        if root == "/":
            # A whole-box snapshot: one overlay per top-level directory it holds.
            # A whole-box snapshot: one overlay per top-level directory, leaving out the
            # ones a running system needs (they were not asked for by name).
            for name in sorted(top_level or []):
                p = "/" + name
                if p not in NEVER and (force or not _protected(p)):
                    paths.append(p)
        else:
            paths.append(root)
    refused = [(p, why) for p in paths if (why := _protected(p))]
    if refused and not force:
        names = ", ".join(p for p, _ in refused)
        raise UsageError(f"refusing to cover {names} on a running system (protected: {refused[0][1]}); "
                         "mount elsewhere, or add --force")
    overlays = []
    for i, p in enumerate(paths):
        for ch in (":", ",", "\\"):
            if ch in p:
                raise UsageError(f"{p}: overlayfs cannot take a path containing {ch!r}")
        overlays.append(Overlay(p, str(lower_root) + p, str(state_dir / "upper" / str(i)),
                                str(state_dir / "work" / str(i)), keep_existing=True))
    return overlays


def _run(args: list[str]) -> str | None:
    proc = subprocess.run(args, capture_output=True, text=True)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"exit status {proc.returncode}")


def mount_one(o: Overlay) -> None:
    for d in (o.upper, o.work):
        os.makedirs(d, mode=0o700, exist_ok=True)
    # overlayfs shows the upper directory's own attributes on the mount's root:
    # give it the snapshot directory's, or the root would read as 0700 root:root.
    st = os.stat(o.lower)
    if not os.listdir(o.upper):
        os.chown(o.upper, st.st_uid, st.st_gid)
        os.chmod(o.upper, stat.S_IMODE(st.st_mode))
        os.utime(o.upper, ns=(st.st_atime_ns, st.st_mtime_ns))
    lower = o.lower
    if o.keep_existing and os.path.isdir(o.target) and os.listdir(o.target):
        lower = f"{o.lower}:{o.target}"  # the box's own content stays visible below the snapshot's
    os.makedirs(o.target, exist_ok=True)
    err = _run(["mount", "-t", "overlay", "ogrefs", "-o",
                f"lowerdir={lower},upperdir={o.upper},workdir={o.work}", o.target])
    if err:
        raise OverlayError(f"overlay at {o.target} failed: {err}")


def mount_all(overlays: list[Overlay], state_dir: Path) -> None:
    done: list[Overlay] = []
    try:
        for o in overlays:
            mount_one(o)
            done.append(o)
    except BaseException:
        unmount_all(done)
        raise
    save(overlays, state_dir)


def unmount_all(overlays: list[Overlay], lazy: bool = False) -> list[str]:
    """Unmount in reverse order; returns the errors (empty when all went)."""
    errors = []
    for o in reversed(overlays):
        err = _run(["umount", *(["-l"] if lazy else []), o.target])
        if err and "not mounted" not in err:
            errors.append(f"{o.target}: {err}")
    return errors


def save(overlays: list[Overlay], state_dir: Path) -> None:
    path = state_dir / "overlays.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([asdict(o) for o in overlays], indent=1))
    os.replace(tmp, path)


def load(state_dir: Path) -> list[Overlay]:
    try:
        return [Overlay(**o) for o in json.loads((state_dir / "overlays.json").read_text())]
    except FileNotFoundError:
        return []
    except (ValueError, TypeError) as exc:
        raise OgrefsError(f"{state_dir}/overlays.json is damaged ({exc})") from None


def open_for_writing(paths: list[str]) -> list[str]:
    """Processes holding a file under any of ``paths`` open for writing ("pid name: file")."""
    out = []
    prefixes = tuple(p.rstrip("/") + "/" for p in paths)
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
                with open(f"/proc/{pid}/fdinfo/{fd}") as fh:
                    flags = _flags(fh.read())
            except OSError:
                continue
            if target.startswith(prefixes) and flags & (os.O_WRONLY | os.O_RDWR):
                try:
                    comm = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    comm = "?"
                out.append(f"{pid} {comm}: {target}")
    return out


def _flags(fdinfo: str) -> int:
    for line in fdinfo.splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    return 0
