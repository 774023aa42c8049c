"""The calling side of a mount: ``mount``, ``unmount`` and ``finalize``.

``mount`` checks everything that can fail early in the calling process (FUSE
present, mountpoint an empty directory, repository opened and unlocked,
snapshot exists, catalog readable: checks.py, plan.py), then forks a daemon
(double fork, new session; a writable mount's first child is its keeper) and
waits on a pipe until it writes ``ready`` (the kernel's FUSE INIT was
answered, so the root lists, and a writable mount's overlays are up) or
``error <reason>``. The daemon inherits the opened repository (no second
passphrase prompt or key stretching; this process only waits on the pipe
after the fork) and the shared lock, which it refreshes and releases.

``unmount`` and ``finalize`` work from the registration and the state
directory's ``overlays.json`` (box/records.py); both are all or nothing. Runs in
the calling thread; the only state is on disk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ogrefs.box.records import (MountError, Overlay, Registration, load_overlays, own_layer_root, pid_alive,
                                process_start, save_overlays, writable_state)
from ogrefs.errors import UsageError
from ogrefs.mount import keeper
from ogrefs.box import holders, hostpaths, mountsys, overlay, rescue, safepath, swap, topfiles
from ogrefs.mount.checks import check_mountpoint, check_target, fuse_problem
from ogrefs.mount.options import MountOptions
from ogrefs.mount.status import read_status
from ogrefs.repo import Repository

if TYPE_CHECKING:
    from ogrefs.mount.plan import MountPlan

log = logging.getLogger(__name__)

#: How long ``mount`` waits for the daemon's ``ready``.
READY_TIMEOUT = 120.0
#: How long ``mount`` waits for a no-FUSE mount's working set (all of it crosses the link first: a day).
IN_PLACE_READY_TIMEOUT = 86400.0
#: A lazy unmount waits this long for the daemon; one still serving open files after it is not an error.
LAZY_EXIT_WAIT_S = 2.0


# -- mounting -------------------------------------------------------------------------------------
def mount(opts: MountOptions, open_repo: Callable[[], Repository] | None = None,
          resolve: Callable[[Repository], dict[str, Any]] | None = None) -> MountPlan:
    """Mount and return the plan once ready (or, with ``foreground``, once unmounted).

    ``open_repo`` opens (and, if encrypted, unlocks) the repository; by
    default ``Repository.open`` of ``opts.repo_url``. ``resolve`` picks the
    snapshot's manifest under the mount's lock (default: ``repo.resolve``).
    The daemon inherits the opened repository across the fork, so a
    passphrase is asked and stretched once; this process does not touch it
    after forking.
    """
    if opts.no_fuse:
        return _mount_in_place(opts, open_repo, resolve)
    problem = fuse_problem()
    if problem:
        raise MountError(problem)
    mountpoint = check_mountpoint(opts.mountpoint) if opts.read_only else check_target(opts.mountpoint)
    # Imported here, not at the top: the mount path loads the lazy engine, trio and pyfuse3;
    # unmount, status and finalize use this module too and must start fast without them.
    from ogrefs.mount import launch, plan as planning

    repo = (open_repo() if open_repo is not None
            else Repository.open(opts.repo_url, s3_endpoint=opts.s3_endpoint, cache_root=opts.cache_root))
    # A shared lock before the snapshot is resolved: prune never deletes a pack this mount
    # may read (it defers packs it marked after this lock's creation).  The daemon takes it over.
    lock = repo.lock("shared", "mount").acquire()
    try:
        plan = planning.prepare(opts, repo, lock, mountpoint, resolve)
    except BaseException:
        lock.release()
        raise
    if opts.foreground:
        try:
            code = launch.run_keeper(plan, None) if plan.writable else launch.serve_here(plan)
        finally:
            lock.release()  # the daemon released it already, unless it failed to start
        if code:
            raise MountError(f"the mount of {plan.mountpoint} ended with an error (see above)")
        return plan
    _spawn_and_wait(plan, launch.daemon_child)
    return plan


def _mount_in_place(opts: MountOptions, open_repo: Callable[[], Repository] | None,
                    resolve: Callable[[Repository], dict[str, Any]] | None) -> Any:
    """The no-FUSE mount (mount/inplace.py): returns its plan once the working set is in place."""
    from ogrefs.mount import inplace

    repo = (open_repo() if open_repo is not None
            else Repository.open(opts.repo_url, s3_endpoint=opts.s3_endpoint, cache_root=opts.cache_root))
    lock = repo.lock("shared", "mount").acquire()
    try:
        plan = inplace.prepare(opts, repo, lock, resolve)
    except BaseException:
        lock.release()
        raise
    if opts.foreground:
        if inplace.InPlaceDaemon(plan, None).run():
            raise MountError(f"the no-FUSE copy to {plan.target} did not complete (see above)")
        return plan
    _spawn_and_wait(plan, inplace.daemon_child, timeout=IN_PLACE_READY_TIMEOUT)
    return plan


def _spawn_and_wait(plan: Any, child: Callable[[Any, int], int], timeout: float = READY_TIMEOUT) -> None:
    """Double fork (new session) into ``child``; wait on its pipe for ``ready`` or ``error <reason>``."""
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    try:
        pid = os.fork()
    except BaseException:
        plan.lock.release()
        raise
    if pid == 0:  # the intermediate child: detach and leave
        code = 1
        try:
            os.close(r)
            os.setsid()
            code = child(plan, w) if os.fork() == 0 else 0
        finally:
            os._exit(code)
    plan.lock.hand_over()  # the daemon refreshes and releases it from now on
    os.close(w)
    os.waitpid(pid, 0)
    line = _read_line(r, timeout)
    os.close(r)
    if line == "ready":
        return
    if line.startswith("error "):
        raise MountError(line[len("error "):])
    reg = plan.registration
    info = reg.read()
    if info and pid_alive(info.get("pid", 0)):
        with contextlib.suppress(OSError):
            os.kill(info["pid"], signal.SIGTERM)
    if line == "timeout":
        raise MountError(f"the mount did not become ready within {timeout:.0f} s (log: {reg.log})")
    raise MountError(f"the mount daemon exited before the mount was ready (log: {reg.log})")


def _read_line(fd: int, timeout: float) -> str:
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return "timeout"
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    return buf.split(b"\n", 1)[0].decode(errors="replace")


# -- unmount ------------------------------------------------------------------------------------------
class NotMounted(UsageError):
    """Nothing ogrefs mounted is at the path: ``unmount`` touched nothing (``--if-mounted``: not an error)."""


def unmount(mountpoint: Path, *, lazy: bool = False, timeout: float = 30.0) -> str | None:
    """Unmount; with ``lazy``, a note when the daemon outlives the detach (it serves what is still open).

    Only what ogrefs mounted is ever unmounted: the FUSE mount and the
    overlays it recorded over it, each checked against mountinfo right before
    its umount2 (mountsys.is_ogrefs).
    Anything else at the path (the box's root, a disk) raises :class:`NotMounted`.
    """
    mp = Path(os.path.abspath(mountpoint))
    reg = Registration.for_mountpoint(mp)
    info = reg.read()
    pid = info.get("pid") if info else None
    if info and info.get("in_place"):
        return _stop_in_place(mp, reg, info, timeout)
    if info and (info.get("writable") or info.get("finalized")):
        return _unmount_writable(mp, reg, info, lazy, timeout)
    row = mountsys.mount_at(mp)
    if not mountsys.is_ogrefs(row, "fuse.ogrefs"):
        if pid and pid_alive(pid):  # (unmounted before, its daemon still serving: fuse_dev says which mount)
            _wait_exit(pid, timeout, mp, info.get("fuse_dev", "") if info else "")
            return None
        raise NotMounted(_not_ours(mp))
    _note_fuse_dev(reg, info, row)
    _unmount_fuse(mp, lazy)
    if pid and pid_alive(pid):
        _wait_exit(pid, timeout, mp, row.dev if row else "")
    return None


def _note_fuse_dev(reg: Registration, info: dict | None, row: mountsys.MountRow | None) -> None:
    """Keep the FUSE mount's device in its record before unmounting it: a daemon that outlives the unmount (another
    namespace holds a copy) is then still named by a later ``unmount``, when the mount is gone from here."""
    if info and row and row.dev and info.get("fuse_dev") != row.dev:
        with contextlib.suppress(OSError):
            reg.write({**info, "fuse_dev": row.dev})


def _stop_in_place(mp: Path, reg: Registration, info: dict, timeout: float) -> str:
    """A no-FUSE mount: nothing is mounted; its daemon (if it still copies) stops after its batch, and what is
    in place stays (it is this box's own disk now). Its record goes."""
    pid = info.get("pid")
    if pid and pid_alive(pid):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
        _wait_exit(pid, timeout, mp)
    m = (reg.read() or info).get("materialize") or {}
    reg.remove()
    with contextlib.suppress(OSError):
        (reg.path.with_suffix(".sock")).unlink()
    if m.get("complete"):
        return f"{mp}: the snapshot was written in place (no-FUSE mode); nothing was mounted, its record is cleared"
    return (f"{mp}: the no-FUSE copy stopped with {m.get('files_done', 0)} of {m.get('files_total', '?')} files "
            "in place (they stay); the same `ogrefs mount` resumes it")


def _not_ours(mp: Path) -> str:
    """The one line for a path with nothing of ogrefs' mounted: what is there instead, and that it stays."""
    row = mountsys.mount_at(mp)
    there = (f"{row.fstype} from {row.source or '?'} is mounted there, not by ogrefs" if row
             else "nothing is mounted there")
    return f"{mp} is not mounted by ogrefs ({there}); nothing was unmounted"


def _unmount_fuse(mp: Path, lazy: bool) -> None:
    """Unmount a read-only FUSE mount: by system call as root, else with fusermount3 (or umount)."""
    if os.geteuid() == 0:  # by system call: nothing spawned, whatever covers the programs' paths
        err = mountsys.umount(str(mp), lazy=lazy)  # the caller checked that ogrefs' FUSE mount is on top
        if err == "target is busy":
            raise MountError(f"{mp} is busy (files or directories in use); close them or use --lazy")
        if err:
            raise MountError(f"cannot unmount {mp}: {err}")
        return
    if shutil.which("fusermount3"):
        cmd = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [str(mp)]
    else:
        cmd = ["umount"] + (["-l"] if lazy else []) + [str(mp)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        reason = (res.stderr.strip().splitlines() or [f"{cmd[0]} failed"])[-1]
        if "busy" in reason.lower():
            raise MountError(f"{mp} is busy (files or directories in use); close them or use --lazy")
        raise MountError(f"cannot unmount {mp}: {reason}")


def _unmount_writable(mp: Path, reg: Registration, info: dict, lazy: bool, timeout: float) -> str | None:
    """Overlays in reverse order, then the FUSE lower; the upper directories stay for the next mount."""
    state, pid = Path(info["state_dir"]), info.get("pid")
    lower_ours = mountsys.is_ogrefs(mountsys.mount_at(state / "lower"), "fuse.ogrefs")
    if not (lower_ours or overlay.still_mounted(load_overlays(state)) or (pid and pid_alive(pid))):
        _record_overlays([], state)  # the daemon died and its keeper (or detach.sh) took everything down
        reg.remove()
        return f"nothing of ogrefs' was mounted at {mp} any more (its daemon had died); its record is cleared"
    targets = [o.target for o in load_overlays(state)]
    callers = [] if lazy else holders.callers_or_refuse(f"unmount {mp}", targets, info)
    lazy = lazy or bool(callers)  # only the caller's own shell holds them: it lets go after we return
    # their ids stay theirs once detached: a later mount names who still holds the old tree by them
    tree_ids = {str(i): t for t in targets for i in holders.mount_ids([t])}
    tree_ids.update({str(i): str(state / "lower") for i in holders.mount_ids([str(state / "lower")], "fuse.ogrefs")})
    errors = overlay.unmount_all(load_overlays(state), lazy=lazy, keep=info.get("own_directories") or [])
    if errors:
        _record_overlays(overlay.still_mounted(load_overlays(state)), state)  # what is mounted now
        hint = "; close what uses it or use --lazy" if "busy" in errors[0].lower() else ""
        if len(errors) > 1:  # some could not be mounted again: say the box is mixed
            raise MountError(f"cannot unmount {errors[0]}; and {'; '.join(errors[1:])}: those show this "
                             f"box's own files now, the others the snapshot's{hint}")
        raise MountError(f"cannot unmount {errors[0]}: nothing was unmounted{hint}")
    _record_overlays([], state)  # what is mounted now: nothing (the upper directories stay)
    topfiles.hide(state)
    hostpaths.unmount_layers(state)
    rescue.remove(keeper.rescue_dir(reg))
    overlay.unmount_shims(state)
    if info.get("finalized") or not (pid and pid_alive(pid)):
        if lower_ours:
            mountsys.umount(str(state / "lower"), lazy=True)
        reg.remove()
        return None
    lower = mountsys.mount_at(state / "lower") if lower_ours else None
    _note_fuse_dev(reg, reg.read() or info, lower)
    err = mountsys.umount(str(state / "lower"), lazy=lazy) if lower_ours else None
    if err:
        raise MountError(f"cannot unmount {state / 'lower'}: {err} (the overlays are down; use --lazy)")
    if not lazy:
        _wait_exit(pid, timeout, mp, lower.dev if lower else info.get("fuse_dev", ""))
        return None
    # Detached: processes that still hold files of the snapshot (a shell started from the /usr
    # overlay, the unmount command itself) keep them, served by the daemon, which exits when the
    # last of them lets go (the kernel's DESTROY). The box itself shows its own tree already.
    try:
        _wait_exit(pid, min(timeout, LAZY_EXIT_WAIT_S), mp)
        return None
    except MountError:
        reg.write({**(reg.read() or info), "detached": True, "detached_mounts": tree_ids})
        who = f" ({', '.join(str(h) for h in callers[:3])})" if callers else ""
        return (f"{mp} is detached; its daemon (pid {pid}) goes on serving the processes that still use "
                f"the snapshot's files{who} and exits when the last of them does")


def _record_overlays(overlays: list[Overlay], state: Path) -> None:
    """Say in overlays.json what is mounted now, on a full state disk too.

    Nothing mounted needs no space (the file goes: no file means none). A
    list that cannot be written leaves the old one, a superset of what is up:
    harmless to a later unmount, which checks each against mountinfo first.
    """
    try:
        save_overlays(overlays, state)
    except OSError as exc:
        log.warning("could not record the overlays still mounted in %s/overlays.json: %s", state, exc)


def _wait_exit(pid: int, timeout: float, mp: Path, dev: str = "") -> None:
    """Wait for the daemon ``pid`` to exit; if it does not, say why when another mount namespace still has its FUSE
    mount (super block ``dev``): the kernel keeps the connection for that copy and the daemon serves it."""
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            held = holders.other_namespaces(dev, "fuse.ogrefs", exclude={pid})
            if held:
                h = held[0]
                more = f" and {len(held) - 1} more namespace(s)" if len(held) > 1 else ""
                raise MountError(
                    f"{mp} is unmounted here, but the mount namespace of pid {h.pid} ({h.comm}){more} still has "
                    f"it, at {h.what}: its daemon (pid {pid}) serves that copy and exits once it goes (when that "
                    f"namespace ends, or `nsenter -t {h.pid} -m umount {h.what}`)")
            raise MountError(f"{mp} is unmounted but its daemon (pid {pid}) has not exited after {timeout:.0f} s")
        time.sleep(0.05)


# -- finalize -----------------------------------------------------------------------------------------
def finalize(target: Path, timeout: float = 30.0, notes: list[str] | None = None) -> list[str]:
    """Swap the FUSE lower of a fully materialized writable mount for the local copy.

    Afterwards the tree keeps working with no daemon and no store: each
    overlay is mounted again with ``state/tree`` as its lower layer (same upper
    and work directories, so no write is lost; box/swap.py, which keeps the
    target showing the box at every step), then the FUSE mount and its daemon
    go. Refused while the copy is incomplete or while a process has a file
    under the mount open for writing. Run again after being killed, it goes
    on from where it was (its last steps too). Returns the overlay targets.
    """
    mp = Path(os.path.abspath(target))
    reg = Registration.for_mountpoint(mp)
    info = reg.read()
    if not info or not info.get("writable"):
        raise UsageError(f"{mp} is not a writable ogrefs mount")
    state = Path(info["state_dir"])
    if info.get("finalized"):
        if "finalize_daemon" not in info:
            raise UsageError(f"{mp} is already finalized: it runs from local disk with no daemon")
        _finish_finalize(state, reg, info, [], None, timeout, notes)  # a finalize killed in its last steps
        return [o.target for o in load_overlays(state)]
    status = read_status(mp)
    mat = status.get("materialize") or {}
    if not mat.get("complete"):
        done, total = mat.get("bytes_done", 0), mat.get("bytes_total", 0)
        why = mat.get("reason") or f"{done / 2**30:.2f} of {total / 2**30:.2f} GiB are local"
        raise UsageError(f"{mp} is not fully local yet ({why}); wait for `ogrefs status {mp}` to say complete")
    _show_state(state, info)
    old = load_overlays(state)
    ours = {p for p in (info.get("pid"), info.get("keeper_pid")) if p}
    writers = holders.writers([o.target for o in old], exclude=ours)  # by mount, not by path
    if writers:
        raise UsageError(f"refusing to finalize while files are open for writing: {'; '.join(writers[:3])}")
    callers = holders.callers_or_refuse(f"finalize {mp}", [o.target for o in old], info)
    moved = _set_aside_host_owned(state, [p.removesuffix(" (merged)") for p in info.get("host_kept") or []
                                          if not p.endswith(" (merged)")])
    if "finalize_below" not in info:  # before anything changes: a rerun finds the FUSE lower below by it
        info["finalize_below"] = _lower_below(state, info)
        reg.write(info)
    pid = status.get("pid")

    def record_finalized(_new: list[Overlay]) -> None:
        # before the FUSE lower goes: its daemon then exits, and its keeper tears down a mount not marked finalized
        topfiles.rebind(state, state / "tree")
        info.update(finalized=True, pid=None, lower=None,
                    finalize_daemon={"pid": pid, "start": process_start(pid) if pid else None})
        reg.write(info)

    below: list[int] = []
    try:
        new = swap.swap_lowers(state, old, info.get("own_directories") or [], stage=_stage_dir(reg),
                               own_roots=_own_roots(info), below=below, swapped_all=record_finalized)
        _finish_finalize(state, reg, info, below, callers, timeout, notes)
    except MountError:
        if not info.get("finalized"):
            for src, dest in reversed(moved):  # the local copy as it was: a later finalize sets them aside again
                os.replace(dest, src)
        raise
    finally:
        for fd in below:
            os.close(fd)
    return [o.target for o in new]


def _finish_finalize(state: Path, reg: Registration, info: dict, below: list[int], callers: list | None,
                     timeout: float, notes: list[str] | None) -> None:
    """finalize's last steps, once the registration says finalized: the FUSE lower goes, then its daemon.

    ``callers``: the caller's own processes that held the old overlays (None: not known, a rerun). The
    daemon serves what they still hold and exits after the last; without them it gets SIGTERM. The
    registration keeps ``finalize_daemon`` until the end, so a rerun after a kill does these again.
    """
    mp = Path(info.get("mountpoint") or state)
    _detach_lower(state, info, below)
    swap.clear_stage(_stage_dir(reg))
    with contextlib.suppress(OSError):
        _stage_dir(reg).rmdir()  # empty now (not there if the swap needed none)
    daemon = info.get("finalize_daemon") or {}
    pid = daemon.get("pid")
    if pid and pid_alive(pid) and process_start(pid) == daemon.get("start"):
        if callers is None or callers:
            # The caller's shell still runs programs of the old overlays (detached, on the FUSE lower): the
            # daemon serves them and exits after the last (the kernel's DESTROY); a SIGTERM would cut them off.
            try:
                _wait_exit(pid, min(timeout, LAZY_EXIT_WAIT_S), mp)
            except MountError:
                if notes is not None:
                    held = ", ".join(str(h) for h in (callers or [])[:3]) or "processes"
                    notes.append(f"the daemon (pid {pid}) goes on serving {held} "
                                 "(started before the finalize) and exits when they do")
        else:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
            _wait_exit(pid, timeout, mp)
    info.pop("finalize_daemon", None)
    info.pop("finalize_below", None)
    reg.write(info)  # the daemon removed its registration on the way out; the finalized mount keeps one


def _stage_dir(reg: Registration) -> Path:
    """``<runtime>/stage/<key>``: where finalize puts each new overlay together (box/swap.py)."""
    return reg.path.parent.parent / "stage" / reg.path.stem


def _own_roots(info: dict) -> dict[str, str | None]:
    """Per overlay target, the keeper's descriptor of the box's own directory below it (records.own_layer_root)."""
    ws = writable_state(info) or {"overlays": []}
    roots = {o["target"]: own_layer_root(ws, o, mountsys.mount_id(o["target"])) for o in ws["overlays"]}
    return {t: os.fsdecode(r) if r else None for t, r in roots.items()}


def _lower_below(state: Path, info: dict) -> dict | None:
    """Where the FUSE lower is mounted first, when an overlay covers the state directory: through the
    keeper's descriptor of that overlay's own directory, with the state directory's identity; else None."""
    ws = writable_state(info) or {"overlays": []}
    for o in ws["overlays"]:
        own = o.get("host_dir") or o["target"]
        root = own_layer_root(ws, o, mountsys.mount_id(o["target"]))
        if root is not None and str(state).startswith(own.rstrip("/") + "/"):
            path = os.path.join(os.fsdecode(root), os.path.relpath(state, own))
            with contextlib.suppress(OSError):
                st = os.stat(path)
                return {"path": path, "dev": st.st_dev, "ino": st.st_ino}
    return None


def _show_state(state: Path, info: dict) -> None:
    """A finalize killed between the old order's mount of the new overlay over the state directory and its
    bind-back of that directory (box/swap.py "partial") left it hidden where that overlay has no own layer
    (a directory the snapshot owns wholly, box/exact.py): overlays.json is read where the directory is
    (``finalize_below``, by its identity) and that overlay taken down, so its path shows it again."""
    first = info.get("finalize_below")
    if not first:
        return
    with contextlib.suppress(OSError):
        st = os.stat(state)
        if (st.st_dev, st.st_ino) == (first["dev"], first["ino"]):
            return  # shown: no finalize was killed there
    fd = _open_state_below(first)
    if fd is None:
        return  # the keeper is gone: nothing names it
    try:
        swap.take_down_partial(state, load_overlays(Path(safepath.fd_path(fd))))
    finally:
        os.close(fd)


def _open_state_below(first: dict) -> int | None:
    """An O_PATH descriptor of the state directory where it really is (``finalize_below``: below the overlay
    that covers it), when that path is still the same directory; else None."""
    try:
        fd = os.open(first["path"], os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (first["dev"], first["ino"]):  # not the state directory (any more)
        os.close(fd)
        return None
    return fd


def _detach_lower(state: Path, info: dict, below: list[int]) -> None:
    """Detach the FUSE lower: where it was mounted first (below an overlay that covers the state directory)
    and each copy bound back with the state directory; each only when mountinfo says it is ogrefs' FUSE."""
    places = [os.dup(fd) for fd in below]
    first = info.get("finalize_below")
    if first and (fd := _open_state_below(first)) is not None:
        places.append(fd)
    for fd in places:
        try:
            _umount_fuse(f"/proc/self/fd/{fd}/lower")
        finally:
            os.close(fd)
    for _ in range(4):  # one copy per overlay that bound the state directory back
        if not mountsys.is_ogrefs(mountsys.mount_at(state / "lower"), "fuse.ogrefs"):
            break
        mountsys.umount(str(state / "lower"), lazy=True)


def _umount_fuse(path: str) -> None:
    """Detach what is mounted at ``path`` when it is ogrefs' FUSE mount (by the mount id the kernel gives)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        mid = safepath.mount_id_of(fd)
        row = next((r for r in mountsys.mount_table() if r.id == mid), None)
        if mountsys.is_ogrefs(row, "fuse.ogrefs"):
            mountsys.umount(safepath.fd_path(fd), lazy=True)
    finally:
        os.close(fd)


def _set_aside_host_owned(state: Path, paths: list[str]) -> list[tuple[Path, Path]]:
    """Move the host-owned paths out of the local copy before it becomes the lower layer.

    The FUSE view hid them so this box's own showed through; the local copy
    has the snapshot's, which would cover them after ``finalize``. They are
    moved to ``state/host-owned/`` (kept, never deleted); returns (from, to) of each.
    """
    tree, aside = state / "tree", state / "host-owned"
    moved = []
    for p in paths:
        src = tree / p.lstrip("/")
        if os.path.lexists(src):
            dest = aside / p.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.replace(src, dest)
            moved.append((src, dest))
    return moved
