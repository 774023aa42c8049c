"""The tree build in a process of its own, at the scheduler's idle priority, started and paced by the daemon.

Why a process: the build (:func:`.build.build`: a directory, a sparse file
and a plan row per entry; 22,806 entries and ~1.7 s of CPU on the pointer
bench box) is Python that holds the GIL between its system calls.  In a
worker thread of the daemon it shared that GIL with the thread that answers
every FUSE request, so an application's requests waited behind it (a warm
training step took 1.35-1.65x its time from local disk with the build
beside it, 1.22x without, docs/benchmarks.md).  A child process shares no
GIL, and it runs under ``SCHED_IDLE``: the kernel gives it a core only when
nothing else wants one, which is what "prefetch yields CPU" means, enforced
by the scheduler instead of guessed from /proc.  On a box whose every core
others keep busy, idle priority alone would starve it for minutes (~0.3 %
of a core beside one CPU loop per core); a child that got less than 5 % of a
core over 0.3 s gets the next 0.1 s at normal priority (:class:`_Floor`), a
quarter of the time, as a pass gets beside an active application.  What the scheduler cannot
see (the application's requests to the mount, the disk it shares, a
snapshot of the box that must go first) the daemon still paces through the
:class:`~.pacing.BuildGate`: while the gate says wait, the child is stopped
(``SIGSTOP``) and continued (``SIGCONT``) when the gate opens or its pause
is over; a stopped gate (the materializer cancelled) kills it.

What the child is given: the plan and catalog paths and the tree's root, as
JSON on its stdin (immutable inputs); it writes one JSON line on its stdout
(``{"ok": true}`` or the error: ``{"error": ..., "errno": ...}`` for a
system error, ``{"corrupt": ...}`` for a catalog it cannot trust) and logs
to the daemon's stderr (the mount's log).  Its plan transaction commits only
at the end of a whole build, so a killed child leaves nothing that looks
built: the next run builds again.  It dies with the thread that waits on it
(``PR_SET_PDEATHSIG``), so an orphan never writes a state directory that a
later mount reuses.

The daemon never runs what it serves: the child is the daemon's own
interpreter and modules, started in the daemon's mount namespace, which a
writable mount's keeper left without the overlays and the FUSE lower
(mount/daemon.py); only writable mounts materialize.

Who owns what: :func:`build_in_child` runs in the preparation's worker
thread and owns the child from start to reaping (its stops, its scheduling
policy: the :class:`_Floor` is that thread's); the gate's events are the
loop's (:mod:`.pacing`), read here only.  Nothing here touches the loop.

Seam: ``command`` is the argv that runs :func:`main` (:data:`COMMAND` unless
the materializer is given another: a test slows the child down or makes it
fail, in a real process).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol, Sequence

from ogrefs.errors import CorruptObject, OgrefsError
from ogrefs.lazy.background.proctick import process_ticks

log = logging.getLogger(__name__)

#: How the daemon starts the child: its own interpreter, :mod:`.buildchild`.
COMMAND: tuple[str, ...] = (sys.executable, "-m", "ogrefs.lazy.background.materialize.buildchild")
#: The child runs this long between two looks at the gate.
PIECE_S = 0.05
#: A child that got less than FLOOR_SHARE of a core over STARVED_S at idle priority (every core kept busy by
#: others) gets the next BOOST_S at normal priority: a quarter of the time, like a pass beside an active
#: application, so the build still ends on a box that never idles.
STARVED_S = 0.3
FLOOR_SHARE = 0.05
BOOST_S = 0.1


class Gate(Protocol):
    """Where the build waits while an application is active (``pacing.BuildGate``, the loop's): read only here."""

    def stopped(self) -> bool: ...

    def waiting(self) -> bool: ...

    def pause(self, worked: float) -> float: ...


class BuildStopped(Exception):
    """The materializer was cancelled while the tree was built (the gate says so); the build is undone."""


def build_in_child(plan_path: Path, catalog_path: Path, tree_root: bytes, gate: Gate | None = None,
                   command: Sequence[str] = COMMAND) -> float:
    """Worker thread: build the tree and the plan in a child process; the seconds it was held at the gate.

    Raises :class:`BuildStopped` (the gate stopped: the child is killed),
    ``OSError`` (a system error in the child, its errno kept: a full disk is
    reported as such), :class:`CorruptObject`, or :class:`OgrefsError` (the
    child could not start or died).
    """
    spec = json.dumps({"plan": str(plan_path), "catalog": str(catalog_path), "tree": os.fsdecode(tree_root),
                       "parent": os.getpid(), "level": logging.getLogger().getEffectiveLevel()})
    env = dict(os.environ)
    # the child imports the same ogrefs as this process (a source tree on PYTHONPATH in benchmarks, too)
    here = str(Path(__file__).resolve().parents[__name__.count(".")])  # the directory that holds ogrefs/
    env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    try:
        proc = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                close_fds=True)
    except OSError as exc:
        raise OgrefsError(f"cannot start the tree build process ({exc.strerror})") from None
    paused = 0.0
    try:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(spec.encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: its exit status says so below
        ran_since = time.monotonic()
        floor = _Floor(proc.pid)
        while True:
            try:
                proc.wait(timeout=PIECE_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if gate is not None and gate.stopped():
                raise BuildStopped("the materializer was cancelled during the tree build")
            if gate is not None and gate.waiting():
                floor.idle()
                paused += _held(proc, gate, time.monotonic() - ran_since)
                ran_since = time.monotonic()
                floor.restart()
            else:
                floor.look()
        out = proc.stdout.read().decode(errors="replace").strip().splitlines()
    finally:
        if proc.returncode is None:  # stopped, or an error in this thread: the child must not outlive it
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    _raise_for(proc.returncode, out[-1] if out else "")
    return paused


def _held(proc: subprocess.Popen, gate: Gate, worked: float) -> float:
    """The child stopped for the gate's pause after ``worked`` seconds of its work; seconds it was held."""
    # (not reaped yet, so the pid is still the child's even if it has just exited)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        return gate.pause(worked)
    finally:
        os.kill(proc.pid, signal.SIGCONT)


class _Floor:
    """Whether the idle-priority child is starved, and its normal-priority pieces when it is (one thread)."""

    def __init__(self, pid: int) -> None:
        self.stat = f"/proc/{pid}/stat"
        self.pid = pid
        self._ticks = process_ticks
        self._tick_s = 1 / os.sysconf("SC_CLK_TCK")
        self.boosted_until: float | None = None
        self.restart()

    def _cpu_s(self) -> float | None:
        """The child's CPU seconds so far (None once it is gone)."""
        ticks = self._ticks(self.stat)
        return None if ticks is None else ticks * self._tick_s

    def restart(self) -> None:
        """Measure from now (after a hold at the gate, which is not starvation)."""
        self.since, self.cpu0 = time.monotonic(), self._cpu_s()

    def look(self) -> None:
        now = time.monotonic()
        if self.boosted_until is not None:
            if now >= self.boosted_until:
                self.idle()
                self.restart()
            return
        if now - self.since < STARVED_S:
            return
        cpu = self._cpu_s()
        starved = cpu is not None and self.cpu0 is not None and cpu - self.cpu0 < FLOOR_SHARE * (now - self.since)
        if starved and set_policy(self.pid, os.SCHED_OTHER):
            self.boosted_until = now + BOOST_S
        else:
            self.restart()

    def idle(self) -> None:
        if self.boosted_until is not None:
            set_policy(self.pid, os.SCHED_IDLE)
            self.boosted_until = None


def set_policy(pid: int, policy: int) -> bool:
    """Give ``pid`` a scheduling policy; False where it is gone or that is not permitted."""
    try:
        os.sched_setscheduler(pid, policy, os.sched_param(0))
        return True
    except (AttributeError, OSError):  # (gone, or not permitted: it stays where it is)
        return False


def _raise_for(status: int, line: str) -> None:
    try:
        result = json.loads(line) if line else {}
    except ValueError:
        result = {}
    if status == 0 and result.get("ok"):
        return
    if "errno" in result:
        raise OSError(result["errno"], result.get("error", "error"))
    if "corrupt" in result:
        raise CorruptObject(result["corrupt"])
    if "error" in result:
        raise OgrefsError(result["error"])
    how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
    raise OgrefsError(f"the tree build process {how}; its messages are in the mount's log")
