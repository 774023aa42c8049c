"""Mount a snapshot: early checks, the daemon, wiring, status, unmount.

``mount`` checks everything that can fail early in the calling process (FUSE
present, mountpoint an empty directory, repository opened and unlocked,
snapshot exists, catalog readable), then forks a daemon (double fork, new
session) and waits on a pipe until the daemon writes ``ready`` (the kernel's
FUSE INIT was answered, so the root lists) or ``error <reason>``.  The daemon
inherits the opened repository (no second passphrase prompt or key
stretching; the parent only waits on the pipe after the fork) and builds the
rest of the stack in its own process — chunk cache → fetcher → vfs → pyfuse3
adapter — on one trio loop.

While mounted, the daemon registers itself in the runtime directory
(``$OGREFS_RUNTIME_DIR``, else ``/run/ogrefs`` when writable, else
``$XDG_RUNTIME_DIR/ogrefs``, else the cache directory) as
``mounts/<key>.json`` (pid, mountpoint, snapshot, where its status and log
are), and rewrites ``mounts/<key>.status.json`` atomically every 0.5 s;
``ogrefs status`` reads them.  SIGTERM and SIGINT end the loop and unmount.

Who owns what: the daemon's trio loop owns the fetcher, the vfs and the status
writer (one nursery); worker threads only run the blocking calls each of those
hands them.  The registration files are written by the daemon alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ogrefs.boxmounts import (
    MountError,
    Registration,
    atomic_json as _atomic_json,
    mountpoint_key as _key,
    load_overlays,
    pid_alive,
    save_overlays,
    state_base,
    unescape_mountinfo,
)
from ogrefs.mount import mountsys
from ogrefs.errors import OgrefsError, UsageError

if TYPE_CHECKING:
    from ogrefs.repo import Repository

log = logging.getLogger(__name__)

READY_TIMEOUT = 120.0
#: What the keeper of a writable mount adds to its registration (keeper.bring_up).
KEEPER_KEYS = ("overlays", "binds", "host_kept", "ldconfig", "own_directories", "keeper_pid", "top_files")
STATUS_INTERVAL = 0.5
#: A status file older than this means the daemon stopped answering (it is rewritten every STATUS_INTERVAL).
STALE_AFTER = 30.0
#: A mount of a state directory whose previous mount is going away (see _lock_state_dir) waits this long.
STATE_LOCK_WAIT_S = 10.0
#: A lazy unmount waits this long for the daemon; one still serving open files after it is not an error.
LAZY_EXIT_WAIT_S = 2.0


@dataclass
class MountOptions:
    repo_url: str
    snapshot: str
    mountpoint: Path
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
    target: Path | None = None  # writable: where the user sees the tree (mountpoint is then state/lower)
    overlays: list = None  # type: ignore[assignment]  # planned overlay.Overlay list (writable)
    lock: Any = None  # the shared repository lock (repo.locks.HeldLock), taken before the snapshot is resolved
    materialize: bool = True  # writable mounts: copy everything to <state>/tree in the background
    save_trace: bool | None = None  # record and store the access trace (default: writable mounts do)
    trace_entries: list | None = None  # the trace to replay, loaded before the fork
    replay_trace: bool = True  # prefetch in the order of the recorded access trace, if there is one
    prefetch: bool | None = None  # fetch hints/trace in the background (default: writable yes, read-only no)
    encrypt_cache: bool = False  # seal chunk-cache files with a key derived from the repository key
    host_rules: list | None = None  # writable mounts at /: hostpaths.Rule list (None: the defaults)
    host_paths: Any = None  # hostpaths.HostPlan computed from host_rules before the fork
    skipped: list | None = None  # writable: {"path", "reason"} of each top-level directory not overlaid
    box_root: bool = False  # writable: assemble a whole root at the target (ogrefs run/shell), host paths on
    top_files: list | None = None  # writable at / of a whole-box snapshot: topfiles.planned(catalog)
    state_lock: int | None = None  # writable: fd holding flock on <state>/mount.lock (one mount per state dir)


# -- early checks -----------------------------------------------------------------------------
def fuse_problem() -> str | None:
    """Why a FUSE mount cannot work on this machine, or None."""
    if not os.path.exists("/dev/fuse"):
        return "FUSE is not available: /dev/fuse is missing (load the fuse module, or give the container the device)"
    if os.geteuid() != 0:
        if not os.access("/dev/fuse", os.R_OK | os.W_OK):
            return "FUSE is not available: no permission to open /dev/fuse"
        if shutil.which("fusermount3") is None:
            return "FUSE is not available: fusermount3 is not installed (package fuse3)"
    try:
        from ogrefs.mount import fuse_ops  # noqa: F401
    except ImportError as exc:
        return f"FUSE support is not installed: pyfuse3 cannot be loaded ({exc})"
    return None


def mounted_fstype(mountpoint: Path) -> str | None:
    """The file-system type mounted exactly at ``mountpoint`` (from mountinfo, without touching it)."""
    target = os.path.abspath(mountpoint)
    found = None
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) >= 5 and unescape_mountinfo(fields[4]) == target:
                found = right.split()[0] if right else "?"
    return found


def check_mountpoint(mountpoint: Path) -> Path:
    mp = Path(os.path.abspath(mountpoint))
    try:
        st = os.stat(mp)
    except FileNotFoundError:
        raise UsageError(f"mountpoint {mp} does not exist") from None
    except OSError as exc:
        raise UsageError(f"mountpoint {mp} is not usable ({exc.strerror}); a stale mount? try `ogrefs unmount {mp}`") \
            from None
    import stat as _stat

    if not _stat.S_ISDIR(st.st_mode):
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


# -- mounting -------------------------------------------------------------------------------------
def mount(opts: MountOptions, open_repo: Callable[[], Repository] | None = None) -> None:
    """Mount and return once ready (or, with ``foreground``, once unmounted).

    ``open_repo`` opens (and, if encrypted, unlocks) the repository; by
    default ``Repository.open`` of ``opts.repo_url``.  The daemon inherits the
    opened repository across the fork, so a passphrase is asked and stretched
    once; the calling process does not touch it after forking.
    """
    problem = fuse_problem()
    if problem:
        raise MountError(problem)
    if opts.read_only:
        opts.mountpoint = check_mountpoint(opts.mountpoint)
    else:
        _check_target(Path(os.path.abspath(opts.mountpoint)))
    from ogrefs.repo.catalog import Catalog
    from ogrefs.repo import Repository

    if open_repo is None:
        repo = Repository.open(opts.repo_url, s3_endpoint=opts.s3_endpoint, cache_root=opts.cache_root)
    else:
        repo = open_repo()
    # A shared lock before the snapshot is resolved: prune never deletes a pack this mount
    # may read (it defers packs it marked after this lock's creation).  The daemon takes it over.
    opts.lock = repo.lock("shared", "mount").acquire()
    try:
        if opts.encrypt_cache and repo.codec.cache_key() is None:
            raise UsageError("--encrypt-cache needs an encrypted repository (its key encrypts the cache)")
        manifest = repo.resolve(opts.snapshot)
        opts.lock.set_snapshot(manifest["id"])  # from now on prune keeps only this snapshot's packs for us
        cat_path = repo.catalog_path(manifest["id"])
        catalog = Catalog(cat_path)  # refuses an unreadable catalog here, with a one-line reason
        if not opts.read_only:
            _prepare_writable(opts, manifest, catalog)
        if opts.save_trace is None:
            opts.save_trace = not opts.read_only
        if opts.prefetch is None:  # a browse mount fetches only what is read
            opts.prefetch = not opts.read_only
        from ogrefs.lazy.resolve import load_trace

        try:
            opts.trace_entries = load_trace(repo, manifest, catalog) if opts.replay_trace else None
        except (OgrefsError, OSError) as exc:
            log.warning("no access trace replayed: %s", exc)
            opts.trace_entries = None
        reg = Registration.for_mountpoint(opts.target or opts.mountpoint)
        if opts.foreground:
            code = (_keeper_main(opts, repo, manifest, cat_path, reg, None) if opts.overlays
                    else _serve(opts, repo, manifest, cat_path, reg, ready_fd=None))
            if code:
                raise MountError(f"the mount of {opts.mountpoint} ended with an error (see above)")
            return
        _daemonize_and_wait(opts, repo, manifest, cat_path, reg)
    except BaseException:
        if opts.lock is not None and opts.lock._thread is not None:  # not handed over to a daemon
            opts.lock.release()
        raise


def default_state_dir(snapshot_id: str, target: Path) -> Path:
    return state_base() / f"{snapshot_id[:16]}-{_key(target)[:12]}"


def _check_target(target: Path) -> None:
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


def _prepare_writable(opts: MountOptions, manifest: dict, catalog: Any) -> None:
    """Plan the overlays (refusing protected paths early) and prepare the state directory.

    The FUSE mount moves to ``state/lower``; the user's target gets the overlays.
    A state directory left by a daemon that died (kill -9) still has overlays
    and a dead FUSE mount on it: they are detached first, and the upper
    directories are kept, so the new mount resumes with every write intact.
    """
    from ogrefs.mount import overlay
    from ogrefs.repo.catalog import ROOT_INO

    target = Path(os.path.abspath(opts.mountpoint))
    state = Path(os.path.abspath(opts.state_dir or default_state_dir(manifest["id"], target)))
    roots = [os.fsdecode(r) for r in catalog.roots()]
    top = [os.fsdecode(name) for name, node in catalog.children(ROOT_INO) if node.is_dir]
    opts.skipped = []
    if opts.box_root:
        plans = overlay.plan_box_root(state / "lower", target, state)
    else:
        plans = overlay.plan(roots, state / "lower", target, state, force=opts.force, top_level=top,
                             skipped=opts.skipped)
        if str(target) == "/" and any(overlay.normalized(r) == "/" for r in roots):
            from ogrefs.mount import topfiles

            opts.top_files = topfiles.planned(catalog)
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    opts.state_lock = _lock_state_dir(state, Registration.for_mountpoint(target))
    from ogrefs.mount import topfiles

    topfiles.hide(state)
    for old in reversed(load_overlays(state)):
        overlay.unmount_one(old, lazy=True)
    mountsys.umount(str(state / "lower"), lazy=True)
    (state / "lower").mkdir(parents=True, exist_ok=True, mode=0o700)
    if str(target) == "/" or opts.box_root:  # read this box's own tree now: nothing of an earlier mount covers it any more
        from ogrefs.mount import hostpaths

        rules = opts.host_rules if opts.host_rules is not None else hostpaths.load_rules()
        opts.host_paths = hostpaths.plan(catalog, rules)
    os.chmod(state, 0o700)
    opts.state_dir = state
    opts.target = target
    opts.mountpoint = check_mountpoint(state / "lower")
    opts.overlays = plans


def _lock_state_dir(state: Path, reg: "Registration", wait_s: float = STATE_LOCK_WAIT_S) -> int:
    """Hold ``state/mount.lock`` (flock) for as long as a mount of this state directory lives.

    The descriptor is inherited by the keeper and the daemon; the lock goes
    with the last of them. A second mount of the same state directory is
    refused here, before it touches anything of the live one. A mount that is
    going away still holds it for a moment (the keeper detaching after its
    daemon was killed, a lazily unmounted daemon whose last user just left):
    when the registration says so (``died``, ``detached``, or a daemon that
    is gone), the lock is waited for, at most ``wait_s`` seconds.
    """
    fd = os.open(state / "mount.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            info = reg.read() or {}
            going = (info.get("state_dir") == str(state)
                     and (info.get("died") or info.get("detached") or not pid_alive(info.get("pid") or 0)))
            if not going or time.monotonic() > deadline:
                os.close(fd)
                raise UsageError(f"the state directory {state} is in use by a live mount; unmount it first, "
                                 "or give this mount another --state-dir") from None
            time.sleep(0.05)


def _daemonize_and_wait(opts: MountOptions, repo: Repository, manifest: dict, cat_path: Path,
                        reg: Registration) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid != 0 and opts.lock is not None:
        opts.lock.hand_over()  # the daemon refreshes and releases it from now on
    if pid == 0:  # the intermediate child: detach and leave
        code = 1
        try:
            os.close(r)
            os.setsid()
            if os.fork() == 0:
                code = (_keeper_main(opts, repo, manifest, cat_path, reg, w) if opts.overlays
                        else _daemon_main(opts, repo, manifest, cat_path, reg, w))
            else:
                code = 0
        finally:
            os._exit(code)
    os.close(w)
    os.waitpid(pid, 0)
    line = _read_line(r, READY_TIMEOUT)
    os.close(r)
    if line == "ready":
        return
    if line.startswith("error "):
        raise MountError(line[len("error "):])
    info = reg.read()
    if info and pid_alive(info.get("pid", 0)):
        with contextlib.suppress(OSError):
            os.kill(info["pid"], signal.SIGTERM)
    if line == "timeout":
        raise MountError(f"the mount did not become ready within {READY_TIMEOUT:.0f} s (log: {reg.log})")
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


def _detach_stdio(reg: Registration) -> None:
    os.chdir("/")
    devnull = os.open(os.devnull, os.O_RDWR)
    logfd = os.open(reg.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(devnull, 0)
    os.dup2(logfd, 1)
    os.dup2(logfd, 2)
    os.close(devnull)
    os.close(logfd)


def _keeper_main(opts: MountOptions, repo: Repository, manifest: dict, cat_path: Path, reg: Registration,
                 ready_fd: int | None) -> int:
    """A writable mount: fork the daemon, then keep the box (keeper.py); ``ready_fd`` None: foreground."""
    from ogrefs.mount import keeper

    if ready_fd is not None:
        _detach_stdio(reg)
    logging.basicConfig(level=getattr(logging, opts.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True)
    to_keeper_r, to_keeper_w = os.pipe()
    to_daemon_r, to_daemon_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(to_keeper_r)
            os.close(to_daemon_w)
            if ready_fd is not None:
                os.close(ready_fd)
            code = _serve(opts, repo, manifest, cat_path, reg, None, keeper=(to_keeper_w, to_daemon_r))
        except BaseException:  # noqa: BLE001 - the daemon must report, not crash silently
            log.exception("mount daemon failed")
            with contextlib.suppress(OSError):
                os.write(to_keeper_w, b"error the mount daemon failed (see its log)\n")
        finally:
            os._exit(code)
    os.close(to_keeper_w)
    os.close(to_daemon_r)
    return keeper.keep(opts, reg, pid, to_keeper_r, to_daemon_w, ready_fd)


def _daemon_main(opts: MountOptions, repo: Repository, manifest: dict, cat_path: Path, reg: Registration,
                 ready_fd: int) -> int:
    """The daemon process: stdio detached, log to the registration's log file."""
    _detach_stdio(reg)
    try:
        return _serve(opts, repo, manifest, cat_path, reg, ready_fd)
    except BaseException as exc:  # noqa: BLE001 - the daemon must report, not crash silently
        logging.getLogger(__name__).exception("mount daemon failed")
        with contextlib.suppress(OSError):
            os.write(ready_fd, f"error {exc}\n".encode())
        return 1


