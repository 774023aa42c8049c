"""Clock ticks from ``/proc``: the box's (``/proc/stat``) and one process's (``/proc/PID/stat``).

Pure reads with no state and no trio: :mod:`.boxcpu` (on the loop) and the
tree build's parent thread (:mod:`.materialize.buildproc`) both count with them.
"""

from __future__ import annotations


def box_ticks(path: str) -> tuple[int, int, int] | None:
    """(all, idle + iowait, busy) clock ticks summed over the box's CPUs, from ``/proc/stat``'s first line.

    Busy is user + nice + system + irq + softirq: what processes and the
    kernel on their behalf took (steal, a hypervisor's, is neither idle nor
    anybody's on this box)."""
    try:
        with open(path, "rb") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 7:
        return None
    return sum(fields[:8]), fields[3] + fields[4], fields[0] + fields[1] + fields[2] + fields[5] + fields[6]


def process_ticks(path: str) -> int | None:
    """A process's user + system clock ticks (all its threads), from its ``/proc/PID/stat``
    (``/proc/self/stat``: this one's); None when it cannot be read (gone, no ``/proc``)."""
    try:
        with open(path, "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None
