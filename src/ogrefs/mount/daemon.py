"""The mount daemon: builds the lazy stack, mounts FUSE, serves until unmounted or signalled.

The stack, on one trio loop: chunk cache → fetcher → vfs (through HostView
when host-owned paths are hidden) → pyfuse3 adapter; beside it the prefetch
and materialization task, the access-trace recorder and the status writer.

A writable mount's daemon has a keeper (launch.py, keeper.py): right after
the FUSE mount, before any thread starts, it moves to a mount namespace of
its own and drops its copy of the FUSE mount, so the overlays the keeper
mounts in the box afterwards are invisible here and nothing this process
opens, imports or execs resolves through what it serves. Everything it
imports is imported before the fork (this module's imports).

Teardown is one ``AsyncExitStack``: each step is registered next to the
setup it undoes and they run in reverse — the access trace is saved if its
recording window had not ended, the FUSE session is closed, the chunk cache
closed, the repository lock released (nothing is served any more: prune may
delete what this mount read), and the registration removed (unless
``finalize`` made it the finalized mount's).

Who owns what: the trio loop owns the fetcher, the vfs, the prefetch and the
status writer (one nursery) and every attribute of :class:`Daemon`; worker
threads only run the blocking calls handed to them (status file writes,
read-ahead tuning, the keeper's answer, the teardown in the box) with
arguments they do not change.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import trio

from ogrefs.box.records import (MountError, Registration, atomic_json, clear_snapshot_started, snapshot_running,
                              snapshot_started)
from ogrefs.lazy.background.boxcpu import OthersCpu
from ogrefs.lazy.fetch.chunkcache import CacheCipher, ChunkCache
from ogrefs.lazy.fetch.fetcher import Fetcher
from ogrefs.lazy.fetch.blobio import PackReads
from ogrefs.lazy.background.materialize.materializer import Materializer
from ogrefs.lazy.background.prefetch import Prefetch
from ogrefs.lazy.trace.recorder import Recorder, quiet_from_env, save_trace, save_when_recorded
from ogrefs.lazy.background.snapshotgate import SnapshotGate
from ogrefs.lazy.fs.vfs import SnapshotFS
from ogrefs.mount import fuse_ops, keeper, loopprofile
from ogrefs.box import mountsys
from ogrefs.box.hostpaths import HostView
from ogrefs.mount.passthrough import Passthrough
from ogrefs.mount.plan import MountPlan
from ogrefs.mount.status import STATUS_INTERVAL
from ogrefs.repo import default_cache_dir
from ogrefs.repo.catalog import Catalog

log = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

#: Counters of the vfs (VfsStats) and the fetcher (FetchStats, snapshot_stats) that the status names otherwise.
STATUS_NAMES = {"read_wait": "read_wait_s", "hits_memory": "cache_hits_memory", "hits_disk": "cache_hits_disk",
                "misses": "cache_misses", "in_flight": "chunks_in_flight", "queued": "chunks_queued"}


@dataclass(frozen=True)
class KeeperLink:
    """The daemon's two pipes to its keeper: it writes ``fuse-ready`` and ``teardown``, reads ``done``."""

    to_keeper: int
    from_keeper: int


