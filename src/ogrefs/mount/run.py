"""``ogrefs run SNAP -- CMD`` and ``ogrefs shell SNAP``: enter a snapshot's box without covering this one.

A child process moves to a private mount namespace (nothing it mounts is
seen by the rest of the box), mounts the snapshot writable at
``<run dir>/<snapshot>/root`` as one overlay — the snapshot's ``/`` over this
box's ``/``, host-owned paths from this box (hostpaths.py) and a linker
cache rebuilt there with this box's ldconfig — binds this box's ``/proc``,
``/sys``, ``/dev`` (GPU device nodes included), ``/run`` and its other mounts (data disks) into it, and runs
the command chrooted there (or under ``systemd-nspawn`` with ``--nspawn``).
When the command ends everything is taken down; its exit code is passed
through. Writes land in the state directory and are there on the next run
of the same snapshot (``--state-dir`` picks another).

Processes: the calling process only waits; the child (single-threaded when
it unshares) owns the namespace, the mount's keeper and daemon are forked
from it (docs/architecture.md). Where the snapshot is written into place
instead (no FUSE), :func:`run_in_place` runs the command supervised.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from ogrefs.box import mountsys, safepath
from ogrefs.mount.client import mount, unmount
from ogrefs.box.mountsys import mounted_fstype
from ogrefs.box.overlay import mounts_below, outermost
from ogrefs.errors import OgrefsError, UsageError
from ogrefs.store.base import StoreError

#: This box's file systems every program expects, bound into the root (recursively: /dev/pts, /dev/shm ...).
HOST_BINDS = ("proc", "sys", "dev", "run")


def run_dir() -> Path:
    return Path(os.environ.get("OGREFS_RUN_DIR") or "/var/lib/ogrefs/run")


def run(build_opts: Callable[[Path], Any], open_repo: Callable[[], Any], snapshot_id: Callable[[Any], str],
        command: list[str], *, nspawn: bool = False) -> int:
    """Fork the child that assembles and enters the root; returns the command's exit code."""
    if os.geteuid() != 0:
        raise UsageError("ogrefs run/shell needs root (it mounts and chroots)")
    if nspawn and shutil.which("systemd-nspawn") is None:
        raise UsageError("--nspawn: systemd-nspawn is not installed (package systemd-container)")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _child(build_opts, open_repo, snapshot_id, command, nspawn)
        except OgrefsError as exc:
            print(f"ogrefs: {exc}", file=sys.stderr)
            code = exc.exit_code
        except StoreError as exc:
            print(f"ogrefs: {exc}", file=sys.stderr)
        except OSError as exc:
            print(f"ogrefs: {exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}", file=sys.stderr)
        except KeyboardInterrupt:
            code = 130
        except BaseException:  # noqa: BLE001 - a bug: os._exit below would end the child without a word
            print("ogrefs: internal error in the child that enters the box:", file=sys.stderr)
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the command
    try:
        _, status = os.waitpid(pid, 0)
    finally:
        signal.signal(signal.SIGINT, previous)
    return _exit_code(status)


def run_in_place(command: list[str], needs: Callable[[str], bool], ensure: Callable[[str, bool], None],
                 settled: Callable[[], bool]) -> int:
    """``ogrefs run`` on a box whose snapshot is being written into place (no FUSE): the command's exit code.

    Nothing is mounted and nothing needs root: the command runs on this
    box's own tree, supervised (ogrefs.supervise), so that a path the
    snapshot has and the daemon has not written yet is waited for, not
    missed. ``needs``/``ensure``/``settled`` are the daemon's (see
    :func:`ogrefs.supervise.supervisor.supervise` for what each promises).
    Raises SupervisionUnavailable, one line, where the kernel refuses.
    """
    from ogrefs.supervise.supervisor import supervise
    return supervise(command, None, needs, ensure, settled=settled)


