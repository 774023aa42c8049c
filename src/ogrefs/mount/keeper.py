"""The keeper: the process that puts a writable mount's overlays up in the box and takes them down.

A writable mount is two processes (docs/architecture.md, "Processes and
namespaces")::

    keeper (box's mount namespace)        daemon (its own mount namespace)
      forks the daemon                      mounts FUSE at state/lower, then
                                            unshare(CLONE_NEWNS), private, and
                                            detaches its copy of the FUSE mount
      <- "fuse-ready"                       answers FUSE (trio), materializes
      host layers, overlays, bind-backs,
      ldconfig; registration; "ready" -> mount command
      waits for the daemon:
      <- "teardown" (SIGTERM/SIGINT)        waits for "done", then ends its loop
      detaches overlays and lower -> "done"
      EOF (daemon died, e.g. kill -9):
      detaches overlays and lower           (gone)

The daemon never sees an overlay: its imports, tracebacks, state, chunk
cache and local copy resolve in the box's original view, so nothing it does
waits on what it serves. The keeper does only system calls (mountsys) and
one fork+exec of the host's ldconfig through a descriptor opened before the
overlays; it never spawns through a covered path and is single-threaded.
When the daemon dies, the keeper detaches the overlays at once, so the box
falls back to its own tree (no "Transport endpoint is not connected"
everywhere) and a later ``ogrefs mount`` resumes with every write kept.

The keeper also holds, for its whole life, an O_PATH descriptor of each
overlay's own directory when the box's own content is the lowest layer
(overlay.mount_one ``hold_own``; overlays.json records the descriptor and the
directory's identity): a snapshot of the box reads that layer through
``/proc/<keeper>/fd/N`` where the path itself now reaches the overlay
(snapshot/mounted.py, untouched.py).

Who owns what: the keeper alone mounts and unmounts in the box's namespace
for a running mount (the ``unmount`` and ``finalize`` commands do it too,
after which the keeper finds nothing left to do). It writes the mount's
registration once, after the overlays are up; the daemon writes status.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ogrefs.box.records import Registration, load_overlays, process_start, save_overlays
from ogrefs.errors import OgrefsError
from ogrefs.box import holders, hostpaths, mountsys, overlay, owncli, rescue, topfiles
from ogrefs.repo import default_cache_dir

if TYPE_CHECKING:
    from ogrefs.mount.options import MountOptions
    from ogrefs.mount.plan import MountPlan

log = logging.getLogger(__name__)

TEARDOWN_TIMEOUT = 30.0
# systemd starts a Type=idle unit's program at most about 6 s after forking it; the rest is margin for load
UNSTARTED_TIMEOUT = 20.0


def read_line(fd: int, timeout: float | None) -> str:
    """One line from ``fd``; "" at EOF, "timeout" when ``timeout`` seconds pass first."""
    buf = b""
    deadline = None if timeout is None else time.monotonic() + timeout
    while b"\n" not in buf:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return "timeout"
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 1)  # byte by byte: the next line stays in the pipe for the next call
        if not chunk:
            return buf.decode(errors="replace")
        buf += chunk
    return buf.split(b"\n", 1)[0].decode(errors="replace")


def own_directories(plan: MountPlan) -> list[str]:
    """ogrefs' own directories: never covered by an overlay (bound back on top of it)."""
    return own_directories_of(plan.opts, plan.state_dir, plan.registration)


def own_directories_of(opts: MountOptions, state_dir: Path | None, registration: Registration) -> list[str]:
    """ogrefs' own directories of a mount (its state, caches, runtime directory, a local repository); the
    no-FUSE mount never writes the snapshot into them either."""
    paths = [state_dir, opts.cache_root or default_cache_dir(), opts.chunk_cache,
             registration.path.parent.parent]  # the runtime directory
    url = opts.repo_url or ""
    if url.startswith("file://"):
        paths.append(url[len("file://"):])
    elif url and "://" not in url:
        paths.append(url)
    out = []
    for p in paths:
        if p:
            p = overlay.normalized(os.path.abspath(str(p)))
            if os.path.isdir(p) and p not in out:
                out.append(p)
    return out