class Daemon:
    """One mount's serving process; :meth:`run` returns its exit code."""

    def __init__(self, plan: MountPlan, ready_fd: int | None, keeper_link: KeeperLink | None = None) -> None:
        self.plan = plan
        self.ready_fd = ready_fd  # "ready" / "error <reason>" for the mount command (None: foreground or keeper)
        self.keeper = keeper_link
        self.early_signals: list[int] = []  # signals that came while trio's receiver was not open
        self.serving = False  # set once the stack is built and mounted: failures after it are logged
        self.registered = False
        self.trace_saved = False
        self.box_ns: int | None = None  # the box's mount namespace (a keeper's daemon), for a keeper that died
        self.initialized = trio.Event()  # set by the kernel's INIT request
        self.nursery: trio.Nursery | None = None
        self.info: dict[str, Any] = {}
        self.profile = loopprofile.LoopProfile() if loopprofile.enabled() else None  # OGREFS_PROFILE_LOOP

    def run(self) -> int:
        """Serve until unmounted or signalled: 0, or 1 when serving failed (logged).

        A failure before serving (the stack cannot be built, the FUSE mount
        refused) is raised, after what was set up has been undone: the
        caller reports it on the mount command's pipe.
        """
        # Outside trio's receiver (before it opens, and after it closes on the way out) a signal is only
        # remembered: the default action would kill the daemon before it releases its lock.
        for signum in _SIGNALS:
            signal.signal(signum, lambda num, _frame: self.early_signals.append(num))
        try:
            trio.run(self._main)
        except BaseException:
            if not self.serving:
                raise
            log.exception("mount of %s failed", self.plan.mountpoint)
            return 1
        return 0

    async def _main(self) -> None:
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(self._unregister)  # last of all
            stack.callback(self.plan.lock.release)  # a daemon that fails to start releases it too
            self._build(stack)
            self._mount(stack)
            if self.recorder is not None:
                stack.callback(self._save_trace_unless_saved)
            self.serving = True
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                if self.profile is not None:
                    trio.lowlevel.add_instrument(self.profile)
                    nursery.start_soon(self.profile.sample_wakeups)
                await nursery.start(self.fetcher.run)
                nursery.start_soon(self._on_signals)
                nursery.start_soon(self._announce)
                nursery.start_soon(self._write_status)
                nursery.start_soon(self.fs.run_pushes)
                await fuse_ops.serve()
                nursery.cancel_scope.cancel()

    # -- setup --------------------------------------------------------------------------------------
    def _build(self, stack: contextlib.AsyncExitStack) -> None:
        """Chunk cache → fetcher → vfs, and the recorder, materializer and prefetch beside them."""
        plan, opts, repo = self.plan, self.plan.opts, self.plan.repo
        catalog = Catalog(plan.catalog_path)
        self.chunk_dir = opts.chunk_cache or (opts.cache_root or default_cache_dir()) / "chunks"
        cipher = CacheCipher(repo.codec.cache_key()) if opts.encrypt_cache else None
        self.cache = ChunkCache(self.chunk_dir, opts.cache_size, chunk_id=repo.codec.chunk_id, cipher=cipher)
        stack.callback(_quietly, self.cache.close)
        stop = threading.Event()  # set when the fetcher stops: a store call waiting out an outage gives up
        packs = PackReads(repo.store, opts.retry_for, stop)  # the one retry: the store's, within --retry-for
        self.fetcher = Fetcher(packs.read_range, self.cache, max_requests=opts.max_requests,
                               memory_bytes=opts.memory_cache, decode=repo.codec.decode_blob,
                               open_range=packs.open_range, stop=stop, retries=lambda: packs.retries)
        self.recorder = Recorder(catalog, quiet_s=quiet_from_env()) if plan.save_trace else None
        if self.recorder is not None and plan.state_dir is not None:
            clear_snapshot_started(plan.state_dir)  # an earlier mount's snapshot says nothing about this resume
        # (the materializer shares the fetcher's residency: what readers fetch goes to the tree at once, not via
        # the chunk cache)
        # (its passes yield to the application: idle_for is the vfs's, made just below; and to the box's
        # other processes when they leave it less than a core, cpu_busy)
        materializer = (Materializer(catalog, self.fetcher, plan.state_dir, idle_for=lambda: self.fs.idle_for(),
                                     cpu_busy=lambda: OthersCpu().busy)
                        if (plan.state_dir is not None and opts.materialize) else None)
        host_paths = plan.writable.host_paths if plan.writable else None
        view = catalog
        if host_paths is not None and host_paths.hidden:
            view = HostView(catalog, host_paths.hidden)  # host-owned entries: this box's show through
        self.fs = SnapshotFS(view, self.fetcher, recorder=self.recorder, local=materializer,
                             chunk_id=repo.codec.chunk_id, chunk_hasher=repo.codec.chunk_hasher,
                             page_cache=fuse_ops.store_in_page_cache,
                             # OGREFS_OPEN_PUSH=0: no open-time push (lazy/fs/openpush.py), for comparisons
                             open_push=os.environ.get("OGREFS_OPEN_PUSH", "1") != "0")
        # complete local copies read by the kernel (mount/passthrough.py); --no-passthrough or OGREFS_PASSTHROUGH=0:
        # by the daemon
        wanted = materializer is not None and opts.passthrough and os.environ.get("OGREFS_PASSTHROUGH", "1") != "0"
        self.passthrough = Passthrough() if wanted else None
        self.prefetch = Prefetch(catalog, self.fetcher, trace_entries=plan.trace_entries, materializer=materializer,
                                 idle_for=self.fs.idle_for)
        # a snapshot of the box this writable mount runs goes first: background fetches wait (snapshotgate.py)
        state_dir = plan.state_dir
        self.snapshot_gate = (SnapshotGate(self.fetcher, lambda: snapshot_running(state_dir))
                              if state_dir is not None else None)

    def _mount(self, stack: contextlib.AsyncExitStack) -> None:
        """The FUSE mount, this process's own namespace (with a keeper), the lock's heartbeat, the registration."""
        plan = self.plan
        self.info = self._registration_info()
        ops = fuse_ops.FuseOps(self.fs, on_init=self.initialized.set,
                               on_request=self.profile.serving if self.profile is not None else None,
                               passthrough=self.passthrough)
        fuse_ops.fuse_mount(ops, str(plan.mountpoint), fuse_ops.mount_options(allow_other=plan.opts.allow_other))
        # With a keeper this namespace has no mount left to unmount: the box's unmount of the lower ends the session.
        stack.callback(_quietly, fuse_ops.fuse_close, unmount=self.keeper is None)
        if self.keeper is not None:
            self.info["skipped"] = plan.writable.skipped
            self.box_ns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)  # for a keeper that died
            own_namespace(plan.mountpoint, runs_from(plan, self.chunk_dir))
        plan.lock.start_refresher()  # in a forked daemon the parent's heartbeat thread did not survive
        plan.registration.write(self.info)
        self.registered = True
        log.info("mounted snapshot %s of %s at %s", plan.snapshot_id[:12], plan.repo.store.url, plan.mountpoint)
        for note in plan.trace_notes:  # resolved in the calling process, which logs nowhere
            log.info("%s", note)

    def _registration_info(self) -> dict[str, Any]:
        plan, reg = self.plan, self.plan.registration
        return {"pid": os.getpid(), "mountpoint": str(plan.target), "snapshot": plan.snapshot_id,
                "writable": not plan.opts.read_only, "lower": str(plan.mountpoint),
                "state_dir": str(plan.state_dir) if plan.state_dir else None,
                "overlays": [o.target for o in (plan.writable.overlays if plan.writable else [])],
                "repo": plan.repo.store.url, "status": str(reg.status), "log": str(reg.log), "started": time.time(),
                "chunk_cache": str(self.chunk_dir), "trace_notes": list(plan.trace_notes)}

    # -- serving ------------------------------------------------------------------------------------
    async def _announce(self) -> None:
        """Once the kernel's INIT is answered: tell the keeper or the mount command, then start background work."""
        plan = self.plan
        await self.initialized.wait()
        if self.keeper is not None:  # the keeper brings the box up; this process only serves
            os.write(self.keeper.to_keeper, b"fuse-ready\n")
        else:
            await trio.to_thread.run_sync(mountsys.tune_readahead, plan.mountpoint, plan.opts.readahead_kb)
        await trio.to_thread.run_sync(atomic_json, plan.registration.status, self.status())
        if self.ready_fd is not None:
            os.write(self.ready_fd, b"ready\n")
            os.close(self.ready_fd)
        else:
            print(f"mounted snapshot {plan.snapshot_id[:12]} at {plan.target}; Ctrl-C unmounts", flush=True)
        # Only now: prefetch and materialization yield to reads, but the mount comes first.
        if plan.prefetch:
            self.nursery.start_soon(self._prefetch_then_report)
        else:
            self.prefetch.state = "off"
            self.prefetch.reason = "a read-only mount fetches only what is read (--prefetch warms it)"
        if self.recorder is not None:
            self.nursery.start_soon(self._save_when_recorded)
        if self.snapshot_gate is not None:
            self.nursery.start_soon(self.snapshot_gate.watch)

    async def _prefetch_then_report(self) -> None:
        await self.prefetch.run()
        # at once, not at the next tick: `ogrefs status --wait` is waiting for this
        await trio.to_thread.run_sync(self.plan.registration.write_status, self.status())

    async def _save_when_recorded(self) -> None:
        await save_when_recorded(self.plan.repo, self.plan.snapshot_id, self.recorder, self.plan.trace_entries,
                                 snapshot_started=self._snapshot_started)
        self.trace_saved = True

    def _snapshot_started(self) -> float | None:
        """When a snapshot of the box running from this writable mount started (blocking: a small read)."""
        return snapshot_started(self.plan.state_dir) if self.plan.state_dir is not None else None

    async def _write_status(self) -> None:
        """Rewrite the status file every STATUS_INTERVAL while the mountpoint's registration is this daemon's."""
        reg = self.plan.registration
        while await trio.to_thread.run_sync(reg.write_status, self.status()):
            await trio.sleep(STATUS_INTERVAL)
        log.warning("%s is registered to another daemon now (a new mount): this one stops writing its status",
                    self.plan.target)

    async def _on_signals(self) -> None:
        stopping = False
        with trio.open_signal_receiver(*_SIGNALS) as signals:
            if self.early_signals:
                log.info("signal %d before serving: unmounting", self.early_signals[0])
                fuse_ops.terminate()
                return
            async for signum in signals:
                if stopping:  # more signals (systemd signals the whole cgroup, the keeper forwards): one stop
                    continue
                stopping = True
                log.info("signal %d: unmounting", signum)
                if self.keeper is not None:  # the keeper detaches the overlays while this still answers
                    await self._detach_the_box()
                fuse_ops.terminate()

    async def _detach_the_box(self) -> None:
        answer = ""
        with contextlib.suppress(OSError):
            os.write(self.keeper.to_keeper, b"teardown\n")
            answer = await trio.to_thread.run_sync(keeper.read_line, self.keeper.from_keeper,
                                                   keeper.TEARDOWN_TIMEOUT)
        if answer != "done":  # the keeper is gone: detach from a child in the box's namespace
            log.warning("no keeper answered; detaching the overlays from the box's namespace")
            await trio.to_thread.run_sync(teardown_in_box, self.box_ns, self.plan.state_dir, self.plan.registration)

    def status(self) -> dict[str, Any]:
        """What ``ogrefs status`` shows: the registration's info and the counters of every part.

        The vfs's and the fetcher's counters go in under their own names (:data:`STATUS_NAMES` renames the
        few a reader of the status knows by another), so a counter added there shows here unasked."""
        fs, vs = self.fs, self.fs.stats
        counters = {**asdict(vs), **self.fetcher.snapshot_stats()}
        counters["read_wait"] = round(counters["read_wait"], 3)
        return {**self.info, "time": time.time(), **{STATUS_NAMES.get(k, k): v for k, v in counters.items()},
                "cache_hits": counters["hits_memory"] + counters["hits_disk"],
                "open_files": fs.open_files, "referenced_inodes": fs.referenced_inodes,
                "open_push": fs.open_push.stats() if fs.open_push is not None else None,
                "passthrough": self._passthrough_status(),
                "materialize": self.prefetch.stats(), "trace_replayed": len(self.plan.trace_entries or []),
                "snapshot_yield": self.snapshot_gate.stats() if self.snapshot_gate is not None else None,
                "trace_recording": bool(self.recorder and self.recorder.active),
                **({"loop_profile": self.profile.report()} if self.profile is not None else {})}

    def _passthrough_status(self) -> dict[str, Any] | None:
        pt = self.passthrough
        return None if pt is None else {"state": pt.state, **asdict(pt.stats), "inodes": pt.inodes}

    # -- teardown (registered on the exit stack) ------------------------------------------------------
    def _save_trace_unless_saved(self) -> None:
        """Unmounted before the recording window ended: a short trace still helps the next mount.

        Runs on the loop after the nursery has closed (nothing else is served, so blocking here stalls nobody).
        """
        if self.trace_saved:
            return
        at = self._snapshot_started()
        if at is not None:
            self.recorder.snapshot_started(at)
        self.recorder.stop()
        try:
            save_trace(self.plan.repo, self.plan.snapshot_id, self.recorder, self.plan.trace_entries)
        except Exception as exc:  # noqa: BLE001 - a lost trace costs the next mount its head start only
            log.warning("could not save the access trace: %s", exc)

    def _unregister(self) -> None:
        reg = self.plan.registration
        if self.registered and not (reg.read() or {}).get("finalized"):  # finalize keeps a registration
            reg.remove_if_daemon(os.getpid())  # not a new mount's, after a lazy unmount let this one linger
        log.info("unmounted %s", self.plan.mountpoint)


