"""This box's own ``ogrefs`` command while a snapshot covers what it runs from: a way around the overlays.

After ``ogrefs mount SNAP /`` every path the ``ogrefs`` command runs from —
``/usr/bin/python3``, the venv it was installed in, its libraries — shows the
snapshot's files. A snapshot of another Python (another release, a venv of
another version, a broken link) made ``status``, ``unmount``, ``finalize``
and the unit's ``ExecStop`` fail with ``ModuleNotFoundError: No module named
'ogrefs'`` (issue 47): the command depended on what it serves. The daemon
never does (it lives in a mount namespace of its own, mount/daemon.py), but
the command must act in the box's namespace, on the overlays themselves.

So, before the overlays go up, the keeper (a fork of the ``mount`` command,
i.e. this box's interpreter with this box's ``sys.path``) takes a private,
read-only bind of each file system the command runs from (its interpreter,
dynamic loader, loaded libraries and ``sys.path``; each bind non-recursive)
at ``<runtime>/rescue/<key>/root`` (``/run`` is never overlaid), and writes
``ogrefs.sh`` beside it. The installed command (``contrib/ogrefs-command``,
a POSIX shell script) sources it: it opens that root as descriptor 9 and runs
this box's interpreter through this box's own dynamic loader with
``--inhibit-cache --library-path`` (as rescue.py runs ``umount``), with
``sys.path`` set to the same paths under ``/proc/self/fd/9``. Nothing it
loads resolves through an overlay, and the descriptor keeps the binds it runs
from reachable after ``unmount`` detached them. The binds are made private at
once: on a box whose ``/`` is shared (every systemd box), an overlay mounted
on ``/usr`` afterwards would otherwise propagate onto the bind of ``/usr``.

Only where an overlay of the mount covers one of those paths, and only when
every one of them is reached (a path on another ogrefs mount is not: the bind
would pin its FUSE session). No state beyond the binds and the script, no
locks: the keeper alone prepares, single-threaded; unmount and teardown
remove (rescue.remove).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from ogrefs.box import mountsys

log = logging.getLogger(__name__)

#: The file the installed command sources (contrib/ogrefs-command), in the rescue directory of a mount.
SCRIPT = "ogrefs.sh"
#: Where the command reads its own tree inside the process that sourced the script.
FD_ROOT = "/proc/self/fd/9"


def elf_interpreter(path: str) -> str | None:
    """PT_INTERP of a 64-bit little-endian ELF file, or None."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return None
            phoff, = struct.unpack_from("<Q", head, 32)
            phentsize, phnum = struct.unpack_from("<HH", head, 54)
            for i in range(phnum):
                fh.seek(phoff + i * phentsize)
                ph = fh.read(56)
                p_type, _flags, p_offset, _va, _pa, p_filesz = struct.unpack_from("<IIQQQQ", ph)
                if p_type == 3:
                    fh.seek(p_offset)
                    return fh.read(p_filesz).split(b"\0", 1)[0].decode()
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


@dataclass(frozen=True)
class Runtime:
    """What this process runs from, every path resolved (no symlink left to follow through an overlay)."""

    executable: str  # the base interpreter (a venv's python is a link to it)
    loader: str  # its PT_INTERP
    libdirs: tuple[str, ...]  # directories of the shared objects mapped now, the loader's first
    paths: tuple[str, ...]  # sys.path: the standard library, site-packages, what .pth files added

    def needed(self) -> tuple[str, ...]:
        return (self.executable, self.loader, *self.libdirs, *self.paths)


def _mapped_dirs() -> list[str]:
    """Directories of the shared objects this process has mapped (libc, libpython, libfuse3, ...)."""
    dirs: list[str] = []
    with contextlib.suppress(OSError), open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            parts = line.split(None, 5)
            path = parts[5].strip() if len(parts) == 6 else ""
            if path.startswith("/") and ".so" in os.path.basename(path) and not path.endswith(" (deleted)"):
                d = os.path.dirname(os.path.realpath(path))
                if d not in dirs:
                    dirs.append(d)
    return dirs


def current() -> Runtime | None:
    """This process's runtime; None when it is not a dynamically linked ELF interpreter, or already runs around."""
    exe = os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable)
    interp = elf_interpreter(exe)
    if not interp or exe.startswith(FD_ROOT + "/") or any(p.startswith(FD_ROOT + "/") for p in sys.path):
        return None
    loader = os.path.realpath(interp)
    libdirs = tuple(dict.fromkeys([os.path.dirname(loader), *_mapped_dirs()]))
    paths = tuple(dict.fromkeys(os.path.realpath(p) for p in sys.path if p and os.path.exists(p)))
    return Runtime(exe, loader, libdirs, paths)