def wait_for_unstarted(timeout: float = UNSTARTED_TIMEOUT) -> None:
    """Before the overlays cover ``/``: let every program systemd has forked but not yet run start from this
    box's own tree (holders.unstarted: a getty at boot, Type=idle, held until the boot's jobs are done or
    about 6 s). Started from the overlays it would run the snapshot's program and hold the old tree (a
    restart of the boot unit refused, issue 47). The daemon's start runs meanwhile, so the boot waits for
    the longer of the two, not their sum."""
    start = time.monotonic()
    waited, left = holders.wait_started(timeout)
    if waited:
        log.info("waited %.1f s for %s, forked by systemd before the mount, to start its program from this "
                 "box's own tree", time.monotonic() - start, ", ".join(f"{h.comm} (pid {h.pid})" for h in waited))
    if left:
        log.warning("%s forked by systemd but not started after %.0f s: once started it runs the snapshot's "
                    "program", ", ".join(f"{h.comm} (pid {h.pid})" for h in left), timeout)


def bring_up(plan: MountPlan) -> dict[str, Any]:
    """After the FUSE lower answers: host layers, overlays, bind-backs, linker cache; what was done."""
    layout = plan.writable
    state = layout.state_dir
    mountsys.tune_readahead(state / "lower", plan.opts.readahead_kb)
    keep = own_directories(plan)
    host = hostpaths.prepare(layout.overlays, state, layout.host_paths)  # opens host files before they are covered
    target = str(layout.target)
    way_back = rescue.prepare(rescue_dir(plan.registration)) if target == "/" else None
    # the ogrefs command's way around overlays that cover what it runs from (its interpreter, its venv)
    around = owncli.prepare(rescue_dir(plan.registration), [o.target for o in host.overlays])
    if target == "/":
        wait_for_unstarted()
    refused: list[str] = []  # a user's symlink on the way to a target: that path keeps the box's own tree
    up = overlay.mount_all(host.overlays, state, keep=keep, hold_own=True, refused=refused)  # own fds: held
    for why in refused:
        log.warning("%s", why)
    owned = set(layout.host_paths.kept) if layout.host_paths is not None else set()
    shown = topfiles.show([e for e in layout.top_files or [] if "/" + e["name"] not in owned], state / "lower",
                          state)
    if way_back is not None:
        rescue.write_script(way_back, target, up, shown, str(state / "lower"), str(state / "host"))
    try:
        ldconfig = host.run_ldconfig()
    except OSError as exc:
        ldconfig = f"not run: {exc}"
    return {"overlays": [o.target for o in up], "binds": [b for o in up for b in o.binds],
            "host_kept": host.kept, "ldconfig": ldconfig, "own_directories": keep, "top_files": shown,
            "rescue": f"{way_back.directory}/detach.sh" if way_back else None, "command_around": around,
            "refused": refused, "exact": layout.host_paths.exact if layout.host_paths is not None else [],
            "not_exact": [list(x) for x in layout.host_paths.not_exact] if layout.host_paths is not None else []}


def rescue_dir(reg: Registration) -> Path:
    """``<runtime>/rescue/<key>``: the way back if keeper and daemon are both killed (rescue.py)."""
    return reg.path.parent.parent / "rescue" / reg.path.stem


def teardown(state_dir: Path, reg: Registration) -> list[str]:
    """Detach what of this mount is still up (not after finalize: those overlays are the box now)."""
    info = reg.read() or {}
    if info.get("finalized"):
        return []
    topfiles.hide(state_dir)
    errors = overlay.unmount_all(load_overlays(state_dir), lazy=True)
    if not errors:
        save_overlays([], state_dir)  # overlays.json says what is mounted: nothing now
    lower = state_dir / "lower"
    ours = mountsys.is_ogrefs(mountsys.mount_at(lower), "fuse.ogrefs")  # never what is not ogrefs' (issue 46)
    err = mountsys.umount(str(lower), lazy=True) if ours else None
    if not errors:
        hostpaths.unmount_layers(state_dir)
        rescue.remove(rescue_dir(reg))
    return errors + ([f"{state_dir}/lower: {err}"] if err else [])