def _quietly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """A teardown step whose failure must not stop the ones after it (the process is ending anyway)."""
    with contextlib.suppress(Exception):
        fn(*args, **kwargs)


def own_namespace(mountpoint: Path, keep: list[str]) -> None:
    """Leave the box's mount namespace (keeping its current view) and drop the copies of ogrefs' FUSE mounts.

    Must run before any thread starts (the kernel refuses CLONE_NEWNS to a
    multi-threaded process). Dropping the copy of this mount keeps the box's
    unmount of the lower the one thing that ends the FUSE session, as without
    a namespace; dropping the copies of the others' (a read-only mount made
    before this one, another writable mount's lower and overlays) keeps this
    daemon from pinning them: their unmount ends their daemons while this one
    lives. ``keep``: paths this daemon runs from (:func:`runs_from`), whose
    overlays stay.
    """
    mountsys.private_namespace()
    err = mountsys.umount(str(mountpoint), lazy=True)
    if err:
        raise MountError(f"cannot detach the daemon's copy of {mountpoint}: {err}")
    others = [p for p in mountsys.detach_ogrefs_mounts(keep) if p != str(mountpoint)]
    log.info("daemon in its own mount namespace; the overlays are invisible to it%s",
             f"; detached its copies of other ogrefs mounts: {', '.join(others)}" if others else "")