def _under(path: str, top: str) -> bool:
    return top == "/" or path == top or path.startswith(top.rstrip("/") + "/")


def anchors(paths: tuple[str, ...], table: list[mountsys.MountRow]) -> list[mountsys.MountRow]:
    """The mount each path lies on (the deepest mount point above it), outermost first."""
    found: dict[str, mountsys.MountRow] = {}
    for p in paths:
        row = max((r for r in table if _under(p, r.point)), key=lambda r: len(r.point), default=None)
        if row is not None:
            found[row.point] = row
    return sorted(found.values(), key=lambda r: (r.point != "/", r.point.count("/"), r.point))


def prepare(directory: Path, covered: list[str], runtime: Runtime | None = None) -> str | None:
    """Before the overlays: the way around them for this box's command; the script's path, or None.

    ``covered`` are the targets of the overlays about to go up: nothing is
    prepared when none covers a path the command runs from.
    """
    rt = runtime or current()
    if rt is None or not any(_under(p, t) for p in rt.needed() for t in covered):
        return None
    remove(directory)  # a way of an earlier mount of this target (killed before its teardown)
    table = mountsys.mount_table()
    tops = anchors(rt.needed(), table)
    ours = [r.point for r in tops if mountsys.is_ogrefs(r)]
    if ours or not tops:
        log.info("no way around the overlays for the ogrefs command: it runs from %s", ", ".join(ours) or "?")
        return None
    root = directory / "root"
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
        for row in tops:
            target = str(root) + (row.point if row.point != "/" else "")
            os.makedirs(target, mode=0o755, exist_ok=True)
            mountsys.bind_private_ro(row.point, target)
    except OSError as exc:
        remove(directory)
        log.info("no way around the overlays for the ogrefs command: %s", exc)
        return None
    path = directory / SCRIPT
    tmp = path.with_name(SCRIPT + ".tmp")
    tmp.write_text(script(rt, str(root)))
    os.replace(tmp, path)
    return str(path)


def script(rt: Runtime, root: str) -> str:
    """The shell text the installed command sources: exec this box's interpreter around the overlays."""
    boot = (f"import os, sys\nsys.path[:] = [{FD_ROOT!r} + p for p in {list(rt.paths)!r}]\n"
            "os.set_inheritable(9, False)\nsys.argv[0] = 'ogrefs'\n"
            "from ogrefs.cli.entry import main\nsys.exit(main())\n")
    libs = ":".join(FD_ROOT + d for d in rt.libdirs)
    args = [FD_ROOT + rt.loader, "--inhibit-cache", "--library-path", libs, FD_ROOT + rt.executable, "-I", "-S",
            "-c", boot]
    q = shlex.quote
    return "\n".join([
        "# ogrefs: this box's own ogrefs command while a mount covers what it runs from (docs/mount.md,",
        "# \"The ogrefs command never depends on what it serves\"). Sourced by the installed command;",
        "# runs this box's interpreter through its own loader from a read-only bind of its own tree.",
        f"if [ -e {q(root + rt.executable)} ] && [ -e {q(root + rt.loader)} ]; then",
        "    unset LD_PRELOAD LD_LIBRARY_PATH LD_AUDIT",
        f"    exec 9<{q(root)}",
        "    exec " + " ".join(q(a) for a in args) + ' "$@"',
        "fi",
        "",
    ])


def remove(directory: Path) -> None:
    """Detach the binds (deepest first) and remove the script; never deletes anything below a bind."""
    root = str(directory / "root")
    for row in sorted((r for r in mountsys.mount_table() if _under(r.point, root)), key=lambda r: -len(r.point)):
        mountsys.umount(row.point, lazy=True)
    for p in (directory / SCRIPT, directory / (SCRIPT + ".tmp")):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    if any(_under(r.point, root) for r in mountsys.mount_table()):
        return  # still mounted: its directories stay
    for top, _dirs, _files in os.walk(root, topdown=False):  # the mount points made for the binds, if empty
        with contextlib.suppress(OSError):
            os.rmdir(top)


__all__ = ["Runtime", "current", "anchors", "prepare", "script", "remove", "elf_interpreter", "SCRIPT"]
