"""The no-FUSE mount: where FUSE or mounting is not allowed, ``ogrefs mount SNAP /`` writes the snapshot into place.

A RunPod pod or a vast.ai instance is a Docker container without ``/dev/fuse``
and without CAP_SYS_ADMIN.  There :func:`why_no_fuse` says why (one line), and
``mount`` resolves an :class:`InPlacePlan` here (snapshot under the shared lock,
catalog, trace, the paths this box keeps, the state directory and its lock) and
forks :func:`daemon_child`: the write-in-place engine (``ogrefs/inplace/``) in
a thread, the control socket (``control.py``), the status file.  ``mount``
returns once the working set is in place (the trace's files, else the hints');
the daemon carries on with the rest, and ends when everything is in place (its
registration then says ``finalized``).  Killed or rebooted, the same ``ogrefs
mount`` resumes from the plan in the state directory.

What this box keeps is what the whole-box mount keeps (``box/hostpaths.py``'s
rules, at ``/``), plus Docker's container-managed files (``/etc/hostname``,
``/etc/hosts``, ``/etc/resolv.conf``) even with ``--no-host-paths``, plus
every mount point below the target (a network volume, ``/proc``, a bind),
plus ogrefs' own directories (the state directory with the plan, the caches,
the runtime directory, a local repository): never written into, nor below.
``merge``/``accounts``/``dpkg`` paths get this box's file merged with the
snapshot's, as the keeper merges them (``hostpaths.write_merged``).

Who owns what: the plan is frozen and inherited across the fork.  In the
daemon, the engine's thread owns the engine's writes (and the merged files,
and the registration's ``merged`` once, while the main thread only writes the
status file); the main thread writes the registration before that thread
starts and after it ends; control connections only ask the engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ogrefs.box import hostpaths, mountsys
from ogrefs.box.copyplan import Plan
from ogrefs.box.overlay import SYSTEM_DIRS
from ogrefs.box.records import Registration, atomic_json
from ogrefs.errors import OgrefsError
from ogrefs.inplace.engine import InPlace, Order
from ogrefs.lazy.trace.resolve import entries_to_replay, resolve_entries
from ogrefs.mount.checks import check_release, check_target, fuse_problem
from ogrefs.mount.control import ControlServer
from ogrefs.mount.detach import serve_detached
from ogrefs.mount.keeper import own_directories_of
from ogrefs.mount.options import MountOptions
from ogrefs.mount.plan import default_state_dir, lock_state_dir
from ogrefs.repo.catalog import Catalog
from ogrefs.repo.traces import find_trace
from ogrefs.restore import Interrupted, Restorer, short_gil_turns
from ogrefs.units import MiB

if TYPE_CHECKING:
    from ogrefs.repo import Repository
    from ogrefs.repo.locks import HeldLock

log = logging.getLogger(__name__)

#: Docker bind-mounts these into every container: always this box's.
CONTAINER_FILES = ("/etc/hostname", "/etc/hosts", "/etc/resolv.conf")
#: The plan of a no-FUSE mount, in its state directory (box/copyplan.py's format).
PLAN_NAME = "inplace.sqlite"
#: The status file is rewritten this often.
STATUS_INTERVAL = 0.5
_CAP_SYS_ADMIN = 21
#: A file Python imports a module from, in the directory it lists to find it: ``pkg/mod.py``, an extension
#: ``pkg/mod.cpython-311-x86_64-linux-gnu.so``, or the bytecode ``pkg/__pycache__/mod.cpython-311.pyc`` (which
#: Python uses only while ``pkg/mod.py`` is listed beside it). Group 1 is the directory listed.
_IMPORTED = re.compile(rb"^(.*)/(?:__pycache__/[^/]+\.pyc|[^/]+\.(?:py|so|pyd))$")
#: A file larger than this in such a directory is left to its own class (a listing of the directory waits for it).
IMPORT_LISTING_FILE_MAX = 64 * MiB


def why_no_fuse() -> str | None:
    """Why this box cannot make the FUSE and overlay mounts a writable mount needs, or None."""
    problem = fuse_problem()
    if problem:
        return problem
    if os.geteuid() == 0 and not _has_capability(_CAP_SYS_ADMIN):
        return "mounting is not allowed here: no CAP_SYS_ADMIN (an unprivileged container)"
    return None


def why_box_forbids_mounts() -> str | None:
    """:func:`why_no_fuse` where the reason is the box's (no device, no permission, no CAP_SYS_ADMIN), None
    where FUSE is only missing from or broken in this install: ``ogrefs run`` then says so rather than
    write the snapshot over this box's own tree (``--no-fuse`` asks for that)."""
    why = why_no_fuse()
    return None if why is None or why.startswith("FUSE support is") else why


