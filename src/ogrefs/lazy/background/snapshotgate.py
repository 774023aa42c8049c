"""While a snapshot of the box runs, the mount's background work waits: the snapshot comes first.

A box that runs from a writable mount is snapshotted from that mount, often
at the worst moment: a preemption notice 30 s to 2 min before the box is
gone, or the agent's first snapshot while the resume still streams the
environment in.  The daemon's hints, its background stream and the
materializer's passes then fetch, decode, verify and write on the same two
or eight cores, disk and store as the snapshot that must finish in time, and
what they bring in is of no use to a box about to go.  Measured on the loop
bench's box B (docs/benchmarks.md, issue 13): the daemon, still prefetching
its hints, used 2.1 s of CPU during B's first snapshot and none during the
next, and that first snapshot took 4.7-5.0 s against 3.1-3.5 s.

So a snapshot of the box leaves ``<state>/snapshot-running.<pid>``
(:func:`ogrefs.box.records.mark_snapshot_running`) for as long as it runs, and
:class:`SnapshotGate` looks for a live one every ``poll`` seconds.  While it
finds one:

* hint and background replays request nothing more (not even a probe of
  the disk cache: on a box resumed with a trace, the hint replay went on
  probing and loading cached chunks, 3-6 s of the daemon's CPU during the
  snapshot, although no request started);
* the fetcher starts no hint or background request
  (:meth:`~ogrefs.lazy.fetch.fetcher.Fetcher.yield_to_snapshot`); requests in
  flight finish.  Writes to the disk cache wait too: a hint replay that
  fetched a venv in seconds leaves thousands of chunk files to write behind
  it, and on box B that write-behind was the daemon's 2.1 s of CPU (its
  hints had all been fetched before the snapshot started).  An application's reads, and the replay of its recorded
  trace (what it reads next), go on: they serve the training that is still
  running, and their order is the mount's priorities' (docs/architecture.md);
* the materializer's passes and its tree build pause between batches
  (:class:`~ogrefs.lazy.background.materialize.pacing.Pacer` and ``BuildGate`` ask
  :attr:`~ogrefs.lazy.fetch.fetcher.Fetcher.yielding`).

A mark whose process is gone (killed, or a pid now another process's) is
ignored, so a snapshot that died never stops the mount's work.  A snapshot
in another pid namespace than the daemon's is not seen: the mount then works
on beside it, as before.

Who owns what: a SnapshotGate belongs to the trio loop.  Its :meth:`watch`
task alone sets the fetcher's flag and the gate's counters; the check
(``running``, a listing of the state directory) runs in a worker thread with
no argument and returns a bool.
"""

from __future__ import annotations

from typing import Any, Callable

import trio

from ogrefs.lazy.fetch.fetcher import Fetcher

#: How often the state directory is looked at: the delay before the mount yields to a snapshot.
POLL_S = 0.1


class SnapshotGate:
    """Holds the fetcher's background requests back while ``running()`` says a snapshot of the box runs."""

    def __init__(self, fetcher: Fetcher, running: Callable[[], bool], poll: float = POLL_S) -> None:
        self.fetcher = fetcher
        self.running = running
        self.poll = poll
        self.snapshots = 0  # snapshots yielded to
        self.yielded_s = 0.0  # seconds yielded, the current yield included once it ends
        self._since: float | None = None

    async def watch(self) -> None:
        """Until cancelled: follow ``running()`` and tell the fetcher (a yield ends with the task)."""
        try:
            while True:
                self._set(await trio.to_thread.run_sync(self.running))
                await trio.sleep(self.poll)
        finally:
            self._set(False)

    def _set(self, on: bool) -> None:
        if on == self.fetcher.yielding:
            return
        now = trio.current_time()
        if on:
            self.snapshots += 1
            self._since = now
        elif self._since is not None:
            self.yielded_s += now - self._since
            self._since = None
        self.fetcher.yield_to_snapshot(on)

    def stats(self) -> dict[str, Any]:
        """For the status file: whether the mount yields now, to how many snapshots so far, for how long."""
        current = trio.current_time() - self._since if self._since is not None else 0.0
        return {"yielding": self.fetcher.yielding, "snapshots": self.snapshots,
                "yielded_s": round(self.yielded_s + current, 2)}