def _serve(opts: MountOptions, repo: Repository, manifest: dict, cat_path: Path, reg: Registration,
           ready_fd: int | None, keeper: tuple[int, int] | None = None) -> int:
    """Build the stack, mount, serve until unmounted or signalled.  Returns an exit code.

    ``keeper``: (write fd to the keeper, read fd from it) for a writable
    mount. Then, right after the FUSE mount and before any thread starts,
    this process moves to a mount namespace of its own and drops its copy of
    the FUSE mount: the overlays the keeper mounts in the box afterwards are
    invisible here, so nothing this daemon opens resolves through them.
    """
    import trio

    from ogrefs.mount import fuse_ops
    from ogrefs.repo.catalog import Catalog
    from ogrefs.lazy.chunkcache import ChunkCache
    from ogrefs.lazy.fetcher import Fetcher
    from ogrefs.lazy.fetchio import PackReads
    from ogrefs.repo import default_cache_dir
    from ogrefs.lazy.vfs import SnapshotFS

    logging.basicConfig(level=getattr(logging, opts.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True)
    catalog = Catalog(cat_path)
    chunk_dir = opts.chunk_cache or (opts.cache_root or default_cache_dir()) / "chunks"
    from ogrefs.lazy.chunkcache import CacheCipher

    cipher = CacheCipher(repo.codec.cache_key()) if opts.encrypt_cache else None
    cache = ChunkCache(chunk_dir, opts.cache_size, chunk_id=repo.codec.chunk_id, cipher=cipher)
    stop = threading.Event()  # set when the fetcher stops: a store call waiting out an outage gives up
    packs = PackReads(repo.store, opts.retry_for, stop)  # the one retry: the store's, within --retry-for
    fetcher = Fetcher(packs.read_range, cache, max_requests=opts.max_requests, memory_bytes=opts.memory_cache,
                      decode=repo.codec.decode_blob, open_range=packs.open_range, stop=stop,
                      retries=lambda: packs.retries)
    from ogrefs.lazy.materialize.materializer import Materializer
    from ogrefs.lazy.prefetch import Prefetch
    from ogrefs.lazy.recorder import Recorder, save_trace, save_when_recorded

    recorder = Recorder(catalog) if opts.save_trace else None
    # (the materializer shares the fetcher's residency: what readers fetch goes to the tree at once, not via
    # the chunk cache)
    materializer = (Materializer(catalog, fetcher, opts.state_dir)
                    if (opts.state_dir is not None and opts.materialize) else None)
    view = catalog
    if opts.host_paths is not None and opts.host_paths.hidden:
        from ogrefs.mount.hostpaths import HostView

        view = HostView(catalog, opts.host_paths.hidden)  # host-owned entries: this box's show through
    fs = SnapshotFS(view, fetcher, recorder=recorder, local=materializer, chunk_id=repo.codec.chunk_id,
                    page_cache=fuse_ops.store_in_page_cache if materializer is not None else None)
    prefetch = Prefetch(catalog, fetcher, trace_entries=opts.trace_entries, materializer=materializer,
                        idle_for=fs.idle_for)
    trace_saved: list[str | None] = []
    started = time.time()
    info = {"pid": os.getpid(), "mountpoint": str(opts.target or opts.mountpoint), "snapshot": manifest["id"],
            "writable": not opts.read_only, "lower": str(opts.mountpoint),
            "state_dir": str(opts.state_dir) if opts.state_dir else None,
            "overlays": [o.target for o in (opts.overlays or [])],
            "repo": repo.store.url, "status": str(reg.status), "log": str(reg.log), "started": started,
            "chunk_cache": str(chunk_dir)}

    def status() -> dict[str, Any]:
        st = fetcher.snapshot_stats()
        vs = fs.stats
        return {**info, "time": time.time(), "bytes_read": vs.bytes_read, "reads": vs.reads, "opens": vs.opens,
                "open_files": fs.open_files, "lookups": vs.lookups, "referenced_inodes": fs.referenced_inodes,
                "read_errors": vs.read_errors, "read_wait_s": round(vs.read_wait, 3),
                "bytes_fetched": st["bytes_fetched"], "bytes_bridged": st["bytes_bridged"],
                "requests": st["requests"],
                "chunks_fetched": st["chunks_fetched"], "cache_hits": st["hits_memory"] + st["hits_disk"],
                "cache_hits_memory": st["hits_memory"], "cache_hits_disk": st["hits_disk"],
                "cache_misses": st["misses"], "chunks_in_flight": st["in_flight"], "chunks_queued": st["queued"],
                "errors": st["errors"], "corrupt": st["corrupt"], "retries": st["retries"],
                "cache_write_errors": st["cache_write_errors"], "local_opens": getattr(vs, "local_opens", 0),
                "page_cache_pushed": vs.page_cache_pushed,
                "materialize": prefetch.stats(), "trace_replayed": len(opts.trace_entries or []),
                "trace_recording": bool(recorder and recorder.active)}

    initialized: list[trio.Event] = []  # created inside the loop; set by the kernel's INIT request

    def on_init() -> None:
        initialized[0].set()

    ops = fuse_ops.FuseOps(fs, on_init=on_init)
    fuse_ops.fuse_mount(ops, str(opts.mountpoint), fuse_ops.mount_options(allow_other=opts.allow_other))
    box_ns: list[int] = []
    if keeper is not None:
        info["skipped"] = opts.skipped or []
        box_ns.append(os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC))  # for a keeper that died
        _own_namespace(opts.mountpoint)
    if opts.lock is not None:
        opts.lock.start_refresher()  # in a forked daemon the parent's heartbeat thread did not survive
    reg.write(info)
    log.info("mounted snapshot %s of %s at %s", manifest["id"][:12], repo.store.url, opts.mountpoint)

    async def write_status() -> None:
        while True:
            snap = status()
            await trio.to_thread.run_sync(_atomic_json, reg.status, snap)
            await trio.sleep(STATUS_INTERVAL)

    async def on_signals() -> None:
        from ogrefs.mount.keeper import TEARDOWN_TIMEOUT, read_line

        stopping = False
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            if early_signals:
                log.info("signal %d before serving: unmounting", early_signals[0])
                fuse_ops.terminate()
                return
            async for signum in signals:
                if stopping:  # more signals (systemd signals the whole cgroup, the keeper forwards): one stop
                    continue
                stopping = True
                log.info("signal %d: unmounting", signum)
                if keeper is not None:  # the keeper detaches the overlays while this still answers
                    answer = ""
                    with contextlib.suppress(OSError):
                        os.write(keeper[0], b"teardown\n")
                        answer = await trio.to_thread.run_sync(read_line, keeper[1], TEARDOWN_TIMEOUT)
                    if answer != "done":  # the keeper is gone: detach from a child in the box's namespace
                        log.warning("no keeper answered; detaching the overlays from the box's namespace")
                        await trio.to_thread.run_sync(_teardown_in_box, box_ns[0], opts.state_dir, reg)
                fuse_ops.terminate()

    async def announce() -> None:
        await initialized[0].wait()
        if keeper is not None:  # the keeper brings the box up; this process only serves
            os.write(keeper[0], b"fuse-ready\n")
        else:
            await trio.to_thread.run_sync(mountsys.tune_readahead, opts.mountpoint, opts.readahead_kb)
        if opts.overlays and keeper is None:
            from ogrefs.mount import overlay

            try:
                await trio.to_thread.run_sync(overlay.mount_all, opts.overlays, opts.state_dir)
            except OgrefsError as exc:
                if ready_fd is not None:
                    os.write(ready_fd, f"error {exc}\n".encode())
                    os.close(ready_fd)
                fuse_ops.terminate()
                return
        await trio.to_thread.run_sync(_atomic_json, reg.status, status())
        if ready_fd is not None:
            os.write(ready_fd, b"ready\n")
            os.close(ready_fd)
        else:
            print(f"mounted snapshot {manifest['id'][:12]} at {opts.target or opts.mountpoint}; Ctrl-C unmounts",
                  flush=True)
        # Only now: prefetch and materialization yield to reads, but the mount comes first.
        async def prefetch_then_report() -> None:
            await prefetch.run()
            # at once, not at the next tick: `ogrefs status --wait` is waiting for this
            await trio.to_thread.run_sync(_atomic_json, reg.status, status())

        if opts.prefetch:
            nursery_ref[0].start_soon(prefetch_then_report)
        else:
            prefetch.state, prefetch.reason = "off", "a read-only mount fetches only what is read (--prefetch warms it)"
        if recorder is not None:
            async def save_later() -> None:
                trace_saved.append(await save_when_recorded(repo, manifest["id"], recorder, opts.trace_entries))

            nursery_ref[0].start_soon(save_later)

    nursery_ref: list[trio.Nursery] = []

    async def main() -> None:
        initialized.append(trio.Event())
        async with trio.open_nursery() as nursery:
            nursery_ref.append(nursery)
            await nursery.start(fetcher.run)
            nursery.start_soon(on_signals)
            nursery.start_soon(announce)
            nursery.start_soon(write_status)
            nursery.start_soon(fs.run_pushes)
            await fuse_ops.serve()
            nursery.cancel_scope.cancel()

    # Outside trio's receiver (before it opens, and after it closes on the way out) a signal is only
    # remembered: the default action would kill the daemon before it releases its lock.
    early_signals: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda num, _frame: early_signals.append(num))
    code = 0
    try:
        trio.run(main)
    except BaseException:
        log.exception("mount of %s failed", opts.mountpoint)
        code = 1
    finally:
        if opts.lock is not None:
            opts.lock.release()  # nothing is served any more: prune may delete what this mount read
        if recorder is not None and not trace_saved:
            recorder.stop()  # unmounted before the recording window ended: a short trace still helps
            try:
                save_trace(repo, manifest["id"], recorder, opts.trace_entries)
            except Exception as exc:  # noqa: BLE001 - a lost trace costs the next mount its head start only
                log.warning("could not save the access trace: %s", exc)
        finalized = bool((reg.read() or {}).get("finalized"))
        if opts.overlays and not finalized and keeper is None:
            from ogrefs.mount import overlay

            # Overlays first: the FUSE lower cannot go while they stand on it.  Not after `finalize`:
            # the overlays at these targets are then the new ones over the local copy, to be kept.
            for err in overlay.unmount_all(opts.overlays, lazy=True):
                log.warning("overlay unmount: %s", err)
        with contextlib.suppress(Exception):
            fuse_ops.fuse_close(unmount=keeper is None)  # with a keeper, this namespace has no mount
        with contextlib.suppress(Exception):
            cache.close()
        if not finalized:
            reg.remove_if_daemon(os.getpid())
        log.info("unmounted %s", opts.mountpoint)
    return code


