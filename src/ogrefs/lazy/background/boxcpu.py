"""The box's CPU as background work sees it: the cores left idle, and the cores other processes take.

Background work of the mount (the streamed rest of a snapshot, the local
copy's tree build and passes) must take only what the application leaves
over, CPU as well as bandwidth (docs/mount.md, "Yielding to an active
application").  Requests to the mount say when an application reads; they
say nothing about an application that computes with its data in memory (a
training step), and on a small box every core a pass takes is a core the
step does not get.  Two readings of ``/proc/stat`` (Linux) tell:

* :class:`SpareCpu`: the box's idle cores, the daemon's own use counted as
  busy: the streamed rest starts another request only while some are idle,
  so it never takes more than is free.
* :class:`OthersCpu`: the cores every other process took (the box's busy
  time less the daemon's own, ``/proc/self/stat``): the materializer is
  paced while they leave it less than one core (half the box on a one-core
  box), so a step that computes on every core is not slowed by a pass
  writing beside it, and one that leaves a core idle does not slow the pass.

Both read the counters since their own last look, so each belongs to the one
trio task (or the one pacer) that asks it; neither is shared.  Without
``/proc`` both say "unknown" (``None``), and nothing waits on them.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import trio

from ogrefs.lazy.background.proctick import box_ticks, process_ticks

#: The streamed rest starts another request only while this many cores are idle.
SPARE_CPU_CORES = 0.5


class SpareCpu:
    """Idle CPU of the whole box since the last look, in cores (the module docstring).

    Background streaming paces itself with it: it starts another request only
    while at least ``min_cores`` are idle, so it takes what the application
    (and the store's server, when it shares the box) leaves over, like a
    ``nice`` process.  Without ``/proc/stat`` it never waits.  Owned by the
    trio task that paces with it.
    """

    def __init__(self, min_cores: float = SPARE_CPU_CORES, interval: float = 0.1,
                 path: str = "/proc/stat") -> None:
        self.min_cores = min_cores
        self.interval = interval
        self.path = path
        self.cores = os.cpu_count() or 1
        self._last = self._read()

    def _read(self) -> tuple[int, int] | None:
        now = box_ticks(self.path)
        return None if now is None else (now[0], now[1])

    def idle_cores(self) -> float | None:
        """Idle cores since the last look that saw time pass (0.0 until it has); None: no ``/proc/stat``."""
        now = self._read()
        if now is None:
            return None
        last = self._last
        if last is None or now[0] <= last[0]:
            self._last = last or now
            return 0.0
        self._last = now
        return self.cores * (now[1] - last[1]) / (now[0] - last[0])

    async def wait(self) -> None:
        """Return once the box has had ``min_cores`` idle over an interval (at once if that is unknown)."""
        self.idle_cores()
        while True:
            await trio.sleep(self.interval)
            idle = self.idle_cores()
            if idle is None or idle >= self.min_cores:
                return


class OthersCpu:
    """The cores other processes took since the last look, and whether they leave this one a core.

    :meth:`busy` is what the materializer's pacer asks
    (:mod:`ogrefs.lazy.background.materialize.pacing`; the tree build's child runs at idle priority instead): True while the other processes
    left less than ``spare`` cores (default: one, or half the box on a box of
    one core) over the last ``every`` seconds at least.  Asked more often, it
    answers what it last found: a few jiffies (10 ms each) are no reading.
    Owned by the one pacer that asks it (it keeps its last look).
    """

    def __init__(self, spare: float | None = None, every: float = 0.1, *, stat: str = "/proc/stat",
                 own: str = "/proc/self/stat", cores: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cores = cores or os.cpu_count() or 1
        self.spare = spare if spare is not None else min(1.0, self.cores / 2)
        self.every = every
        self._stat, self._own, self._clock = stat, own, clock
        self._last = self._look()
        self._at = clock()
        self._busy = False

    def _look(self) -> tuple[int, int, int] | None:
        box, own = box_ticks(self._stat), process_ticks(self._own)
        if box is None or own is None:
            return None
        return box[0], box[2], own

    def others_cores(self) -> float | None:
        """Cores the other processes took since the last look (0.0 if no time passed); None: no ``/proc``."""
        now = self._look()
        if now is None:
            return None
        last, self._last = self._last, now
        self._at = self._clock()
        if last is None or now[0] <= last[0]:
            return 0.0
        elapsed = (now[0] - last[0]) / self.cores  # ticks of one CPU
        others = (now[1] - last[1]) - (now[2] - last[2])
        return max(0.0, others / elapsed)

    def busy(self) -> bool:
        """Whether the other processes left less than ``spare`` cores (False when that is unknown)."""
        if self._clock() - self._at < self.every:
            return self._busy
        others = self.others_cores()
        self._busy = others is not None and self.cores - others < self.spare
        return self._busy