def _has_capability(bit: int) -> bool:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError, IndexError):
        pass
    return True  # cannot tell: try the mount, which says what fails


@dataclass(frozen=True)
class InPlacePlan:
    """A no-FUSE mount as resolved before the fork; read-only for the daemon that inherits it."""

    opts: MountOptions
    repo: Repository
    manifest: dict[str, Any]
    catalog_path: Path
    target: Path
    state_dir: Path
    registration: Registration
    lock: HeldLock
    state_lock: int
    order: Order
    hidden: dict[int, frozenset]  # parent ino -> names this box keeps (hostpaths)
    kept_paths: frozenset[bytes]  # snapshot paths the engine never writes (merges, mount points, ogrefs' own)
    merges: tuple[tuple[str, str], ...] = ()  # (kind, path): this box's file merged with the snapshot's
    trace_notes: tuple[str, ...] = ()

    @property
    def snapshot_id(self) -> str:
        return self.manifest["id"]

    def skip(self, path: bytes, parent: int, name: bytes) -> bool:
        return name in self.hidden.get(parent, ()) or path in self.kept_paths


def prepare(opts: MountOptions, repo: Repository, lock: HeldLock,
            resolve: Callable[[Repository], dict[str, Any]] | None) -> InPlacePlan:
    """Resolve what the daemon needs (in the calling process, under ``lock``); raises with a one-line reason."""
    target = check_target(opts.mountpoint)
    manifest = resolve(repo) if resolve is not None else repo.resolve(opts.snapshot)
    check_release(manifest, target, opts)  # written in place, another release's /usr would stay for good
    lock.set_snapshot(manifest["id"])
    cat_path = repo.catalog_path(manifest["id"])
    catalog = Catalog(cat_path)
    notes: list[str] = []
    order = _order(repo, manifest, catalog, notes) if opts.replay_trace else Order(hints=_hints(catalog))
    state = Path(os.path.abspath(opts.state_dir or default_state_dir(manifest["id"], target)))
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    reg = Registration.for_mountpoint(target)
    state_lock = lock_state_dir(state, reg)
    hidden, kept, merges = _kept_by_box(opts, catalog, target, own_directories_of(opts, state, reg))
    return InPlacePlan(opts, repo, manifest, cat_path, target, state, reg, lock, state_lock, order, hidden, kept,
                       merges, tuple(notes))


def _order(repo: Repository, manifest: dict, catalog: Catalog, notes: list[str]) -> Order:
    """The trace's files in the order it first read them, then the hints'."""
    trace: list[int] = []
    try:
        entries = entries_to_replay(find_trace(repo, manifest), manifest, catalog, notes)
    except (OgrefsError, OSError) as exc:
        log.warning("no access trace used: %s", exc)
        entries = None
    for r in resolve_entries(catalog, entries or []):
        if not trace or trace[-1] != r.ino:
            trace.append(r.ino)
    trace.extend(_import_listings(catalog, entries or []))
    return Order(trace=tuple(dict.fromkeys(trace)), hints=_hints(catalog))


def _import_listings(catalog: Catalog, entries: list[tuple[bytes, int]]) -> list[int]:
    """The files of every directory Python lists to import a module the trace read, after the trace's own.

    A trace records reads; Python's importer also *lists* directories (once each, to find ``mod.py``,
    ``mod.*.so`` or the package directory ``mod/``): the directory of each module it imports, and, for a
    package, the directory holding it, up to the ``sys.path`` entry (the first that is not a package, without
    ``__init__.py``). A supervised job's listing of a directory waits for every file in it (a name appears only
    once its file is in place), and one without supervision would not find ``mod.py`` at all: without its
    listing Python ignores the ``__pycache__`` bytecode the trace read (bench_resume's step failed on
    ``torch._utils``). On the pointer box the step lists 238 directories holding 66 MB of files. Files over
    :data:`IMPORT_LISTING_FILE_MAX` are left out (a data file beside a script)."""
    listed: dict[int, None] = {}
    dirs = dict.fromkeys(m.group(1) for m in map(_IMPORTED.match, (path for path, _off in entries)) if m)
    for d in dirs:  # (each directory resolved once: a trace reads thousands of files from a few hundred)
        node = catalog.resolve(d)
        while node is not None and node.is_dir and node.ino not in listed:
            listed[node.ino] = None
            if catalog.lookup(node.ino, b"__init__.py") is None:
                break  # the sys.path entry, or a namespace package's directory
            node = catalog.get(catalog.parent_of(node.ino))
    return [child.ino for ino in listed for _name, child in catalog.children(ino)
            if child.is_reg and 0 < child.size <= IMPORT_LISTING_FILE_MAX]


