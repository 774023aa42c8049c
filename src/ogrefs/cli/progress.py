"""A one-line live progress display on a TTY (stderr), silent otherwise.

The line follows restic's: ``[0:03] 45% 1234 files 1.2 GiB / 2.7 GiB ... ETA 0:04``.
:class:`WorkLine` is the same for work counted in items (packs of ``check
--read-data``, ``copy``, ``prune``): a live line on a terminal, and on any
stderr one final line when the work is done (restic prints its last bar).
The snapshot's total comes from a scan that runs beside it
(:func:`ogrefs.snapshot.dryrun.scan_in_background`); until that has finished,
the line says it is counting. ``ProgressLine`` is called from the thread that
does the work; the scanning thread only assigns ``total`` once (one reference).
"""

from __future__ import annotations

import sys
import threading
import time

from ogrefs.units import clock, human_bytes


def _eta(done: float, total: float, elapsed: float) -> str:
    if done <= 0 or total <= done:
        return "--:--"
    return clock(elapsed * (total - done) / done)


def _percent(done: float, total: float) -> str:
    return f"{min(100.0, 100.0 * done / total):3.0f}%" if total > 0 else "  -%"


class ProgressLine:
    def __init__(self, enabled: bool = True, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self._shown = False
        #: (files, bytes) the work will reach, once known (set by a scanning thread, read here)
        self.total: tuple[int, int] | None = None

    def _show(self, text: str) -> None:
        if not self.enabled:
            return
        self.stream.write("\r\x1b[K" + text[:150])
        self.stream.flush()
        self._shown = True

    def snapshot(self, s) -> None:
        self._show(snapshot_line(s, self.total, time.monotonic()))

    def restore(self, s) -> None:
        self._show(restore_line(s, time.monotonic()))

    def done(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def snapshot_line(s, total: tuple[int, int] | None, now: float) -> str:
    """``[0:03] 45% 1234 / 2800 files 1.2 GiB / 2.7 GiB, 300 MiB read at 34.0 MiB/s, 12.0 MiB new, ETA 0:04``.

    Percent and ETA count the bytes of the files seen, read or unchanged (an unchanged file is not read).
    """
    elapsed = max(1e-6, now - s.started)
    rate = (f"{human_bytes(s.read_bytes)} read at {human_bytes(s.read_bytes / elapsed)}/s, "
            f"{human_bytes(s.stored_bytes)} new")
    if total is None:
        return f"[{clock(elapsed)}] {s.files} files {human_bytes(s.bytes)}, {rate} (counting the total)"
    files, size = total
    return (f"[{clock(elapsed)}] {_percent(s.bytes, size)} {s.files} / {files} files "
            f"{human_bytes(s.bytes)} / {human_bytes(size)}, {rate}, ETA {_eta(s.bytes, size, elapsed)}")


def restore_line(s, now: float) -> str:
    """``[0:03] 45% 120 / 2144 files 230.0 MiB / 501.9 MiB, 40.0 MiB/s, ETA 0:04`` (files whose data is written)."""
    elapsed = max(1e-6, now - s.started)
    done = getattr(s, "files_done", None)  # files completely written, when the restorer counts them
    files = f"{done} / {s.files} files" if done is not None else f"{s.files} files"
    return (f"[{clock(elapsed)}] {_percent(s.written_bytes, s.total_bytes)} {files} "
            f"{human_bytes(s.written_bytes)} / {human_bytes(s.total_bytes)}, "
            f"{human_bytes(s.written_bytes / elapsed)}/s, ETA {_eta(s.written_bytes, s.total_bytes, elapsed)}")


class WorkLine(ProgressLine):
    """``[0:03] 45% 12 / 30 packs, 120.0 MiB / 300.0 MiB, 40.0 MiB/s, ETA 0:04`` for work counted in items.

    The work calls :meth:`grow` with what it has found to do (several times: copy counts each snapshot's
    packs when it comes to it) and :meth:`advance` with what is done; both may come from worker threads
    (``_lock`` guards the counts). ``wanted``: not --quiet, not --json; the live line needs a terminal, the
    final line of :meth:`done` does not.
    """

    def __init__(self, unit: str, enabled: bool = True, stream=None) -> None:
        super().__init__(enabled, stream)
        self.unit = unit
        self.wanted = enabled
        self.started = time.monotonic()
        self.items = self.items_total = self.bytes = self.bytes_total = 0
        self._lock = threading.Lock()
        self._drawn = 0.0

    def grow(self, items: int, nbytes: int = 0) -> None:
        with self._lock:
            self.items_total += items
            self.bytes_total += nbytes

    def advance(self, items: int = 1, nbytes: int = 0) -> None:
        with self._lock:
            self.items += items
            self.bytes += nbytes
            now = time.monotonic()
            if now - self._drawn < 0.1 and self.items < self.items_total:
                return  # a redraw ten times a second is enough
            self._drawn = now
            self._show(self.line(now))

    def line(self, now: float, final: bool = False) -> str:
        elapsed = max(1e-6, now - self.started)
        done, total = (self.bytes, self.bytes_total) if self.bytes_total else (self.items, self.items_total)
        eta = "" if final else f", ETA {_eta(done, total, elapsed)}"
        return (f"[{clock(elapsed)}] {_percent(done, total)} {self.items} / {self.items_total} {self.unit}, "
                f"{human_bytes(self.bytes)} / {human_bytes(self.bytes_total)}, "
                f"{human_bytes(self.bytes / elapsed)}/s{eta}")

    def done(self) -> None:
        super().done()
        if self.wanted and self.items_total:
            self.stream.write(self.line(time.monotonic(), final=True) + "\n")
            self.stream.flush()
