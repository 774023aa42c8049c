"""Notice new coherent training checkpoints in the run directories a snapshot found.

:meth:`CheckpointWatch.scan` is called periodically by the agent's watch
thread.  It lists the checkpoint candidates below each watched run directory
(the walk's own filter, :func:`~ogrefs.inspect.checkpoints.is_candidate_name`,
three levels deep) with their sizes and modification times.  While that
listing keeps changing nothing is judged: a checkpoint being written is never
examined.  Once it has stayed the same for ``quiet_s`` (complete and quiet),
the candidates are judged by the same code as a snapshot's environment
(:func:`~ogrefs.inspect.checkpoints.analyze_checkpoints`), and the run's
*latest coherent* checkpoint (the one its framework would resume from, when
that is coherent) is returned when it is new: more advanced than the last one
reported (per run: step, then epoch), or another checkpoint written after it
(a run restarted in the same directory saves a lower step later, and that is
what it resumes from).  A torn or incomplete checkpoint is never returned; a
later one that completes it is.

Owned by one thread (the agent's watch thread); no locks.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ogrefs.inspect.deadline import Deadline
from ogrefs.inspect.checkpoints import analyze_checkpoints, is_candidate_name

MAX_DEPTH = 3
JUDGE_DEADLINE_S = 20.0


@dataclass(frozen=True)
class Checkpoint:
    run: str
    step: int | None
    epoch: float | None
    path: str

    def key(self) -> tuple:
        return (self.step if self.step is not None else -1, self.epoch if self.epoch is not None else -1)

    def tag(self) -> str:
        where = f"step-{self.step}" if self.step is not None else f"epoch-{self.epoch:g}" if self.epoch is not None \
            else "weights"
        return f"checkpoint:{os.path.basename(self.run.rstrip('/')) or '/'}@{where}"

    def as_dict(self) -> dict:
        return {"run": self.run, "step": self.step, "epoch": self.epoch, "path": self.path}


def run_dirs_of(manifest: dict | None) -> list[str]:
    """The checkpoint run directories a snapshot's environment capture found."""
    env = (manifest or {}).get("environment") or {}
    runs = ((env.get("checkpoints") or {}).get("runs")) or []
    return sorted({r["dir"] for r in runs if isinstance(r, dict) and isinstance(r.get("dir"), str)})


def _candidates(root: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    stack = [(root, 0)]
    while stack:
        d, depth = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        names = []
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                if depth < MAX_DEPTH:
                    stack.append((e.path, depth + 1))
            elif is_candidate_name(os.fsencode(e.name)):
                names.append(e.name)
        if names:
            out[d] = sorted(names)
    return out


def _signature(cands: dict[str, list[str]]) -> tuple:
    sig = []
    for d in sorted(cands):
        for n in cands[d]:
            try:
                st = os.lstat(os.path.join(d, n))
            except OSError:
                continue
            sig.append((d, n, st.st_size, st.st_mtime_ns))
    return tuple(sig)


class CheckpointWatch:
    def __init__(self, dirs: list[str], quiet_s: float = 5.0) -> None:
        self.dirs = sorted(set(dirs))
        self.quiet_s = quiet_s
        self._sig: tuple | None = None
        self._since = 0.0
        self._judged: tuple | None = None
        self.reported: dict[str, tuple] = {}  # run -> progress key of the last checkpoint reported
        self._reported_at: dict[str, tuple[str, float]] = {}  # run -> (path, mtime) of the last one reported
        self.last_verdict: dict | None = None  # what the last judgement saw (for --json events)
        self.judged_now = False  # the last scan judged the candidates

    def set_dirs(self, dirs: list[str]) -> None:
        self.dirs = sorted(set(self.dirs) | set(dirs))

    def baseline(self, ck: Checkpoint | None) -> None:
        """A checkpoint already in a snapshot: only one more advanced than it is new."""
        if ck is not None:
            self.reported[ck.run] = max(self.reported.get(ck.run, (-2, -2)), ck.key())
            self._reported_at[ck.run] = (ck.path, _newest_mtime(ck.path))

    def scan(self, now: float | None = None) -> Checkpoint | None:
        """A new coherent checkpoint, once the candidates have been quiet for ``quiet_s``; else None."""
        now = time.monotonic() if now is None else now
        self.judged_now = False
        cands: dict[str, list[str]] = {}
        for d in self.dirs:
            cands.update(_candidates(d))
        sig = _signature(cands)
        if sig != self._sig:
            self._sig, self._since = sig, now
            return None
        if now - self._since < self.quiet_s or sig == self._judged:
            return None
        self._judged = sig
        self.judged_now = True
        section, _hints, _notes = analyze_checkpoints(cands, Deadline(JUDGE_DEADLINE_S))
        found, found_mtime = None, 0.0
        for run in section.get("runs", []):
            best = next((c for c in run["checkpoints"] if c["id"] == run.get("latest_coherent")), None)
            if best is None:
                continue
            ck = Checkpoint(run["dir"], best.get("step"), best.get("epoch"), best.get("path"))
            if self._is_new(ck, best.get("mtime") or 0.0) and (found is None or ck.key() > found.key()):
                found, found_mtime = ck, best.get("mtime") or 0.0
        self.last_verdict = {"candidates": sum(len(v) for v in cands.values()),
                             "incomplete": [i["path"] for i in section.get("incomplete", [])],
                             "new": found.as_dict() if found else None}
        if found is not None:
            self.reported[found.run] = found.key()
            self._reported_at[found.run] = (found.path, found_mtime)
        return found

    def _is_new(self, ck: Checkpoint, mtime: float) -> bool:
        """More advanced than the run's last reported checkpoint, or another one written after it (a restart)."""
        if ck.key() > self.reported.get(ck.run, (-2, -2)):
            return True
        path, at = self._reported_at.get(ck.run, (None, None))
        return path is not None and path != ck.path and at is not None and mtime > at


def _newest_mtime(path: str) -> float | None:
    """The newest modification time of a checkpoint file, or of the files of a checkpoint directory."""
    try:
        if not os.path.isdir(path):
            return os.stat(path).st_mtime
        return max((e.stat().st_mtime for e in os.scandir(path) if e.is_file()), default=None)
    except OSError:
        return None
