"""Run a job whose path system calls wait for files still on their way, instead of failing.

:func:`supervise` forks the job with a seccomp filter (seccomp.py) that
stops it in each path system call until this process answers. The answer is
"go on" (``SECCOMP_USER_NOTIF_FLAG_CONTINUE``: the kernel runs the call as
if nothing had happened) at once unless the path (as spelled, or as this
box's symlinks resolve it; for a create, its directory) is one the
snapshot has and this box does not have in place yet; then a
waiter thread asks ``ensure`` for it (which puts it first in the queue and
returns once it is in place) and only then lets the call go on. A wait
that fails or outlasts ``wait_s`` fails the call with EIO, said on stderr.

Ownership: the thread that calls :func:`supervise` (the serving thread)
owns the listener's receiving side, the settled flag, the reader of the
job's memory and the caches of directories' resolutions and of paths seen
in place. A waiter thread owns one stopped call and answers it once; it
calls ``needs`` too (hence thread-safe) and reads only this box's files. Flights (one ``ensure`` in
progress per path, however many calls wait for it) live in a dict guarded
by ``_lock``; a flight's thread only runs ``ensure`` and sets its event.
Every thread here is a daemon thread: an ``ensure`` that never returns
cannot keep the process alive once the job is gone.

The job ends when no process carrying the filter is left: this process
(a child subreaper for the job's lifetime, so the job's orphans are its
children) has no child left but those it had before, or, where the kernel
does not list children, the listener reports POLLHUP (Linux 5.8).
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ogrefs.errors import OgrefsError
from ogrefs.supervise import paths, seccomp
from ogrefs.supervise.seccomp import CREATE, EXEC, Arch, Listener, Notification

try:  # the settled loop without Python per call (_settle.c); where it was not built, Listener.pass_next
    from ogrefs.supervise._settle import pass_calls
except ImportError:
    pass_calls = None

#: The longest a call waits for its file. A 100 GB checkpoint takes 14 min at 1 Gbit/s; past 30 min the
#: daemon is taken for stuck and the job is told EIO rather than held forever.
WAIT_S = 1800.0
#: How often the serving loop looks for exited children when no call arrives (once settled: how long the C loop
#: answers calls before the serving loop reaps and runs its signal handlers).
REAP_EVERY_S = 0.2
#: ... and once the last of them is exiting, until it can be reaped (a few milliseconds).
REAP_AFTER_HANGUP_S = 0.005
#: Interpreters followed from one exec (the kernel's BINPRM_MAX_RECURSION).
MAX_INTERPRETERS = 4
#: Directories whose resolution through this box's symlinks is remembered.
DIR_CACHE_MAX = 65536
#: Paths remembered as in place with nothing pending on their way (an import of torch touches 20,000).
KNOWN_MAX = 262144


class SupervisionUnavailable(OgrefsError):
    """This kernel or container does not let a job be supervised (the job was not started)."""


def unavailable_reason() -> str | None:
    """Why :func:`supervise` cannot work here, known without starting anything; None where it may."""
    if sys.platform != "linux":
        return "seccomp user notification needs Linux"
    if seccomp.this_arch() is None:
        return f"no system call table for this architecture ({os.uname().machine})"
    if kernel_version(os.uname().release) < (5, 5):
        return (f"Linux 5.5 or later is needed (SECCOMP_USER_NOTIF_FLAG_CONTINUE, to let a call go on), "
                f"this is {os.uname().release}")
    return None


def kernel_version(release: str) -> tuple[int, int]:
    """``6.18.44-fc-v1300`` -> (6, 18); (0, 0) where it cannot be read."""
    parts = release.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return 0, 0


@dataclass
class _Flight:
    """One ``ensure(path)`` in progress; ``error`` is set before ``event``."""

    event: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


class Supervisor:
    """Answers the job's path calls (see the module's docstring for who owns what)."""

    def __init__(self, listener: Listener, arch: Arch, needs: Callable[[str], bool],
                 ensure: Callable[[str, bool], None], settled: Callable[[], bool], wait_s: float,
                 report: Callable[[str], None]):
        self.listener, self.arch = listener, arch
        self.needs, self.ensure, self.settled_check = needs, ensure, settled
        self.wait_s, self.report = wait_s, report
        self.settled = False
        self.memory = paths.Memory()
        self.real_dirs: dict[str, str] = {}
        self.known: set[str] = set()
        self._lock = threading.Lock()
        self._flights: dict[tuple[str, bool], _Flight] = {}

    def handle(self, n: Notification) -> None:
        """Answer ``n`` now, or hand it to a waiter thread; never blocks on a file."""
        if self._settle():
            self.memory.close()
            self.listener.answer(n.id)
            return
        call = self.arch.calls.get(n.nr)
        waits: list[tuple[str, bool]] = []
        execs: list[str] = []
        for path_arg, dirfd_arg, kind in call.paths if call else ():
            raw = self.memory.string(n.pid, n.args[path_arg])
            path = paths.absolute(n.pid, None if dirfd_arg is None else n.args[dirfd_arg], raw) if raw else None
            if path is None:
                continue
            if kind == EXEC:
                execs.append(paths.lexical(path))
            flags = self._open_flags(call, n) if call.opens else None
            listing = flags is not None and not flags & seccomp.O_PATH
            if self._pending(path, listing) is not None:
                waits.append((path, listing))
            elif kind == CREATE or (flags is not None and flags & seccomp.O_CREAT):
                parent = os.path.dirname(paths.lexical(path))
                if paths.in_place(parent) is None and self._pending(parent, False) is not None:
                    waits.append((parent, False))
        if not (waits or execs) or not self.listener.valid(n.id):
            self.listener.answer(n.id)
            return
        try:
            threading.Thread(target=self._wait, args=(n, waits, execs, time.monotonic() + self.wait_s),
                             name=f"ogrefs-wait-{n.pid}", daemon=True).start()
        except RuntimeError as exc:  # no thread to be had: the call fails now rather than the job waiting forever
            self.report(f"{waits[0][0] if waits else execs[0]}: cannot wait for it ({exc}); the job was told EIO")
            self.listener.answer(n.id, errno.EIO)

    def _settle(self) -> bool:
        if self.settled:
            return True
        try:
            self.settled = bool(self.settled_check())
        except Exception as exc:  # noqa: BLE001 - the caller's code: a failure there must not stop the job
            self.report(f"the settled check failed ({exc}); every path is still checked")
            self.settled_check = lambda: False
        return self.settled

    def _open_flags(self, call: seccomp.Call, n: Notification) -> int | None:
        """An open's flags (openat2 keeps them in its ``open_how``); None where they cannot be read."""
        if call.flags_arg is None:
            return self.memory.u64(n.pid, n.args[2])
        return n.args[call.flags_arg]

    def _asks(self, path: str) -> bool:
        try:
            return bool(self.needs(path))
        except Exception as exc:  # noqa: BLE001 - the caller's code: the call goes on as if nothing were pending
            self.report(f"needs({path}) failed: {exc}")
            return False

    def _pending(self, path: str, listing: bool, done: frozenset[str] = frozenset(),
                 remember: bool = True) -> str | None:
        """What to wait for before the call on ``path`` may go on; None where it may go on now.

        ``needs`` answers for the path as spelled (a set lookup), and where
        this box's symlinks resolve it elsewhere (``/lib64/x`` is ``/lib/x``)
        for that path too. A pending directory that is here already is
        enough for anything but a listing (``listing``: an open, which may
        be read with getdents); a pending file that is here is an older
        copy (the image's) and is waited for. A path the snapshot lacks goes
        on at once (ENOENT, from the kernel). ``done``: just brought, not
        asked about again. ``remember``: the serving thread's own call, which
        alone keeps its caches: directories' resolutions, and the paths seen
        here with nothing pending on their way (in place stays in place:
        ``needs`` only ever turns False), which then cost a set lookup.
        """
        lex = paths.lexical(path)
        if remember and lex in self.known:
            return None
        if lex not in done and self._asks(lex):
            return lex if listing or paths.in_place(lex) is not False else None
        here = paths.in_place(lex)
        real = self._resolved(lex, here is False) if remember else paths.resolve(path)
        if real != lex and real not in done and self._asks(real):
            return real if listing or paths.in_place(real) is not False else None
        if remember and here is not None:
            if len(self.known) >= KNOWN_MAX:
                self.known.clear()
            self.known.add(lex)
        return None

    def _resolved(self, lex: str, is_dir: bool) -> str:
        """``lex`` through this box's symlinks, the directory's resolution remembered (the serving thread's).

        A directory that is here stays where it resolves (a symlink on the
        way replaced meanwhile is missed: docs/mount.md), and the walk of
        every component costs more than the call it checks: a miss below a
        known directory costs a dictionary lookup.
        """
        directory, name = (lex, "") if is_dir else posixpath.split(lex)
        real = self.real_dirs.get(directory)
        if real is None:
            real = paths.resolve(directory)
            if os.path.isdir(real):
                if len(self.real_dirs) >= DIR_CACHE_MAX:
                    self.real_dirs.clear()
                self.real_dirs[directory] = real
        return posixpath.join(real, name) if name else real

    def _wait(self, n: Notification, waits: list[tuple[str, bool]], execs: list[str], deadline: float) -> None:
        """A waiter thread: bring each path (and each exec's interpreters) in place, then answer ``n`` once."""
        error = errno.EIO
        try:
            for path, listing in waits:
                self._bring(path, listing, deadline)
            for path in execs:
                for _ in range(MAX_INTERPRETERS):
                    self._bring(path, False, deadline)
                    path = paths.interpreter(path)
                    if path is None:
                        break
            error = 0
        except _Failed as failed:
            self.report(f"{failed.path}: {failed.why}; the job was told EIO")
        except Exception as exc:  # noqa: BLE001 - a bug here must still answer the call, never leave it waiting
            self.report(f"waiting for {waits or execs} failed ({exc!r}); the job was told EIO")
        finally:
            with contextlib.suppress(OSError):  # the job has gone and the listener with it
                self.listener.answer(n.id, error)

    def _bring(self, path: str, listing: bool, deadline: float) -> None:
        """Wait until nothing on the way to ``path`` is pending (a link brought may point at a file still to come)."""
        done: set[str] = set()
        target = self._pending(path, listing, remember=False)
        while target is not None:
            if len(done) > paths.MAX_LINKS:
                raise _Failed(path, "still missing after as many waits as a path may have links")
            self._flight(target, listing, deadline)
            done.add(target)
            target = self._pending(path, listing, frozenset(done), remember=False)

    def _flight(self, path: str, whole: bool, deadline: float) -> None:
        with self._lock:
            flight = self._flights.get((path, whole))
            if flight is None:
                flight = self._flights[(path, whole)] = _Flight()
                threading.Thread(target=self._run_ensure, args=(path, whole, flight), name="ogrefs-ensure",
                                 daemon=True).start()
        if not flight.event.wait(max(0.0, deadline - time.monotonic())):
            raise _Failed(path, f"not in place after {self.wait_s:.0f} s")
        if flight.error is not None:
            raise _Failed(path, flight.error)

    def _run_ensure(self, path: str, whole: bool, flight: _Flight) -> None:
        try:
            self.ensure(path, whole)
        except Exception as exc:  # noqa: BLE001 - any failure of the caller's ensure is the job's EIO
            flight.error = str(exc) or type(exc).__name__
        finally:
            with self._lock:
                self._flights.pop((path, whole), None)
            flight.event.set()


