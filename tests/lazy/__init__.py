"""Tier 3: the lazy engine (fetcher, vfs, traces, materializer) driven directly with trio; no kernel mount."""

from __future__ import annotations

import subprocess
from pathlib import Path


def resident_bytes(path: Path) -> int:
    """How many of the file's bytes the page cache holds, by util-linux ``fincore`` (mincore(2)): a view of
    the cache that goes through none of the code under test."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return int(out.split()[0])