def run_on_copy(mountpoint: Path, command: list[str], say: Callable[[str], None]) -> int:
    """``ogrefs run`` against the no-FUSE mount at ``mountpoint``: the command's exit code.

    Supervised with what the daemon has not put in place yet (mount/pending.py); where the copy is
    complete already, run directly (a supervised call costs a kernel round trip, for nothing then).
    """
    from ogrefs.mount.control import NeedFailed
    from ogrefs.mount.pending import PendingPaths

    try:
        pending = PendingPaths.load(mountpoint)
    except NeedFailed as exc:
        raise OgrefsError(f"cannot ask the no-FUSE mount at {mountpoint} what is still to come: {exc.strerror}; "
                          "the same `ogrefs mount` resumes it") from None
    if pending.settled():
        say(f"the snapshot is all in place at {mountpoint}: running the job directly")
        return _fork_exec(command, lambda: None)
    say(f"running the job supervised: a path not in place yet at {mountpoint} ({len(pending)} to come) is waited "
        "for, not missed")
    with pending:
        return run_in_place(command, pending.needs, pending.ensure, pending.settled)


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _child(build_opts: Callable[[Path], Any], open_repo: Callable[[], Any], snapshot_id: Callable[[Any], str],
           command: list[str], nspawn: bool) -> int:
    mountsys.private_namespace()
    repo = open_repo()
    root = run_dir() / snapshot_id(repo)[:16] / "root"
    root.mkdir(parents=True, exist_ok=True, mode=0o755)
    opts = build_opts(root)
    mount(opts, open_repo=lambda: repo)
    bound: list[str] = []
    try:
        binds = ([f"/{name}" for name in HOST_BINDS] if not nspawn else []) + _host_disks(root)
        for source in binds:
            if _bind_inside(root, source):
                bound.append(str(root) + source)
        return _enter(root, command, nspawn)
    finally:
        for target in reversed(bound):
            mountsys.umount(target, lazy=True)
        with contextlib.suppress(OgrefsError):
            unmount(root, lazy=True)


def _bind_inside(root: Path, source: str) -> bool:
    """Bind this box's ``source`` at the same path inside ``root``; False (said on stderr) where it cannot be.

    The place is walked from the root's descriptor following no symlink of
    the snapshot's (a forged snapshot's ``/proc -> /etc`` would have root make
    and cover a directory outside the run's root) and made there if missing;
    the bind goes on that directory's descriptor. The source is this box's
    own, reached by safepath.
    """
    try:
        top = safepath.open_dir(str(root))[0]
        try:
            at = safepath.open_dir(source, create=True, start=top, follow=False)[0]
        finally:
            os.close(top)
        try:
            src = safepath.open_dir(source)[0]
            try:
                mountsys.bind(safepath.fd_path(src), safepath.fd_path(at), recursive=True)
            finally:
                os.close(src)
        finally:
            os.close(at)
    except (OSError, OgrefsError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(f"ogrefs: this box's {source} is not shown inside the snapshot ({why})", file=sys.stderr)
        return False
    return True


def _host_disks(root: Path) -> list[str]:
    """This box's other mounts (a data disk under /mnt, /srv, /home ...), outermost first, to show in the root."""
    skip = ("/proc", "/sys", "/dev", "/run", str(run_dir()), os.path.dirname(os.path.dirname(str(root))))
    found = [m for m in mounts_below("/")
             if m != "/" and not any(m == s or m.startswith(s.rstrip("/") + "/") for s in skip) and os.path.isdir(m)
             and mounted_fstype(Path(m)) not in ("overlay", "fuse.ogrefs")]
    return outermost(found)


def _enter(root: Path, command: list[str], nspawn: bool) -> int:
    if nspawn:
        # --keep-unit: stay in the caller's cgroup (no transient scope, so no machined or systemd PID 1 needed)
        args = ["systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "--link-journal=no",
                "--resolv-conf=off",
                "--timezone=off", "-D", str(root)]
        args += [f"--bind={p}" for p in sorted(Path("/dev").glob("nvidia*"))]
        return subprocess.run([*args, "--", *command]).returncode
    cwd = os.getcwd()

    def enter() -> None:
        os.chroot(root)
        os.chdir(cwd if os.path.isdir(cwd) else "/")

    return _fork_exec(command, enter)


def _fork_exec(command: list[str], prepare: Callable[[], None]) -> int:
    """Run ``command`` in a child (``prepare`` first, in it); its exit code, Ctrl-C its own."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            prepare()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execvp(command[0], command)
        except OSError as exc:
            print(f"ogrefs: cannot run {command[0]}: {exc.strerror}", file=sys.stderr)
        os._exit(127)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _, status = os.waitpid(pid, 0)
    finally:
        signal.signal(signal.SIGINT, previous)
    return _exit_code(status)
