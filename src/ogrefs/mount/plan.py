"""What the calling process resolves before it forks the keeper and the daemon: the mount plan.

From the user's :class:`~ogrefs.mount.options.MountOptions` and the opened
repository, :func:`prepare` resolves the snapshot (under the shared lock, so
prune keeps what the mount will read), checks its catalog, loads the access
trace to replay and, for a writable mount, decides the overlays, takes the
state directory's lock, clears what a dead earlier mount left and reads
this box's host-owned paths — all while nothing covers the box yet. The
result is frozen: the keeper and the daemon inherit it across the fork and
only read it (the daemon's runtime state is its own, daemon.py).

Runs in the calling thread, before any fork; the lock's narrowing and the
trace's search run in two threads of a pool beside the catalog's fetch, and
are joined before :func:`prepare` returns (the threads read the store and
return what they read; the lock's info is the lock's own, locks.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import pwd
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ogrefs.box.records import Overlay, Registration, load_overlays, mountpoint_key, pid_alive, state_base
from ogrefs.errors import OgrefsError, UsageError
from ogrefs.lazy.trace.resolve import entries_to_replay
from ogrefs.box import exact, holders, hostpaths, mountsys, overlay, topfiles
from ogrefs.mount.checks import check_mountpoint, check_release
from ogrefs.mount.options import MountOptions
from ogrefs.repo.catalog import ROOT_INO, Catalog
from ogrefs.repo.traces import find_trace

if TYPE_CHECKING:
    from ogrefs.repo import Repository
    from ogrefs.repo.locks import HeldLock

log = logging.getLogger(__name__)

#: A mount of a state directory whose previous mount is going away (see lock_state_dir) waits this long.
STATE_LOCK_WAIT_S = 10.0


@dataclass(frozen=True)
class WritableLayout:
    """What a writable mount is made of: the FUSE lower goes to ``state_dir/lower``, overlays to ``target``."""

    target: Path  # where the user sees the tree
    state_dir: Path
    overlays: list[Overlay]  # planned, not yet mounted (the keeper mounts them)
    skipped: list[dict[str, str]]  # {"path", "reason"} of each top-level directory not overlaid
    host_paths: hostpaths.HostPlan | None  # at / or for a whole root: what the FUSE view hides, what is merged
    top_files: list[dict[str, Any]] | None  # at / of a whole-box snapshot: topfiles.planned(catalog)
    state_lock: int  # fd holding flock on state_dir/mount.lock (inherited by keeper and daemon)


@dataclass(frozen=True)
class MountPlan:
    """A mount as resolved before the fork; read-only for every process that inherits it."""

    opts: MountOptions
    repo: Repository
    manifest: dict[str, Any]
    catalog_path: Path
    mountpoint: Path  # where FUSE mounts: the target itself (read-only) or state_dir/lower
    registration: Registration
    lock: HeldLock  # the shared repository lock, taken before the snapshot was resolved
    trace_entries: list | None  # the trace to replay (None: none, or replay off)
    save_trace: bool
    prefetch: bool
    writable: WritableLayout | None = None
    #: What the trace's resolution changed (a stale checkpoint replayed as the newest): this process has no log
    #: handler, so the daemon records them in the registration and its log, and ``mount`` prints them.
    trace_notes: tuple[str, ...] = ()

    @property
    def snapshot_id(self) -> str:
        return self.manifest["id"]

    @property
    def target(self) -> Path:
        """Where the user sees the snapshot."""
        return self.writable.target if self.writable else self.mountpoint

    @property
    def state_dir(self) -> Path | None:
        return self.writable.state_dir if self.writable else None


def default_state_dir(snapshot_id: str, target: Path) -> Path:
    return state_base() / f"{snapshot_id[:16]}-{mountpoint_key(target)[:12]}"


def prepare(opts: MountOptions, repo: Repository, lock: HeldLock, mountpoint: Path,
            resolve: Callable[[Repository], dict[str, Any]] | None = None) -> MountPlan:
    """Resolve everything the keeper and the daemon need; raises with a one-line reason.

    ``mountpoint``: the checked absolute target. ``resolve`` picks the manifest
    (default: ``repo.resolve(opts.snapshot)``); it runs under ``lock``.
    """
    if opts.encrypt_cache and repo.codec.cache_key() is None:
        raise UsageError("--encrypt-cache needs an encrypted repository (its key encrypts the cache)")
    manifest = resolve(repo) if resolve is not None else repo.resolve(opts.snapshot)
    if not opts.read_only and not opts.box_root:
        check_release(manifest, mountpoint, opts)
    # Three chains of store requests that need only the manifest run side by side (behind a far link
    # each request costs a round trip, and in a row they were a fifth of a mount's start at 30 ms):
    # the lock narrowed to this snapshot, the catalog, the trace to replay (a listing, then a get).
    with ThreadPoolExecutor(2, thread_name_prefix="ogrefs-prepare") as pool:
        narrowed = pool.submit(lock.set_snapshot, manifest["id"])  # prune keeps only this snapshot's packs for us
        found = pool.submit(find_trace, repo, manifest) if opts.replay_trace else None
        cat_path = repo.catalog_path(manifest["id"])
        catalog = Catalog(cat_path)  # refuses an unreadable catalog here, with a one-line reason
        writable = None if opts.read_only else _writable_layout(opts, manifest, catalog, mountpoint)
        narrowed.result()
        trace_notes: list[str] = []
        try:
            trace_entries = (entries_to_replay(found.result(), manifest, catalog, trace_notes)
                             if found is not None else None)
        except (OgrefsError, OSError) as exc:
            log.warning("no access trace replayed: %s", exc)
            trace_entries = None
    return MountPlan(
        opts=opts, repo=repo, manifest=manifest, catalog_path=cat_path,
        mountpoint=check_mountpoint(writable.state_dir / "lower") if writable else mountpoint,
        registration=Registration.for_mountpoint(writable.target if writable else mountpoint), lock=lock,
        trace_entries=trace_entries,
        save_trace=opts.save_trace if opts.save_trace is not None else not opts.read_only,
        prefetch=opts.prefetch if opts.prefetch is not None else not opts.read_only,  # a browse mount: on read
        writable=writable, trace_notes=tuple(trace_notes))


def _writable_layout(opts: MountOptions, manifest: dict, catalog: Catalog, target: Path) -> WritableLayout:
    """Plan the overlays (refusing protected paths early) and prepare the state directory.

    The FUSE mount moves to ``state/lower``; the user's target gets the overlays.
    A state directory left by a daemon that died (kill -9) still has overlays
    and a dead FUSE mount on it: they are detached first, and the upper
    directories are kept, so the new mount resumes with every write intact.
    """
    state = Path(os.path.abspath(opts.state_dir or default_state_dir(manifest["id"], target)))
    roots = [os.fsdecode(r) for r in catalog.roots()]
    top = [os.fsdecode(name) for name, node in catalog.children(ROOT_INO) if node.is_dir]
    skipped: list[dict[str, str]] = []
    top_files = None
    if opts.box_root:
        plans = overlay.plan_box_root(state / "lower", target, state)
    else:
        plans = overlay.plan(roots, state / "lower", target, state, force=opts.force, top_level=top,
                             skipped=skipped, data_only=opts.data_only)
        if str(target) == "/" and any(overlay.normalized(r) == "/" for r in roots) and not opts.data_only:
            top_files = topfiles.planned(catalog)
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    state_lock = lock_state_dir(state, Registration.for_mountpoint(target))
    topfiles.hide(state)
    for old in reversed(load_overlays(state)):
        overlay.unmount_one(old, lazy=True)
    overlay.unmount_shims(state)  # a finalized mount's read-only local copy: writable again below
    mountsys.umount(str(state / "lower"), lazy=True)
    (state / "lower").mkdir(parents=True, exist_ok=True, mode=0o700)
    host_paths = None
    if str(target) == "/" or opts.box_root:  # read this box's own tree now: nothing of an earlier mount covers it any more
        rules = list(opts.host_rules) if opts.host_rules is not None else hostpaths.load_rules()
        driver_dirs: list[str] = []
        if opts.box_root and opts.inject_driver:
            rules, driver_dirs = hostpaths.with_driver(rules)
        host_paths = hostpaths.plan(catalog, rules)
        host_paths.driver_dirs = driver_dirs
        host_paths.mask, host_paths.exact, host_paths.not_exact = _mask(opts, manifest, catalog, rules, roots)
    os.chmod(state, 0o700)
    return WritableLayout(target=target, state_dir=state, overlays=plans, skipped=skipped, host_paths=host_paths,
                          top_files=top_files, state_lock=state_lock)


def _mask(opts: MountOptions, manifest: dict, catalog: Catalog, rules: list,
          roots: list[str]) -> tuple[list | None, list[str], list[tuple[str, str]]]:
    """What of this box stays hidden below the snapshot's directories (exact.py): the mask (None: none), the
    directories shown exactly, and the candidates left merged with why.

    ``--merge``: none. ``run``/``shell``: everything below the snapshot's roots. At ``/``: the roots of a
    snapshot of named data paths (its project: this box's system does not need it merged); of a whole box,
    the directories it owns (exact.owned: its work trees, runs, environments, ``/workspace``), while its
    top-level directories, homes and system directories keep this box's entries (its own system needs them).
    """
    if opts.merge_host:
        return None, [], []
    if opts.box_root:
        return exact.plan(catalog, rules, roots), ["/"], []
    if any(overlay.normalized(r) == "/" for r in roots):
        points = [m.point for m in mountsys.mount_table()]
        own = exact.owned(manifest, catalog, rules, homes=_homes(), mounts=points,
                          runs_from=[sys.prefix, str(Path(__file__).resolve().parents[2])])  # its venv, src
        return (exact.plan(catalog, rules, own.exact) if own.exact else None), own.exact, own.left
    data = [r for r in roots if not overlay.is_system(r)]
    return (exact.plan(catalog, rules, data) if data else None), [overlay.normalized(r) for r in data], []


def _homes() -> list[str]:
    """This box's users' home directories (read before anything covers /etc/passwd)."""
    return [p.pw_dir for p in pwd.getpwall()]


def lock_state_dir(state: Path, reg: Registration, wait_s: float = STATE_LOCK_WAIT_S) -> int:
    """Hold ``state/mount.lock`` (flock) for as long as a mount of this state directory lives.

    The descriptor is inherited by the keeper and the daemon; the lock goes
    with the last of them. A second mount of the same state directory is
    refused here, before it touches anything of the live one: at once when
    the registration shows a live daemon of this state directory that no
    lazy unmount detached. Otherwise the holder is a mount going away (the
    keeper detaching after its daemon was killed, a lazily unmounted daemon
    whose last user just left — which removes its registration before its
    process and its keeper are gone), and the lock is waited for, at most
    ``wait_s`` seconds.
    """
    fd = os.open(state / "mount.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            info = reg.read() or {}
            live = (info.get("state_dir") == str(state) and not (info.get("died") or info.get("detached"))
                    and pid_alive(info.get("pid") or 0))
            if live or time.monotonic() > deadline:
                os.close(fd)
                raise UsageError(_state_in_use(state, info, live)) from None
            time.sleep(0.05)


def _state_in_use(state: Path, info: dict, live: bool) -> str:
    """One line: why ``state`` cannot be mounted now, and what to do.

    A lazily unmounted mount's daemon lives on while processes started on the
    old tree run (it serves them, and it and its overlays still write the
    upper directories and the local copy): a second mount of the same state
    would be a second writer of them, so it is refused (after the bounded wait:
    one that just let go is not refused), naming those processes.
    """
    if live or info.get("state_dir") != str(state) or not info.get("detached"):
        return (f"the state directory {state} is in use by a live mount; unmount it first, "
                "or give this mount another --state-dir")
    ours = {p for p in (info.get("pid"), info.get("keeper_pid")) if p}
    detached = info.get("detached_mounts") if isinstance(info.get("detached_mounts"), dict) else {}
    found = holders.holders_of({int(i): str(t) for i, t in detached.items() if str(i).isdigit()},
                               exclude=ours, maps=True)
    names = ", ".join(str(h) for h in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    who = f": {names}" if found else " (no process found holding it: it should exit any moment)"
    return (f"the state directory {state} is still used by the earlier mount of {info.get('mountpoint')}, "
            f"unmounted lazily: its daemon (pid {info.get('pid')}) serves processes started on the old tree"
            f"{who}; stop or restart them, then mount again (or mount with another --state-dir)")
