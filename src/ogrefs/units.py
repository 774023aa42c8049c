"""Sizes and durations as people read them (``1.2 GiB``, ``0:03``); pure functions, used by every layer."""

from __future__ import annotations

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def clock(secs: float) -> str:
    """``0:03``, ``12:34``, ``1:02:03`` (restic's elapsed and ETA form)."""
    secs = int(max(0, secs))
    h, m, s = secs // 3600, secs // 60 % 60, secs % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
