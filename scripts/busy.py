"""Unrelated work on the box during a benchmark run: a GPU box at resume is rarely idle.

    with Busy(["disk", "cache", "cpu"], workdir):   # each a separate process, killed on exit
        ...timed run...

Kinds (issue 17's list; each alone or together):

* ``disk``  -- a writer that writes 256 MB files with ``fsync`` after every
  16 MB, in a loop, on the same file system as the benchmark's state (what
  data-loader caches, logs and a second job's checkpoints do). This is the
  load that made the recorded trace lose to the hints.
* ``cache`` -- a page-cache hog: reads a file larger than a quarter of RAM
  over and over, so the kernel keeps evicting other pages.
* ``cpu``   -- one core of pure Python arithmetic.

The processes run in their own process group and are killed with it on
exit, also after errors; files they wrote are removed. The hog's file is
built once and kept in ``workdir`` (building it is not part of any run).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

KINDS = ("disk", "cache", "cpu")

_DISK = textwrap.dedent("""\
    import os, sys
    d = sys.argv[1]; piece = os.urandom(16 << 20); n = 0
    while True:
        path = os.path.join(d, f"busy-{n % 2}.bin"); n += 1
        with open(path, "wb") as f:
            for _ in range(16):
                f.write(piece); f.flush(); os.fsync(f.fileno())
    """)
_CACHE = textwrap.dedent("""\
    import sys
    while True:
        with open(sys.argv[1], "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass
    """)
_CPU = "x = 0\nwhile True:\n    x = (x * 1103515245 + 12345) % 2147483648\n"


def parse_kinds(text: str) -> list[str]:
    """``none``, ``all`` or a comma list of KINDS."""
    if text == "none":
        return []
    if text == "all":
        return list(KINDS)
    kinds = text.split(",")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise SystemExit(f"busy: unknown kind {bad[0]!r} (none, all, or a comma list of {', '.join(KINDS)})")
    return kinds


def _hog_file(workdir: Path) -> Path:
    path = workdir / "page-cache-hog.bin"
    want = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    if not path.exists() or path.stat().st_size < want:
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            piece = os.urandom(64 << 20)
            for _ in range(want // len(piece) + 1):
                f.write(piece)
        tmp.rename(path)
    return path


class Busy:
    """Start the given kinds of unrelated work; stop them on exit."""

    def __init__(self, kinds: list[str], workdir: Path) -> None:
        self.kinds = kinds
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> "Busy":
        self.workdir.mkdir(parents=True, exist_ok=True)
        scratch = self.workdir / "disk-writer"
        scratch.mkdir(exist_ok=True)
        programs = {"disk": [_DISK, str(scratch)], "cpu": [_CPU]}
        if "cache" in self.kinds:
            programs["cache"] = [_CACHE, str(_hog_file(self.workdir))]
        try:
            for kind in self.kinds:
                code, *args = programs[kind]
                self.procs.append(subprocess.Popen([sys.executable, "-c", code, *args], start_new_session=True,
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)
        self.procs.clear()
        for f in (self.workdir / "disk-writer").glob("busy-*.bin"):
            f.unlink(missing_ok=True)

    @property
    def label(self) -> str:
        return "+".join(self.kinds) or "quiet"