def _teardown_in_box(box_ns: int, state_dir: Path, reg: Registration, timeout: float = 30.0) -> None:
    """Without a keeper: fork a child (single-threaded, so it may setns) that detaches everything in the box.

    The daemon keeps answering FUSE meanwhile, so the child's path lookups through the overlays never wait
    on a process that waits for them.
    """
    from ogrefs.mount import keeper as keeper_mod

    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            mountsys.enter_namespace(box_ns)
            keeper_mod.teardown(Path(state_dir), reg)
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            log.error("detaching the overlays did not finish within %.0f s", timeout)
            return
        time.sleep(0.05)


def _own_namespace(mountpoint: Path) -> None:
    """Leave the box's mount namespace (keeping its current view) and drop this copy of the FUSE mount.

    Must run before any thread starts (the kernel refuses CLONE_NEWNS to a
    multi-threaded process). Dropping the copy keeps the box's unmount of the
    lower the one thing that ends the FUSE session, as without a namespace.
    """
    mountsys.private_namespace()
    err = mountsys.umount(str(mountpoint), lazy=True)
    if err:
        raise MountError(f"cannot detach the daemon's copy of {mountpoint}: {err}")
    log.info("daemon in its own mount namespace; the overlays are invisible to it")


# -- unmount and status -----------------------------------------------------------------------------
def unmount(mountpoint: Path, *, lazy: bool = False, timeout: float = 30.0) -> str | None:
    """Unmount; with ``lazy``, a note when the daemon outlives the detach (it serves what is still open)."""
    mp = Path(os.path.abspath(mountpoint))
    reg = Registration.for_mountpoint(mp)
    info = reg.read()
    pid = info.get("pid") if info else None
    if info and (info.get("writable") or info.get("finalized")):
        return _unmount_writable(mp, reg, info, lazy, timeout)
    if mounted_fstype(mp) is None:
        if pid and pid_alive(pid):
            _wait_exit(pid, timeout, mp)
            return
        raise UsageError(f"{mp} is not mounted")
    if os.geteuid() == 0:  # by system call: nothing spawned, whatever covers the programs' paths
        err = mountsys.umount(str(mp), lazy=lazy)
        if err == "target is busy":
            raise MountError(f"{mp} is busy (files or directories in use); close them or use --lazy")
        if err:
            raise MountError(f"cannot unmount {mp}: {err}")
        if pid and pid_alive(pid):
            _wait_exit(pid, timeout, mp)
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
    if pid and pid_alive(pid):
        _wait_exit(pid, timeout, mp)