def _hints(catalog: Catalog) -> tuple[int, ...]:
    """The hinted files and directories, in rank order (the daemon finds the files below each in its walk)."""
    return tuple(dict.fromkeys(hint for _k, hint, _r in catalog.hints()))


def _kept_by_box(opts: MountOptions, catalog: Catalog, target: Path, own: list[str] = ()
                 ) -> tuple[dict[int, frozenset], frozenset[bytes], tuple[tuple[str, str], ...]]:
    """What this box keeps: host-owned paths (at ``/``), container-managed files, mount points below the target,
    ogrefs' own directories (``own``: its state, caches, runtime directory, a local repository); and the
    files merged from both sides (none on a mount point or below one: those stay as they are)."""
    base = str(target).rstrip("/")
    untouched = {os.fsencode(point[len(base):]) for point in [row.point for row in mountsys.mount_table()] + list(own)
                 if point.startswith(base + "/")}
    hidden: dict[int, frozenset] = {}
    merges: list[tuple[str, str]] = []
    if str(target) == "/" and opts.data_only:  # this box's /usr, /etc, /var ... stay as they are
        untouched |= {os.fsencode(d) for d in SYSTEM_DIRS}
    if str(target) == "/":
        rules = list(opts.host_rules) if opts.host_rules is not None else hostpaths.load_rules()
        rules += [hostpaths.Rule("host", p) for p in CONTAINER_FILES]
        host = hostpaths.plan(catalog, rules)
        hidden = host.hidden
        merges = [(kind, p) for kind, p in host.merges
                  if not any(os.fsencode(p) == u or os.fsencode(p).startswith(u + b"/") for u in untouched)]
    kept = untouched | {os.fsencode(p) for _kind, p in merges}
    return hidden, frozenset(kept), tuple(merges)


# -- the daemon -----------------------------------------------------------------------------------------
def daemon_child(plan: InPlacePlan, ready_fd: int) -> int:
    """The detached daemon: reports ``ready`` once the working set is in place, ``error <reason>`` if it fails."""
    return serve_detached(plan.registration, plan.opts.log_level, ready_fd,
                          lambda: InPlaceDaemon(plan, ready_fd).run(), "no-FUSE mount daemon")


