"""A wall-clock budget shared by every step of one capture."""

from __future__ import annotations

import time


class Deadline:
    """Seconds left until a fixed moment on the monotonic clock."""

    __slots__ = ("_end", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)
        self._end = time.monotonic() + self.seconds

    def remaining(self) -> float:
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self._end