def _unmount_writable(mp: Path, reg: "Registration", info: dict, lazy: bool, timeout: float) -> str | None:
    """Overlays in reverse order, then the FUSE lower; the upper directories stay for the next mount."""
    from ogrefs.mount import overlay

    state = Path(info["state_dir"])
    errors = overlay.unmount_all(load_overlays(state), lazy=lazy, keep=info.get("own_directories") or [])
    if errors:
        busy = any("busy" in e.lower() for e in errors)
        raise MountError(f"cannot unmount {'; '.join(errors)}: nothing was unmounted"
                         + ("; close what uses it or use --lazy" if busy else ""))
    from ogrefs.mount import topfiles

    save_overlays([], state)  # what is mounted now: nothing (the upper directories stay)
    topfiles.hide(state)
    from ogrefs.mount import hostpaths

    hostpaths.unmount_layers(state)
    pid = info.get("pid")
    if info.get("finalized") or not (pid and pid_alive(pid)):
        mountsys.umount(str(state / "lower"), lazy=True)
        reg.remove()
        return None
    err = mountsys.umount(str(state / "lower"), lazy=lazy)
    if err:
        raise MountError(f"cannot unmount {state / 'lower'}: {err} (the overlays are down; use --lazy)")
    if not lazy:
        _wait_exit(pid, timeout, mp)
        return None
    # Detached: processes that still hold files of the snapshot (a shell started from the /usr
    # overlay, the unmount command itself) keep them, served by the daemon, which exits when the
    # last of them lets go (the kernel's DESTROY). The box itself shows its own tree already.
    try:
        _wait_exit(pid, min(timeout, LAZY_EXIT_WAIT_S), mp)
        return None
    except MountError:
        reg.write({**(reg.read() or info), "detached": True})
        return (f"{mp} is detached; its daemon (pid {pid}) goes on serving the processes that still use "
                "the snapshot's files and exits when the last of them does")


