"""While an application is using the mount, materialization takes a bounded share of the time.

Writing the tree is a worker thread's pwrite and fdatasync and the loop's
bookkeeping around every batch; the chunks it writes were fetched and
decoded in worker threads.  All of that shares the daemon's GIL, the trio
loop that answers every FUSE request, the disk and, on a small box, the
cores with the application.  The materializer waits for the application to
settle before it starts (:meth:`ogrefs.lazy.background.prefetch.Prefetch._settle`), but
the application does not stay settled: the second training step, an
evaluation, a data loader opening the next shard come back to the mount
while a pass writes gigabytes.  Measured on two cores (docs/benchmarks.md,
"The warm step and the materializer"): a step whose data was in memory took
1.6-1.8x its time from local disk when a pass started writing under it,
1.1x when none did.

So, after each batch a pass writes while the application is active (it sent
the mount a request within ``active_s``), the pass waits until the batch's
time is ``share`` of the time since the previous batch began: a batch of
``d`` seconds is followed by ``d * (1 - share) / share`` seconds, at most
``max_pause``, cut short as soon as the application has been quiet for
``active_s``.  An application that computes without asking the mount
anything (a training loop with its data in the page cache) does not slow the
pass down at all, and a pass never stops: under an application that never
goes quiet it still writes at ``share`` of its speed.

The tree build that comes before the first pass (:mod:`.build`: a directory,
a sparse file and a plan row per entry, 2-6 s of CPU on the benchmark
boxes) runs in a child process at the scheduler's idle priority
(:mod:`.buildproc`), and yields the same way through a :class:`BuildGate`:
the preparation's thread looks at the gate every piece of the child's work
and, while the application is active, holds the child stopped until its
work is ``share`` of the time.  The same gate stops the build when the
materializer is cancelled (the child is killed): the daemon of a mount that
went away exits at once.

An application that computes without asking the mount anything is not
seen by its requests, and on a small box a pass beside a job that computes
on every core takes a core from it (measured on two cores: a job of matrix
products started 2 s after a mount came up took 3.4-4.7x its time alone
while the mount's background work ran beside it; 1.6x once the CPU counted,
docs/benchmarks.md).  So a pass also counts the application as active while
the box's other processes leave this one less than a core (``busy``:
:meth:`ogrefs.lazy.background.boxcpu.OthersCpu.busy`); it then takes ``share`` of the
time as above, and a step that leaves a core idle does not slow it down.
The build's gate has no ``busy``: the kernel already gives its idle-priority
child only the cores nobody else wants (and the child's own CPU would count
as the box's other processes).

Both also stop while a snapshot of the box runs (``hold``: the fetcher's
:attr:`~ogrefs.lazy.fetch.fetcher.Fetcher.yielding`, set by
:class:`~ogrefs.lazy.background.snapshotgate.SnapshotGate`): a pass waits after its
batch until the snapshot ends, however long, and the build pauses as it does
for an active application.

Who owns what: a :class:`Pacer` belongs to the trio loop; the pass's writer
task calls :meth:`Pacer.after` and nothing else touches it.  ``idle_for`` is
the vfs's (seconds since the application's last request), read on the loop
only; ``busy`` is the pacer's or the gate's own (an OthersCpu keeps its last
look), called on the loop only.  A :class:`BuildGate`'s events are set and cleared by its
:meth:`BuildGate.watch` task on the loop alone; the preparation's worker
thread only reads them (:meth:`BuildGate.waiting`, :meth:`BuildGate.stopped`)
and waits on them (:meth:`BuildGate.pause`, a ``threading.Event``) while it
holds the child, and counts those pauses, which it returns with its result.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import trio

#: While the application is active, materialization takes this share of the time ...
ACTIVE_SHARE = 0.25
#: ... an application is active when its last request to the mount is this recent ...
ACTIVE_S = 0.5
#: ... and no pause is longer than this.
MAX_PAUSE_S = 2.0


class _Yielding:
    """What a pass's pacer and the build's gate share: their settings and when the application is active."""

    def __init__(self, idle_for: Callable[[], float] | None, share: float = ACTIVE_SHARE,
                 active_s: float = ACTIVE_S, max_pause: float = MAX_PAUSE_S, poll: float = 0.05,
                 hold: Callable[[], bool] | None = None, busy: Callable[[], bool] | None = None) -> None:
        if not 0 < share <= 1:
            raise ValueError("share must be in (0, 1]")
        self.idle_for = idle_for
        self.busy = busy  # True while the box's other processes leave this one less than a core
        self.share = share
        self.active_s = active_s
        self.max_pause = max_pause
        self.poll = poll
        self.hold = hold  # True while a snapshot of the box runs

    def active(self) -> bool:
        """Whether the application asked the mount for something within ``active_s``, or computes
        on the cores this process would need (``busy``)."""
        return ((self.idle_for is not None and self.idle_for() < self.active_s)
                or (self.busy is not None and self.busy()))


class Pacer(_Yielding):
    """The pause after each batch of a pass; see the module docstring.  ``hold``: wait for the snapshot's end."""

    def __init__(self, idle_for: Callable[[], float] | None, **kw: Any) -> None:
        super().__init__(idle_for, **kw)
        self.paused_s = 0.0  # seconds paused so far (status, tests)
        self.pauses = 0

    async def after(self, took: float) -> None:
        """Called after a batch that took ``took`` seconds: pause while the application is active
        (and, with ``hold``, for as long as a snapshot of the box runs)."""
        if self.hold is not None and self.hold():
            start = trio.current_time()
            self.pauses += 1
            try:
                while self.hold():
                    await trio.sleep(self.poll)
            finally:
                self.paused_s += trio.current_time() - start
        if took <= 0 or not self.active():
            return
        start = trio.current_time()
        deadline = start + min(self.max_pause, took * (1 - self.share) / self.share)
        self.pauses += 1
        try:
            while (now := trio.current_time()) < deadline and self.active():
                await trio.sleep(min(self.poll, deadline - now))
        finally:
            self.paused_s += trio.current_time() - start