def keep(plan: MountPlan, daemon_pid: int, from_daemon: int, to_daemon: int, ready_fd: int | None) -> int:
    """The keeper's life: bring the box up once the daemon is ready, take it down when it goes."""
    reg, state = plan.registration, plan.writable.state_dir

    def forward(signum: int, _frame: Any) -> None:
        with contextlib.suppress(OSError):
            os.kill(daemon_pid, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    line = read_line(from_daemon, 120.0)
    if line != "fuse-ready":
        forward(0, None)  # the daemon goes first: a foreground mount raises from _answer
        _reap(daemon_pid)
        teardown(state, reg)
        _answer(ready_fd, line if line.startswith("error ") else
                f"error the mount daemon exited before the mount was ready (log: {reg.log})")
        return 1
    try:
        done = bring_up(plan)
    except (OgrefsError, OSError) as exc:
        teardown(state, reg)
        forward(0, None)
        _reap(daemon_pid)
        _answer(ready_fd, f"error {exc}")
        return 1
    info = reg.read() or {}
    info.update(done, keeper_pid=os.getpid(), keeper_start=process_start(os.getpid()))
    reg.write(info)
    log.info("overlays up: %s; kept from the host: %s; ldconfig: %s", ", ".join(done["overlays"]),
             ", ".join(done["host_kept"]) or "nothing", done["ldconfig"])
    log.info("exact: %s; left merged: %s", ", ".join(done["exact"]) or "nothing",
             "; ".join(f"{p} ({why})" for p, why in done["not_exact"]) or "nothing")
    _answer(ready_fd, "ready")
    return _watch(state, reg, daemon_pid, from_daemon, to_daemon)


def _watch(state: Path, reg: Registration, daemon_pid: int, from_daemon: int, to_daemon: int) -> int:
    while True:
        line = read_line(from_daemon, None)
        if line == "teardown":
            for err in teardown(state, reg):
                log.warning("teardown: %s", err)
            with contextlib.suppress(OSError):
                os.write(to_daemon, b"done\n")
            continue
        if line == "":  # EOF: the daemon has exited, cleanly or not
            status = _reap(daemon_pid)
            errors = teardown(state, reg)
            if status != 0:
                info = reg.read()
                if info is not None:
                    info.update(died=True, pid=info.get("pid"))
                    reg.write(info)
                log.error("the mount daemon (pid %d) died (wait status %d): overlays detached, writes kept in %s",
                          daemon_pid, status, state)
            for err in errors:
                log.warning("teardown: %s", err)
            return 0 if status == 0 else 1


def _reap(pid: int) -> int:
    with contextlib.suppress(ChildProcessError):
        return os.waitpid(pid, 0)[1]
    return 0


def _answer(fd: int | None, line: str) -> None:
    if fd is None:
        if line != "ready":
            raise OgrefsError(line[len("error "):] if line.startswith("error ") else line)
        return
    with contextlib.suppress(OSError):
        os.write(fd, (line + "\n").encode())
        os.close(fd)


def describe(info: dict[str, Any]) -> str:
    """One line for ``mount``'s output: what was kept from this box."""
    notes = [k.split(": ", 1)[1].removesuffix(" (merged)") for k in info.get("host_kept") or [] if ": " in k]
    kept = [k for k in info.get("host_kept") or [] if ": " not in k]
    binds = info.get("binds") or []
    parts = []
    if kept:
        parts.append(f"kept from this box: {', '.join(kept[:12])}" + (f" and {len(kept) - 12} more"
                                                                        if len(kept) > 12 else ""))
    if binds:
        parts.append(f"still visible: {', '.join(binds)}")
    parts += info.get("refused") or []  # each a whole reason: a user's symlink kept a path from being covered
    return "; ".join(parts + notes)  # an account that gives way is said in full


__all__ = ["keep", "teardown", "bring_up", "describe", "own_directories", "read_line"]