class _Failed(Exception):
    def __init__(self, path: str, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


def _stderr(line: str) -> None:
    print(f"ogrefs: {line}", file=sys.stderr, flush=True)


def supervise(argv: list[str], env: dict[str, str] | None, needs: Callable[[str], bool],
              ensure: Callable[[str, bool], None], *, settled: Callable[[], bool] = lambda: False,
              cwd: str | None = None, wait_s: float = WAIT_S,
              report: Callable[[str], None] = _stderr) -> int:
    """Run ``argv`` supervised; returns its exit code (128 + N when a signal N ended it).

    ``needs(path)``: whether an absolute path (no ``.``/``..``) is one the
    snapshot has and this box does not have in place yet (a directory: until
    every entry of it is there by name), following the snapshot's symlinks
    in it (this box's own are followed here already). Called on the serving
    thread for every path call of the job and from waiter threads: cheap,
    never blocking, thread-safe. ``ensure(path, whole)``: block until
    ``path`` is in place (a file complete, a link made, a directory made,
    and where ``whole`` with every entry of it there by name: only a
    listing needs that); any exception: the waiting calls get EIO.
    ``settled()``: True once nothing is pending any more; from then on
    calls go on without their paths even being read (asked until it says
    True, then never again).

    This process becomes a child subreaper until the job ends and reaps
    every child it has meanwhile; the job's exit code is the one returned
    once no process of the job is left. Raises SupervisionUnavailable (the
    job was not started) where the kernel refuses the filter.
    """
    why = unavailable_reason()
    if why:
        raise SupervisionUnavailable(f"cannot supervise the job: {why}")
    arch = seccomp.this_arch()
    assert arch is not None
    before = seccomp.child_subreaper()
    seccomp.prctl(seccomp.PR_SET_CHILD_SUBREAPER, 1)
    try:
        others = _children()
        pid, listener = _start(argv, env, cwd, arch)
        try:
            listener.sync_wake_up()
            supervisor = Supervisor(listener, arch, needs, ensure, settled, wait_s, report)
            return _serve(supervisor, pid, others)
        except BaseException:
            # supervision ends here: the job would get ENOSYS from every path call; it ends too, as after a kill -9
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            raise
        finally:
            listener.close()
    finally:
        seccomp.prctl(seccomp.PR_SET_CHILD_SUBREAPER, before)


def _start(argv: list[str], env: dict[str, str] | None, cwd: str | None, arch: Arch) -> tuple[int, Listener]:
    """Fork the job; it installs the filter, hands its listener over a socket and execs ``argv``."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child execs or exits, coverage never sees it
        _child(ours, theirs, parent, argv, os.environ if env is None else env, cwd, arch)
    theirs.close()
    try:
        msg, fds, _flags, _addr = socket.recv_fds(ours, 512, 1)
    finally:
        ours.close()
    if not fds:
        os.waitpid(pid, 0)
        raise SupervisionUnavailable(f"cannot supervise the job: {msg.decode(errors='replace') or 'it died'}")
    os.set_inheritable(fds[0], False)
    return pid, Listener(fds[0])


def _child(ours: socket.socket, theirs: socket.socket, parent: int, argv: list[str], env, cwd: str | None,
           arch: Arch) -> None:
    code = 127
    try:
        ours.close()
        seccomp.prctl(seccomp.PR_SET_PDEATHSIG, signal.SIGKILL)  # a job that lost its supervisor would get ENOSYS
        if os.getppid() != parent:
            os._exit(1)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):  # what Python changed, back as a program expects
            signal.signal(sig, signal.SIG_DFL)
        if cwd is not None:
            os.chdir(cwd)
        try:
            fd = seccomp.install(arch)
        except OSError as exc:
            theirs.send((exc.strerror or str(exc)).encode())
            os._exit(1)
        socket.send_fds(theirs, [b"ok"], [fd])
        os.close(fd)
        theirs.close()
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        print(f"ogrefs: cannot run {argv[0]}: {exc.strerror or exc}", file=sys.stderr, flush=True)
    except BaseException:  # noqa: BLE001 - nothing may run on in a forked copy of the caller
        code = 1
    os._exit(code)


def _serve(supervisor: Supervisor, pid: int, others: set[int] | None) -> int:
    """Answer calls until no process with the filter is left and all of them are reaped; the job's exit code.

    The job has ended when its first process has exited and the children
    left are the ones this process had before it (``others``; None where
    ``/proc/self/task/*/children`` is missing: then at the listener's
    hang-up). The listener hangs up as the last of them exits, a moment
    before it can be reaped: from then on the loop only reaps, every 5 ms.
    """
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the job's
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, lambda signum, _frame: _forward(pid, signum))
    poller = select.poll()
    poller.register(supervisor.listener.fd, select.POLLIN)
    status: int | None = None
    hung_up = False
    try:
        while True:
            if supervisor.settled and pass_calls is not None and not hung_up:
                _passed, hup = pass_calls(supervisor.listener.fd, int(REAP_EVERY_S * 1000))
                flags = select.POLLHUP if hup else 0
            else:
                events = poller.poll((REAP_AFTER_HANGUP_S if hung_up else REAP_EVERY_S) * 1000)
                flags = events[0][1] if events else 0
            if flags & select.POLLIN:
                if supervisor.settled:
                    supervisor.listener.pass_next()
                    continue
                n = supervisor.listener.recv()
                if n is not None:
                    _handle(supervisor, n)
                continue
            if flags & select.POLLHUP:  # no user of the filter is left; from now on only reap
                hung_up = True
                poller.unregister(supervisor.listener.fd)
            status, children_left = _reap(pid, status)
            if status is not None and (not children_left or _only_others(others, hung_up)):
                return _exit_code(status)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _handle(supervisor: Supervisor, n: Notification) -> None:
    """``handle``, and where it fails (a bug) the call goes on unchecked: the job never waits for nothing."""
    try:
        supervisor.handle(n)
    except Exception as exc:  # noqa: BLE001 - ending supervision would fail every path call of the job (ENOSYS)
        supervisor.report(f"a path call was let through unchecked: {exc!r}")
        supervisor.listener.answer(n.id)


def _children() -> set[int] | None:
    """This process's children, zombies included; None where the kernel does not list them."""
    found: set[int] = set()
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                found.update(int(x) for x in f.read().split())
    except (OSError, ValueError):
        return None
    return found


def _only_others(others: set[int] | None, hung_up: bool) -> bool:
    """Whether every child left is one this process had before the job (so none of the job's is alive).

    As a subreaper this process is the parent of the topmost living process
    of the job, whatever died above it. Where the kernel does not list
    children, the listener's hang-up (Linux 5.8) says it instead.
    """
    now = _children() if others is not None else None
    return hung_up if now is None else now <= others


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _reap(pid: int, status: int | None) -> tuple[int | None, bool]:
    """Reap every exited child (the job's orphans are ours); the job's status once known, and whether any is left."""
    while True:
        try:
            got, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status, False
        if got == 0:
            return status, True
        if got == pid:
            status = code


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code
