"""The page cache as the tests see it: util-linux ``fincore`` (mincore(2)), which goes through none of the
code under test, and pages dropped until it shows them gone.

``RWF_NOWAIT`` (what ogrefs uses to ask whether a read would wait) is the
kernel's IOCB_NOWAIT, not IOCB_NOIO: on a miss it starts readahead, and on a
fast disk that can finish inside the call, so one probe of a dropped page can
be answered as if it were cached.  A test of such a probe takes several, each
from a cache :func:`drop_pages` has shown empty, and asks that some refuse.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


def resident_bytes(path: Path) -> int:
    """How many of the file's bytes the page cache holds."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return int(out.split()[0])


def drop_pages(path: Path, tries: int = 20) -> None:
    """POSIX_FADV_DONTNEED until fincore shows none of the file cached (advice: a page in a per-CPU LRU
    batch or under writeback stays); skips the test, saying so, if the kernel keeps them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        for _ in range(tries):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if resident_bytes(path) == 0:
                return
    finally:
        os.close(fd)
    pytest.skip(f"the kernel kept {path.name}'s pages after {tries} POSIX_FADV_DONTNEED calls")