class BuildGate(_Yielding):
    """The tree build's pause between pieces of its work while the application is active (module docstring).
    ``hold``: pause as for an active application."""

    def __init__(self, idle_for: Callable[[], float] | None, **kw: Any) -> None:
        super().__init__(idle_for, **kw)
        self._quiet = threading.Event()
        self._quiet.set()  # until watch() says otherwise: a build without a watcher never waits
        self._stop = threading.Event()  # set when the watch ends: the build stops at its next piece

    async def watch(self) -> None:
        """On the loop, for as long as the build runs: tell the build whether to wait, and when it ends
        (cancelled: the materializer's run is cancelled, or the build returned) that it must stop.

        A worker thread cannot be cancelled; without this, a daemon whose mount
        went away (a lazy unmount's last user gone, SIGTERM) waited for the
        whole tree build of a box before it could exit, and a remount of the
        same state directory was refused meanwhile."""
        self._stop.clear()
        try:
            if self.idle_for is None and self.hold is None and self.busy is None:
                await trio.sleep_forever()
            while True:
                if self.active() or (self.hold is not None and self.hold()):
                    self._quiet.clear()
                else:
                    self._quiet.set()
                await trio.sleep(self.poll)
        finally:
            self._stop.set()
            self._quiet.set()  # nothing waits on a gate nobody watches

    def stopped(self) -> bool:
        """Worker thread: whether the build must stop now (its watch ended)."""
        return self._stop.is_set()

    def waiting(self) -> bool:
        """Worker thread: whether the build should be held now (the application is active, a snapshot runs)."""
        return not self._quiet.is_set()

    def pause(self, worked: float) -> float:
        """Worker thread, after ``worked`` seconds of work: wait while the application is active; seconds waited."""
        if worked <= 0 or self._quiet.is_set():
            return 0.0
        start = time.monotonic()
        self._quiet.wait(min(self.max_pause, worked * (1 - self.share) / self.share))
        return time.monotonic() - start