def finalize(target: Path, timeout: float = 30.0) -> list[str]:
    """Swap the FUSE lower of a fully materialized writable mount for the local copy.

    Afterwards the tree keeps working with no daemon and no store: each
    overlay is remounted with ``state/tree`` as its lower layer (same upper
    and work directories, so no write is lost), then the FUSE mount and its
    daemon go. Refused while the copy is incomplete or while a process has a
    file under the mount open for writing. Returns the overlay targets.
    """
    from ogrefs.mount import overlay

    mp = Path(os.path.abspath(target))
    reg = Registration.for_mountpoint(mp)
    info = reg.read()
    if not info or not info.get("writable"):
        raise UsageError(f"{mp} is not a writable ogrefs mount")
    if info.get("finalized"):
        raise UsageError(f"{mp} is already finalized: it runs from local disk with no daemon")
    status = read_status(mp)
    mat = status.get("materialize") or {}
    if not mat.get("complete"):
        done, total = mat.get("bytes_done", 0), mat.get("bytes_total", 0)
        why = mat.get("reason") or f"{done / 2**30:.2f} of {total / 2**30:.2f} GiB are local"
        raise UsageError(f"{mp} is not fully local yet ({why}); wait for `ogrefs status {mp}` to say complete")
    state = Path(info["state_dir"])
    old = load_overlays(state)
    ours = {p for p in (info.get("pid"), info.get("keeper_pid")) if p}
    writers = overlay.open_for_writing([o.target for o in old], exclude_pids=ours)
    if writers:
        raise UsageError(f"refusing to finalize while files are open for writing: {'; '.join(writers[:3])}")
    lower_root, tree_root = str(state / "lower"), str(state / "tree")
    keep = info.get("own_directories") or []
    _set_aside_host_owned(state, [p.removesuffix(" (merged)") for p in info.get("host_kept") or []
                                  if not p.endswith(" (merged)")])
    swapped: list[overlay.Overlay] = []
    for o_old in old:  # one by one: each target shows the same tree before and after its swap
        o_new = overlay.replace(o_old, lower=tree_root + o_old.lower[len(lower_root):], binds=())
        errors = overlay.unmount_all([o_old])
        if errors:
            save_overlays(swapped + old[len(swapped):], state)
            raise MountError(f"cannot finalize: {errors[0]} ({len(swapped)} of {len(old)} overlays already run "
                             "from local disk; close what uses it and run finalize again)")
        swapped.append(overlay.mount_one(o_new, keep))
    new = swapped
    save_overlays(new, state)
    from ogrefs.mount import topfiles

    topfiles.rebind(state, state / "tree")
    info.update(finalized=True, pid=None, lower=None)
    reg.write(info)
    pid = status.get("pid")
    mountsys.umount(str(state / "lower"), lazy=True)
    if pid and pid_alive(pid):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
        _wait_exit(pid, timeout, mp)
    reg.write(info)  # the daemon removed its registration on the way out; the finalized mount keeps one
    return [o.target for o in new]