class InPlaceDaemon:
    """The engine in a thread, its control socket and its status; see the module docstring."""

    def __init__(self, plan: InPlacePlan, ready_fd: int | None) -> None:
        self.plan = plan
        self.ready_fd = ready_fd
        self.stop = threading.Event()
        self.state = "preparing"
        self.reason: str | None = None
        self.engine = InPlace(Catalog(plan.catalog_path), plan.repo.read_pack_range, os.fsencode(plan.target),
                              Plan(plan.state_dir / PLAN_NAME), snapshot_id=plan.snapshot_id, skip=plan.skip,
                              chunk_id=plan.repo.codec.chunk_id, decode_blob=plan.repo.codec.decode_blob,
                              stop=self.stop)
        self.sock_path = plan.registration.path.with_suffix(".sock")
        self.info = {"pid": os.getpid(), "mountpoint": str(plan.target), "snapshot": plan.snapshot_id,
                     "in_place": True, "writable": False, "state_dir": str(plan.state_dir),
                     "repo": plan.repo.store.url, "status": str(plan.registration.status),
                     "log": str(plan.registration.log), "control": str(self.sock_path), "started": time.time(),
                     "trace_notes": list(plan.trace_notes)}

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, lambda _n, _f: self.stop.set())
        short_gil_turns()  # (this process is the copy)
        self.plan.lock.start_refresher()  # the parent's heartbeat thread did not survive the fork
        server = None
        try:
            self.plan.registration.write(self.info)
            worker = threading.Thread(target=self._work, name="ogrefs-inplace", daemon=True)
            worker.start()
            server = ControlServer(self.sock_path, self.engine, threading.Event())
            server.start()
            while worker.is_alive():
                self._write_status()
                worker.join(STATUS_INTERVAL)
            self._write_status()
        finally:
            self._unregister()  # before the socket goes: a caller refused then reads the final registration
            if server is not None:
                server.close()
            self.plan.lock.release()
        return 0 if self.state == "done" else 1

    def _work(self) -> None:
        """The engine's thread: prepare, then every batch; ``ready`` on the pipe once the working set is in place."""
        try:
            self.engine.prepare(self.plan.order)
            self._merge()
            self._phase("prepared_s")
            self.state = "copying"
            if self.plan.opts.ready_when_prepared:  # `ogrefs run`'s own copy: its supervisor waits path by path
                self._ready()
            log.info("no-FUSE mount of %s at %s: %d files, %d in place already", self.plan.snapshot_id[:12],
                     self.plan.target, self.engine.counts["files_total"], self.engine.counts["files_done"])
            self.engine.run(on_working_set=self._working_set)
            st = self.engine.status()
            self.state = "done" if not (st["failed"] or st["skipped"]) else "incomplete"
            if st["failed"]:
                self.reason = f"{st['failed']} entries could not be written (first: {st['first_failure']})"
            elif st["skipped"]:
                self.reason = (f"{len(st['skipped'])} catalog entries are unsafe or malformed and were not written "
                               f"(first: {st['skipped'][0]})")
        except Interrupted:
            self.state, self.reason = "stopped", "stopped before everything was in place; mount again to resume"
        except Exception as exc:  # noqa: BLE001 - the daemon reports it (status, pipe), then exits
            log.exception("no-FUSE copy failed")
            self.state, self.reason = "stopped", str(exc)
        self._ready()

    def _merge(self) -> None:
        """This box's accounts, authorized_keys and dpkg status merged with the snapshot's, as the whole-box mount
        merges them: the snapshot's copies restored into ``<state>/merge``, each merge renamed into place."""
        if not self.plan.merges:
            return
        staging = self.plan.state_dir / "merge"
        shutil.rmtree(staging, ignore_errors=True)
        r = Restorer(Catalog(self.plan.catalog_path), self.plan.repo.read_pack_range, os.fsencode(staging),
                     includes=[os.fsencode(p) for _k, p in self.plan.merges], check_space=False,
                     decode_blob=self.plan.repo.codec.decode_blob)
        r.run()
        done = []
        for kind, path in self.plan.merges:
            rel = path.lstrip("/")
            try:
                hostpaths.write_merged(kind, path, staging / rel, Path("/"), rel, staging)
                done.append(f"{path} (merged)")
            except (OSError, OgrefsError) as exc:
                log.warning("not merged: %s (%s); this box's file stays", path, exc)
                done.append(f"{path}: not merged ({exc}); this box's file stays")
        self.info["merged"] = done
        self.plan.registration.write(self.info)

    def _working_set(self) -> None:
        self._phase("working_set_s")
        self._ready()

    def _ready(self) -> None:
        """Tell the waiting ``mount`` (once): ready, or why the working set is not in place."""
        fd, self.ready_fd = self.ready_fd, None
        if fd is None:
            return
        self._write_status()  # what `mount` reports once it reads "ready"
        st = self.engine.status()
        if self.state == "stopped" and self.reason:
            line = f"error {self.reason}"
        elif st["failed"]:
            line = (f"error the working set is not all in place: {st['failed']} entries failed (first: "
                    f"{st['first_failure']}); `ogrefs status {self.plan.target}` says more, and the same "
                    "`ogrefs mount` completes it")
        else:
            line = "ready"
        with contextlib.suppress(OSError):
            os.write(fd, line.encode() + b"\n")
            os.close(fd)

    def _phase(self, name: str) -> None:
        """When a phase ended, in seconds since the daemon started (``status --json``: where the time went)."""
        self.info[name] = round(time.time() - self.info["started"], 3)

    def _write_status(self) -> None:
        m = self.engine.status()
        m.update(state=self.state, reason=self.reason, complete=self.state == "done")
        started = self.info["started"]
        now = time.time()
        m["rate_bps"] = m["written_bytes"] / max(now - started, 1e-3)
        with contextlib.suppress(OSError):
            atomic_json(self.plan.registration.status,
                        {**self.info, "time": now, "materialize": m, "in_place": True})

    def _unregister(self) -> None:
        """The registration stays without a daemon, with the final status: complete (``finalized``), or why not
        (``ogrefs status`` says it, the same ``ogrefs mount`` resumes)."""
        reg = self.plan.registration
        m = self.engine.status()
        m.update(state=self.state, reason=self.reason, complete=self.state == "done")
        with contextlib.suppress(OSError):
            reg.write({**self.info, "pid": None, "finalized": self.state == "done", "finished": time.time(),
                       "materialize": m})
            reg.status.unlink()
