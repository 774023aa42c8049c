"""``ogrefs snapshot --dry-run``: what a snapshot would hold, by the same walk rules, writing nothing.

Walks the paths as the snapshot would (the same WalkRules: excludes, marker
files, mount points), counting entries and bytes; it reads no file data and
opens no repository object for writing. Runs in the calling thread; :func:`scan_in_background` runs it in a daemon thread
for the progress line's total (the thread owns its DryRun and hands over only the final pair).
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass, field
from typing import Callable

from ogrefs.snapshot.walk import WalkRules


@dataclass
class DryRun:
    files: int = 0
    dirs: int = 0
    others: int = 0
    bytes: int = 0
    not_descended: list[dict[str, str]] = field(default_factory=list)
    unreadable: list[dict[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"dry_run": True, **self.__dict__}


def dry_run(roots: list[bytes], rules: WalkRules, skip: set[bytes]) -> DryRun:
    out = DryRun()
    root_set = set(roots)
    for root in roots:
        stack = [root]
        root_dev = None
        while stack:
            path = stack.pop()
            if rules.excluded(path) or os.path.normpath(path) in skip:
                continue
            try:
                st = os.lstat(path)
            except OSError as exc:
                out.unreadable.append({"path": os.fsdecode(path), "error": exc.strerror or str(exc)})
                continue
            root_dev = st.st_dev if root_dev is None else root_dev
            if stat.S_ISDIR(st.st_mode):
                out.dirs += 1
                why = rules.not_descended(path, is_root=path in root_set, dev=st.st_dev, root_dev=root_dev)
                if why is not None:
                    out.not_descended.append(why)
                    continue
                try:
                    stack.extend(os.path.join(path, n) for n in sorted(os.listdir(path), reverse=True))
                except OSError as exc:
                    out.unreadable.append({"path": os.fsdecode(path), "error": exc.strerror or str(exc)})
            elif stat.S_ISREG(st.st_mode):
                out.files += 1
                out.bytes += st.st_size
            else:
                out.others += 1
    return out


def scan_in_background(roots: list[bytes], rules: WalkRules, skip: set[bytes],
                       done: Callable[[tuple[int, int]], None]) -> threading.Thread:
    """Count (files, bytes) in a daemon thread and call ``done`` with them (for a progress total)."""
    def scan() -> None:
        result = dry_run(roots, rules, skip)
        done((result.files, result.bytes))

    t = threading.Thread(target=scan, name="ogrefs-total-scan", daemon=True)
    t.start()
    return t
