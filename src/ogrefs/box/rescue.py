"""The way back when the keeper and the daemon are both killed: detach the overlays with this box's own tools.

When the daemon dies, the keeper detaches the overlays (keeper.py). When
both die at once (``kill -9`` of every ``ogrefs`` process, an OOM kill of
the cgroup), the overlays stay on a dead FUSE lower: every program under a
covered path (``/bin/sh``, ``umount``, ``ogrefs`` and its Python) fails to
start with "Transport endpoint is not connected". A shell that was already
running (the one that typed ``ogrefs mount``, an ssh session started before)
still runs, and so does everything outside the overlays.

So before any overlay goes up the keeper binds this box's own ``/usr``
read-only at ``<runtime>/rescue/<key>/usr`` (the runtime directory,
``/run/ogrefs``, is never overlaid) and, once they are up, writes
``<runtime>/rescue/<key>/detach.sh``: a POSIX shell script, sourced by a
running shell (``. /run/ogrefs/rescue/*/detach.sh``: ``.`` is a builtin, no
program is started through an overlay), that runs this box's ``umount -l``
through this box's dynamic loader from that bind, for every overlay, top-level
file and the FUSE lower. ``ogrefs unmount`` and ``ogrefs mount`` then work
again (they clean up and resume with every write). Teardown removes both.

Only where the loader is found (a 64-bit ELF ``umount`` whose interpreter
lies under ``/usr``, as on usr-merged Debian and Ubuntu); otherwise nothing
is prepared and the docs' other ways apply. No state beyond those files, no
locks: the keeper alone calls this, single-threaded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from ogrefs.box import mountsys, owncli
from ogrefs.box.owncli import elf_interpreter

log = logging.getLogger(__name__)

UMOUNTS = ("/usr/bin/umount", "/bin/umount", "/usr/sbin/umount", "/sbin/umount")


@dataclass(frozen=True)
class Rescue:
    """The bind of this box's /usr and the commands that run its umount through its loader."""
    directory: str  # <runtime>/rescue/<key>
    loader: str  # inside the bind
    umount: str  # inside the bind
    libdirs: tuple[str, ...]  # inside the bind

    def command(self, target: str) -> str:
        args = (self.loader, "--inhibit-cache", "--library-path", ":".join(self.libdirs), self.umount, "-c", "-l",
                target)
        return " ".join(shlex.quote(a) for a in args)


def _inside(usr_bind: str, real: str) -> str | None:
    return usr_bind + real[len("/usr"):] if real.startswith("/usr/") else None


def prepare(directory: Path) -> Rescue | None:
    """Before the overlays: bind this box's /usr read-only at ``directory/usr``; None if not possible."""
    umount = next((os.path.realpath(u) for u in UMOUNTS if os.path.isfile(u)), None)
    interp = elf_interpreter(umount) if umount else None
    loader = os.path.realpath(interp) if interp else None
    usr = str(directory / "usr")
    inside = [_inside(usr, p) if p else None for p in (loader, umount)]
    if None in inside:
        log.info("no rescue prepared: this box's umount or its loader is not under /usr")
        return None
    remove(directory)
    if os.path.ismount(usr):
        log.info("no rescue prepared: %s is still mounted", usr)
        return None
    try:
        os.makedirs(usr, mode=0o755, exist_ok=True)
        mountsys.bind_private_ro("/usr", usr)  # private: the /usr overlay must not propagate onto it
    except OSError as exc:
        log.info("no rescue prepared: %s", exc)
        return None
    libdirs = tuple(dict.fromkeys(_inside(usr, d) for d in (os.path.dirname(loader), "/usr/lib") if _inside(usr, d)))
    return Rescue(str(directory), inside[0], inside[1], libdirs)


def write_script(rescue: Rescue, mountpoint: str, overlays: list, top_files: list[str], lower: str,
                 host_layers: str) -> None:
    """After the overlays are up: the script that detaches them (and what stands on them), last first."""
    targets = [*(f"/{name.lstrip('/')}" for name in top_files), *(o.target for o in reversed(overlays)),
               host_layers, lower]
    lines = ["# ogrefs: detach this mount when its keeper and daemon are both gone (docs/mount.md).",
             "# From a shell that still runs:  . " + shlex.quote(rescue.directory + "/detach.sh"),
             "# Each line runs this box's own umount through its own loader, from a bind of its /usr",
             "# taken before the overlays; nothing here starts a program through them.",
             *(f"{rescue.command(t)} 2>/dev/null" for t in targets),
             f"echo {shlex.quote(f'ogrefs: detached; now run: ogrefs unmount {mountpoint}')}"]
    path = Path(rescue.directory) / "detach.sh"
    tmp = path.with_name("detach.sh.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.chmod(tmp, 0o700)
    os.replace(tmp, path)


def remove(directory: Path) -> None:
    """Teardown (and before a new one): detach the binds, remove the scripts; never deletes below a bind."""
    owncli.remove(directory)  # the ogrefs command's way around the overlays, in the same directory
    mountsys.umount(str(directory / "usr"), lazy=True)
    for p in (directory / "detach.sh", directory / "detach.sh.tmp"):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    for d in (directory / "usr", directory):  # rmdir: only an empty directory, never the box's /usr
        with contextlib.suppress(OSError):
            os.rmdir(d)


__all__ = ["Rescue", "prepare", "write_script", "remove", "elf_interpreter"]
