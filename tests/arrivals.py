"""A fake of the no-FUSE daemon for ogrefs.supervise: files that arrive only when asked for, after a delay.

``Arrivals(root, files)`` holds a snapshot in memory (relative path -> bytes,
a trailing ``/`` for a directory, ``("link", target)`` for a symlink,
``("exec", bytes)`` for an executable); nothing of it is on disk until
``ensure`` writes it. ``needs`` answers from a set under a lock, as the real
daemon's would; ``ensure`` sleeps ``delay`` first (so that a job that did not
wait would find nothing), then writes the path as the real one does:
parents created, a file under a temporary name renamed once complete, a
directory made, and complete (no longer needed) once every entry of it is
there by name (``whole``). ``asked`` lists the calls, `` (whole)`` marked.

Run as a program it is the driver of a supervised job in another process
(a container without CAP_SYS_ADMIN): ``python -m tests.arrivals SPEC.json -- CMD...``.
"""

from __future__ import annotations

import json
import os
import posixpath
import sys
import threading
import time
from pathlib import Path


class Arrivals:
    def __init__(self, root: Path, files: dict, delay: float = 0.2, fail: set[str] | None = None,
                 hold: threading.Event | None = None):
        self.root = str(root)
        self.entries = {posixpath.join(self.root, k.rstrip("/")): (("dir", None) if k.endswith("/") else
                                                                    v if isinstance(v, tuple) else ("file", v))
                        for k, v in files.items()}
        for path in list(self.entries):
            parent = posixpath.dirname(path)
            while parent != self.root and parent not in self.entries:
                self.entries[parent] = ("dir", None)
                parent = posixpath.dirname(parent)
        self.delay, self.fail, self.hold = delay, fail or set(), hold
        self.asked: list[str] = []
        self.needs_calls = 0
        self._lock = threading.Lock()
        self._pending = set(self.entries)

    def needs(self, path: str) -> bool:
        with self._lock:
            self.needs_calls += 1
            return path in self._pending

    def ensure(self, path: str, whole: bool) -> None:
        with self._lock:
            self.asked.append(path if not whole else path + " (whole)")
        if path in self.fail:
            raise OSError(5, "the store said no")
        if self.hold is not None and not self.hold.wait(60):
            raise TimeoutError("held for 60 s")
        time.sleep(self.delay)
        with self._lock:
            is_dir = self.entries[path][0] == "dir"
            if is_dir and whole:
                for child in [p for p in self.entries if posixpath.dirname(p) == path]:
                    self._write(child, mark=self.entries[child][0] != "dir")
            self._write(path, mark=not is_dir or whole)

    def _write(self, path: str, mark: bool) -> None:
        kind, data = self.entries[path]
        os.makedirs(posixpath.dirname(path), exist_ok=True)
        if kind == "dir":
            os.makedirs(path, exist_ok=True)
        elif kind == "link" and not os.path.lexists(path):
            os.symlink(data, path)
        elif kind in ("file", "exec") and path in self._pending:  # over an older copy (the image's) too
            tmp = path + ".ogrefs-tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o755 if kind == "exec" else 0o644)
            os.rename(tmp, path)
        if mark:
            self._pending.discard(path)


def main() -> int:
    from ogrefs.supervise.supervisor import supervise
    spec = json.loads(Path(sys.argv[1]).read_text())
    files = {k: (tuple(v) if isinstance(v, list) else v.encode()) for k, v in spec["files"].items()}
    files = {k: (v[0], v[1].encode()) if isinstance(v, tuple) and v[0] == "exec" else v for k, v in files.items()}
    arrivals = Arrivals(Path(spec["root"]), files)
    code = supervise(sys.argv[3:], None, arrivals.needs, arrivals.ensure)
    Path(spec["asked"]).write_text(json.dumps(arrivals.asked))
    return code


if __name__ == "__main__":
    sys.exit(main())