def _set_aside_host_owned(state: Path, paths: list[str]) -> None:
    """Move the host-owned paths out of the local copy before it becomes the lower layer.

    The FUSE view hid them so this box's own showed through; the local copy
    has the snapshot's, which would cover them after ``finalize``. They are
    moved to ``state/host-owned/`` (kept, never deleted).
    """
    tree, aside = state / "tree", state / "host-owned"
    for p in paths:
        src = tree / p.lstrip("/")
        if os.path.lexists(src):
            dest = aside / p.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.replace(src, dest)


def _wait_exit(pid: int, timeout: float, mp: Path) -> None:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            raise MountError(f"{mp} is unmounted but its daemon (pid {pid}) has not exited after {timeout:.0f} s")
        time.sleep(0.05)


def read_status(mountpoint: Path) -> dict[str, Any]:
    mp = Path(os.path.abspath(mountpoint))
    reg = Registration.for_mountpoint(mp)
    info = reg.read()
    if info is None:
        raise UsageError(f"{mp} is not an ogrefs mount")
    if info.get("finalized"):
        return {**info, "age": 0.0, "materialize": {"complete": True}}
    if not pid_alive(info.get("pid", 0)):
        raise MountError(f"the daemon of {mp} (pid {info.get('pid')}) is gone; run `ogrefs unmount {mp}`")
    try:
        status = json.loads(reg.status.read_text())
    except (OSError, ValueError):
        raise MountError(f"the status of {mp} is not readable yet; try again") from None
    status["age"] = max(0.0, time.time() - status.get("time", time.time()))
    for key in KEEPER_KEYS:  # what the keeper did (writable mounts): the registration has it
        if key in info:
            status[key] = info[key]
    return status


