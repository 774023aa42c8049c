"""Background jobs in worker threads run niced: the loop and the application get the CPU first.

Besides the GETs, the mount's worker threads run jobs nobody waits on: the
materializer's batches (copies into the local tree, fsync) and its plan
pages, the plans of hints and of the streamed rest, the replay's trace
resolution, the page-cache pushes.  On a small box they compete for the
cores with the trio loop that answers the application's requests (in the
lab's hf trace run the loop thread waited ~2.8 s on the run queue,
``/proc/self/task/*/schedstat``, against 1.6 s on a bare mount).  Linux
gives each thread its own nice value, so such a job lowers its worker
thread's priority for its duration (:func:`run_niced`) and puts it back
after; the next job on that thread runs at the daemon's own priority.

The GETs themselves (read, decompressed, hashed: most of the workers' CPU)
are not niced, even a replay's: a reader whose chunk is in flight in a
replay's run waits for that run (single flight), and a niced run beside a
busy application would make that reader wait ten times as long.  (Tried:
niced replay GETs took the loop's run-queue wait from 2.8-3.0 s to
2.5-2.9 s per run, and the step's time did not move, medians 13.3 vs 13.7 s
with the trace, 14.6 vs 14.6 s with hints; not worth the inversion.)

Putting a thread's nice value back down needs ``CAP_SYS_NICE`` (or a
``RLIMIT_NICE`` that allows it): an unprivileged daemon could lower a
thread once and never raise it, and a reader's job would then run niced.
So the first call checks, in a throwaway thread, that this process may do
both; where it may not, background jobs run at the normal priority (said
once in the log) — as before, never worse.

Who owns what: the one answer of that check is set once under ``_lock``
and only read afterwards; each worker thread changes only its own nice
value, and always restores it before it returns.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, TypeVar

import trio

log = logging.getLogger(__name__)

#: How much lower a background job runs: at nice +10 the kernel gives a thread about a tenth of what a
#: nice-0 thread gets while both want the same core, and all the idle time nobody else wants.
BACKGROUND_NICE = 10

T = TypeVar("T")

_lock = threading.Lock()
_may: bool | None = None  # set once by may_renice()


def _renice_and_back(result: list[bool]) -> None:
    tid = threading.get_native_id()
    try:
        base = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, base + 1))
        os.setpriority(os.PRIO_PROCESS, tid, base)
        result.append(True)
    except OSError:
        pass


def may_renice() -> bool:
    """Whether this process may lower a thread's priority and raise it back (checked once, in a throwaway thread)."""
    global _may
    if _may is not None:  # every job asks: no lock once it is known
        return _may
    with _lock:
        if _may is None:
            result: list[bool] = []
            if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
                t = threading.Thread(target=_renice_and_back, args=(result,), name="ogrefs-renice-check")
                t.start()
                t.join()
            _may = bool(result)
            if not _may:
                log.info("background work runs at the daemon's own CPU priority: "
                         "this process may not raise a thread's priority back (no CAP_SYS_NICE)")
        return _may


def run_niced(fn: Callable[..., T], *args: Any) -> T:
    """In a worker thread: ``fn(*args)`` at BACKGROUND_NICE below the thread's priority, which is then restored."""
    if not may_renice():
        return fn(*args)
    tid = threading.get_native_id()
    base = os.getpriority(os.PRIO_PROCESS, tid)
    os.setpriority(os.PRIO_PROCESS, tid, min(19, base + BACKGROUND_NICE))
    try:
        return fn(*args)
    finally:
        os.setpriority(os.PRIO_PROCESS, tid, base)


async def to_background_thread(fn: Callable[..., T], *args: Any,
                               limiter: trio.CapacityLimiter | None = None) -> T:
    """``trio.to_thread.run_sync`` for background work: the job runs niced (:func:`run_niced`)."""
    return await trio.to_thread.run_sync(run_niced, fn, *args, limiter=limiter)
