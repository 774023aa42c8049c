"""A one-line live progress display on a TTY (stderr), silent otherwise."""

from __future__ import annotations

import sys
import time


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _eta(done: float, total: float, elapsed: float) -> str:
    if done <= 0 or total <= done:
        return "--:--"
    secs = elapsed * (total - done) / done
    return f"{int(secs // 60):02d}:{int(secs % 60):02d}"


class ProgressLine:
    def __init__(self, enabled: bool = True, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self._shown = False

    def _show(self, text: str) -> None:
        if not self.enabled:
            return
        self.stream.write("\r\x1b[K" + text[:150])
        self.stream.flush()
        self._shown = True

    def snapshot(self, s) -> None:
        elapsed = max(1e-6, time.monotonic() - s.started)
        self._show(f"{s.files} files {s.dirs} dirs  {human_bytes(s.read_bytes)} read  "
                   f"{human_bytes(s.read_bytes / elapsed)}/s  {human_bytes(s.stored_bytes)} new  {elapsed:.0f}s")

    def restore(self, s) -> None:
        elapsed = max(1e-6, time.monotonic() - s.started)
        self._show(f"{s.files} files  {human_bytes(s.written_bytes)} / {human_bytes(s.total_bytes)}  "
                   f"{human_bytes(s.written_bytes / elapsed)}/s  ETA {_eta(s.written_bytes, s.total_bytes, elapsed)}")

    def done(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