#: Background states after which nothing more will be copied.
_ENDED = {"done", "stopped", "incomplete", "not materializing", "off"}


def wait_background(mountpoint: Path, *, poll: float = 0.2, timeout: float | None = None,
                    stale_after: float = STALE_AFTER,
                    progress: Callable[[dict[str, Any]], None] | None = None) -> tuple[dict[str, Any], str | None]:
    """Wait until the mount's background copy is complete; (last status, why it cannot complete or None).

    Materializing mounts end "done" (everything local); a mount that only warms
    its cache (read-only, ``--no-materialize``) ends when its prefetch is done.
    A mount that was to materialize but was refused (no room) and fell back to
    warming the cache did not complete: its reason is returned. A daemon that
    goes away, or stops rewriting its status for ``stale_after`` seconds (it
    rewrites it every 0.5 s), raises MountError, and so does ``timeout``.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        st = read_status(mountpoint)
        m = st.get("materialize") or {}
        if progress is not None:
            progress(st)
        if m.get("complete"):
            return st, None
        state = m.get("state")
        where = st.get("mountpoint", mountpoint)
        if m.get("mode") == "cache" and state == "done":
            return st, (f"{where} will not become fully local: {m['reason']}" if m.get("reason") else None)
        if state in _ENDED:
            return st, f"{where} will not become fully local: " + (m.get("reason") or state)
        if st.get("age", 0.0) > stale_after:
            raise MountError(f"the daemon of {where} (pid {st.get('pid')}) has not answered for "
                             f"{st['age']:.0f} s (stopped or hung?); see its log {st.get('log')}")
        if deadline is not None and time.monotonic() > deadline:
            raise MountError(f"{where} is not fully local after {timeout:.0f} s (still {state})")
        time.sleep(poll)