def runs_from(plan: MountPlan, chunk_dir: Path) -> list[str]:
    """What a daemon reads or writes after leaving the box's namespace: its mount's own directories (state,
    caches, runtime, a local repository), the interpreter and ogrefs itself (lazy imports), and ``/etc``
    (resolver, CA certificates)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ogrefs/, above mount/
    paths = keeper.own_directories(plan) + [str(chunk_dir), sys.prefix, sys.base_prefix, sys.exec_prefix,
                                            os.path.dirname(os.path.realpath(sys.executable)), package, "/etc"]
    return [os.path.abspath(p) for p in paths]


def teardown_in_box(box_ns: int, state_dir: Path, reg: Registration, timeout: float = 30.0) -> None:
    """Without a keeper: fork a child (single-threaded, so it may setns) that detaches everything in the box.

    The daemon keeps answering FUSE meanwhile, so the child's path lookups through the overlays never wait
    on a process that waits for them.
    """
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            mountsys.enter_namespace(box_ns)
            keeper.teardown(Path(state_dir), reg)
            code = 0
        except BaseException:  # noqa: BLE001 - os._exit below would leave it unsaid: the daemon's log says it
            log.exception("detaching the box without its keeper failed")
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            if code != 0:
                log.error("detaching the overlays without the keeper failed (exit status %d)", code)
            return
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            log.error("detaching the overlays did not finish within %.0f s", timeout)
            return
        time.sleep(0.05)
