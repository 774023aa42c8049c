"""Where the daemon's loop spends its time, per FUSE operation, and how long its threads wait for a core.

Switched on with ``OGREFS_PROFILE_LOOP=1`` in the environment of ``ogrefs
mount``; ``ogrefs status --json`` then shows ``loop_profile``:

* ``steps``: for each FUSE operation (and ``other`` for the loop's own
  tasks: replay, deliveries, the status writer), the trio task steps that
  served it: their count, wall time, thread CPU time and the longest. A
  step's wall time above its CPU time is time the loop held a request and
  did not run: it waited for the GIL or for a core.
* ``wakeup_late_ms``: how late a task that sleeps 2 ms again and again
  wakes (median, p90, p99 as the upper bound of their bucket in a 1-2-5
  series, and the worst): how long a request that arrives finds the loop
  busy.
* ``threads``: for the loop's thread and for the worker threads together,
  CPU seconds and seconds runnable but waiting for a core, from
  ``/proc/self/task/*/schedstat`` since each started (threads that have
  ended are not counted).

The docs/benchmarks.md section "Inside the daemon during a lazy run" was
measured with this (first as an ad-hoc copy): the loop's steps took two to
three times their CPU time in a lazy run, a shorter GIL switch interval
changed nothing, and the loop waited 2.8-3.0 s for a core: the cores, not
the GIL.  Off by default: two clock reads per task step (a few per cent of
the loop's CPU) and a wake-up every 2 ms.

Who owns what: everything here belongs to the daemon's trio loop (the
instrument's hooks run on it, the FUSE adapter names the operation on it);
no thread touches it.  ``/proc`` is read when the status is written.
"""

from __future__ import annotations

import bisect
import os
import time
from pathlib import Path
from typing import Any

import trio

ENV = "OGREFS_PROFILE_LOOP"
WAKEUP_PERIOD = 0.002
#: the wake-up histogram's upper bounds in seconds, 50 us to 1 s in a 1-2-5 series (later: the last bucket)
LATE_BOUNDS = tuple(m * 10.0 ** e for e in range(-5, 0) for m in (1, 2, 5))[2:] + (1.0,)


def enabled(env: dict[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(ENV, "") not in ("", "0")


class _Steps:
    __slots__ = ("count", "wall", "cpu", "longest")

    def __init__(self) -> None:
        self.count = 0
        self.wall = 0.0
        self.cpu = 0.0
        self.longest = 0.0


class LoopProfile(trio.abc.Instrument):
    """A trio instrument: every task step timed (wall and thread CPU) and charged to the operation it served."""

    def __init__(self) -> None:
        self._op = "other"
        #: when the running step began (wall, CPU); None between steps, and during the step that added the
        #: instrument, whose beginning it never saw
        self._started: tuple[float, float] | None = None
        self.steps: dict[str, _Steps] = {}
        self.late = [0] * (len(LATE_BOUNDS) + 1)  # wake-ups per bucket of lateness (the last: later than 1 s)
        self.latest = 0.0

    # -- the instrument (on the loop) --------------------------------------------------------------------
    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._op = "other"
        self._started = (time.perf_counter(), time.thread_time())

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._started is None:
            return
        wall = time.perf_counter() - self._started[0]
        cpu = time.thread_time() - self._started[1]
        self._started = None
        s = self.steps.get(self._op)
        if s is None:
            s = self.steps[self._op] = _Steps()
        s.count += 1
        s.wall += wall
        s.cpu += cpu
        if wall > s.longest:
            s.longest = wall

    def serving(self, op: str) -> None:
        """The FUSE adapter: the step now running serves ``op`` (lookup, read, ...)."""
        self._op = op

    async def sample_wakeups(self) -> None:
        """Sleep WAKEUP_PERIOD again and again and keep how late each wake-up was (a task in the nursery)."""
        while True:
            t = time.perf_counter()
            await trio.sleep(WAKEUP_PERIOD)
            late = time.perf_counter() - t - WAKEUP_PERIOD
            self.late[bisect.bisect_left(LATE_BOUNDS, late)] += 1
            self.latest = max(self.latest, late)

    # -- the report (on the loop, for the status file) ---------------------------------------------------
    def report(self, proc: Path = Path("/proc/self/task")) -> dict[str, Any]:
        return {"steps": {op: {"count": s.count, "wall_s": round(s.wall, 3), "cpu_s": round(s.cpu, 3),
                               "longest_ms": round(s.longest * 1e3, 2)}
                          for op, s in sorted(self.steps.items())},
                "wakeup_late_ms": _quantiles(self.late, self.latest),
                "threads": thread_times(proc)}


def _quantiles(counts: list[int], worst: float) -> dict[str, float] | None:
    """Median, p90 and p99 of a LATE_BOUNDS histogram, each as its bucket's upper bound, in ms."""
    n = sum(counts)
    if not n:
        return None
    out: dict[str, float] = {"samples": n}
    for name, q in (("median", 0.5), ("p90", 0.9), ("p99", 0.99)):
        seen = 0
        for i, c in enumerate(counts):
            seen += c
            if seen >= q * n:
                out[name] = round((LATE_BOUNDS[i] if i < len(LATE_BOUNDS) else worst) * 1e3, 3)
                break
    out["worst"] = round(worst * 1e3, 3)
    return out


def thread_times(proc: Path = Path("/proc/self/task")) -> dict[str, dict[str, float]]:
    """CPU and run-queue seconds of this process's live threads: the loop's (the main thread) and the rest's."""
    out: dict[str, dict[str, float]] = {}
    main = str(os.getpid())
    try:
        tasks = list(proc.iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            cpu_ns, wait_ns, _slices = (int(x) for x in (task / "schedstat").read_text().split())
        except (OSError, ValueError):
            continue  # ended meanwhile, or no schedstat (a kernel without it)
        kind = "loop" if task.name == main else "workers"
        t = out.setdefault(kind, {"threads": 0, "cpu_s": 0.0, "waiting_for_a_core_s": 0.0})
        t["threads"] += 1
        t["cpu_s"] = round(t["cpu_s"] + cpu_ns / 1e9, 3)
        t["waiting_for_a_core_s"] = round(t["waiting_for_a_core_s"] + wait_ns / 1e9, 3)
    return out

