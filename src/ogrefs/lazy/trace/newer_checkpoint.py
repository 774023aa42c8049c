"""A trace that read a stale training checkpoint replays the mounted snapshot's newest coherent one instead.

The spot loop: box A trains and loads ``checkpoint-100``; its mount records
that.  Box B resumes, trains on and writes ``checkpoint-200``; its snapshot
has no trace of its own yet, so box C, resuming from B's snapshot, replays
A's trace (the newest trace of an older snapshot of the same paths,
:func:`ogrefs.repo.traces.find_trace`).  Replayed as recorded, that fetches
all of ``checkpoint-100`` first — hundreds of megabytes C never reads, in
front of what it does read — and ``checkpoint-200`` only when C asks for it.

So, before a trace is replayed: an entry whose file belongs to a checkpoint
of a run (as the environment capture of the trace's snapshot or of the
mounted one found it: ``environment.checkpoints.runs``), when the mounted
snapshot's newest coherent checkpoint of that run is more advanced (step,
then epoch, then modification time, as :mod:`ogrefs.inspect.checkpoints`
orders them), becomes a read of the *corresponding file* of that newest
checkpoint.  Files correspond by their path inside the checkpoint with the
checkpoint's own step number written as ``#`` (``checkpoint-100/optimizer.pt``
↔ ``checkpoint-200/optimizer.pt``, ``model_step100.pt`` ↔ ``model_step200.pt``).
A stale file with no counterpart is dropped: nothing of a stale checkpoint is
replayed.

The newer file's chunks lie elsewhere than the stale one's (content-defined
boundaries), so offsets are not copied: a traced read at offset ``o`` of the
stale file becomes the newer file's chunks from where the last one left off
up to the one holding ``o`` (a loader reads a prefix), and when the trace read
the stale file to its end (its last chunk), the newer file's last entry takes
it to *its* end (the stale file's chunks tell where its last one starts, when
the mounted snapshot still holds it; else any read within the largest chunk
size of its end counts).  Entries name the newer file's chunk offsets exactly, so
they resolve to exactly its chunks, in the trace's order among the other
files' reads.

Pure functions of the manifests and the entries, for any thread.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ogrefs.repo.catalog import MAX_CHUNK
from ogrefs.repo.traces import Entry

log = logging.getLogger(__name__)

Manifest = dict[str, Any]
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a run, as an environment capture recorded it."""

    id: str
    run: str
    path: str
    progress: tuple  # the order of inspect.checkpoints: (has a progress point, step, epoch, mtime)
    numbers: frozenset[int]  # the step (and whole epoch) its file names may carry
    sizes: dict[str, int]  # file path -> size

    def role(self, file: str) -> str:
        """What a file is within its checkpoint: its path there, with the checkpoint's own number as ``#``."""
        prefix = self.path.rstrip("/") + "/"
        rel = file[len(prefix):] if file.startswith(prefix) else os.path.basename(file)
        return _DIGITS.sub(lambda m: "#" if int(m.group()) in self.numbers else m.group(), rel)


def _checkpoint(run: str, ck: dict) -> Checkpoint | None:
    step, epoch = ck.get("step"), ck.get("epoch")
    step = step if type(step) is int else None
    epoch = epoch if isinstance(epoch, (int, float)) and not isinstance(epoch, bool) and math.isfinite(epoch) else None
    mtime = ck.get("mtime") if isinstance(ck.get("mtime"), (int, float)) and math.isfinite(ck["mtime"]) else 0.0
    listed = ck.get("files") if isinstance(ck.get("files"), list) else []
    files = {f["path"]: f.get("size") if type(f.get("size")) is int else -1
             for f in listed if isinstance(f, dict) and isinstance(f.get("path"), str)}
    if not isinstance(ck.get("id"), str) or not isinstance(ck.get("path"), str) or not files:
        return None
    whole_epoch = int(epoch) if epoch is not None and math.isfinite(epoch) and epoch == int(epoch) else None
    numbers = {n for n in (step, whole_epoch) if n is not None}
    progress = (step is not None or epoch is not None, -1 if step is None else step, -1 if epoch is None else epoch,
                mtime)
    return Checkpoint(ck["id"], run, ck["path"], progress, frozenset(numbers), files)


def _runs(manifest: Manifest | None) -> Iterable[tuple[dict, list[tuple[dict, Checkpoint]]]]:
    """(run section, [(checkpoint section, Checkpoint)]) of each run a manifest's capture found."""
    env = (manifest or {}).get("environment")
    section = env.get("checkpoints") if isinstance(env, dict) else None
    runs = section.get("runs") if isinstance(section, dict) else None
    for run in runs if isinstance(runs, list) else []:
        if not isinstance(run, dict) or not isinstance(run.get("dir"), str):
            continue
        cks = run.get("checkpoints") if isinstance(run.get("checkpoints"), list) else []
        yield run, [(ck, c) for ck in cks if isinstance(ck, dict) and (c := _checkpoint(run["dir"], ck)) is not None]


def checkpoint_files(*manifests: Manifest | None) -> dict[bytes, Checkpoint]:
    """Every file of every checkpoint the manifests' captures found -> its checkpoint (later manifests win)."""
    out: dict[bytes, Checkpoint] = {}
    for m in manifests:
        for _run, cks in _runs(m):
            for _ck, c in cks:
                out.update((os.fsencode(f), c) for f in c.sizes)
    return out


def newest_coherent(manifest: Manifest) -> dict[str, Checkpoint]:
    """Run directory -> the newest coherent checkpoint of that run in ``manifest``."""
    out: dict[str, Checkpoint] = {}
    for run, cks in _runs(manifest):
        best = next((c for ck, c in cks if c.id == run.get("latest_coherent") and ck.get("coherent") is True), None)
        if best is not None:
            out[run["dir"]] = best
    return out


@dataclass(frozen=True)
class _Swap:
    new: bytes | None  # the newer checkpoint's corresponding file; None: no counterpart, dropped
    old_size: int  # -1: unknown
    what: tuple[str, str, str]  # (stale checkpoint, newest coherent checkpoint, run), for the log


def _swaps(paths: Iterable[bytes], mounted: Manifest, recorded_on: Manifest | None) -> dict[bytes, _Swap]:
    """The traced files of stale checkpoints -> what replaces each."""
    files = checkpoint_files(recorded_on, mounted)
    newest = newest_coherent(mounted)
    out: dict[bytes, _Swap] = {}
    for path in paths:
        old = files.get(path)
        new = newest.get(old.run) if old is not None else None
        if old is None or new is None or new.id == old.id or not new.progress > old.progress:
            continue
        role = old.role(os.fsdecode(path))
        match = next((f for f in sorted(new.sizes) if new.role(f) == role), None)
        out[path] = _Swap(os.fsencode(match) if match else None, old.sizes[os.fsdecode(path)],
                          (old.id, new.id, old.run))
    return out


def _read_to_end(offsets: list[int], starts: list[int], size: int) -> bool:
    """Whether a stale file's traced offsets (chunk starts) reach its last chunk.

    ``starts``: its chunk offsets, when the mounted snapshot still holds it
    ([] otherwise: then any offset within the largest chunk of its end counts).
    """
    if not offsets:
        return False
    if starts:
        return max(offsets) >= starts[-1]
    return size >= 0 and max(offsets) >= size - MAX_CHUNK


def replace_stale_checkpoints(entries: list[Entry], mounted: Manifest, recorded_on: Manifest | None,
                              starts_of: Callable[[bytes], list[int]], notes: list[str] | None = None) -> list[Entry]:
    """``entries`` with reads of stale checkpoints turned into reads of the newest coherent ones (module docstring).

    ``starts_of(path)``: the sorted chunk offsets of a file of the mounted
    snapshot ([] when it has none there).  What was replaced is said in one
    line per stale checkpoint: appended to ``notes`` when given (a mount runs
    this in the calling process, which has no log handler: the mount reports
    the notes, mount/plan.py), else logged.
    """
    swaps = _swaps(dict.fromkeys(p for p, _off in entries), mounted, recorded_on)
    if not swaps:
        return entries
    offsets: dict[bytes, list[int]] = {}
    last: dict[bytes, int] = {}
    for i, (path, off) in enumerate(entries):
        if path in swaps:
            offsets.setdefault(path, []).append(off)
            last[path] = i
    starts = {s.new: starts_of(s.new) for s in swaps.values() if s.new is not None}
    ends = {old: _read_to_end(offsets[old], starts_of(old), s.old_size) for old, s in swaps.items()}
    emitted = dict.fromkeys(starts, 0)  # per newer file: how many of its chunks are in ``out``
    out: list[Entry] = []
    for i, (path, off) in enumerate(entries):
        swap = swaps.get(path)
        if swap is None:
            out.append((path, off))
            continue
        if swap.new is None:
            continue
        upto = math.inf if i == last[path] and ends[path] else off
        chunks, k = starts[swap.new], emitted[swap.new]
        while k < len(chunks) and chunks[k] <= upto:
            out.append((swap.new, chunks[k]))
            k += 1
        emitted[swap.new] = k
    lines = _describe_swaps(swaps)
    if notes is not None:
        notes.extend(lines)
    else:
        for line in lines:
            log.info("%s", line)
    return out


def _describe_swaps(swaps: dict[bytes, _Swap]) -> list[str]:
    """One line per stale checkpoint: what replaces it, how many of its traced files have no counterpart."""
    by: dict[tuple[str, str, str], list[_Swap]] = {}
    for swap in swaps.values():
        by.setdefault(swap.what, []).append(swap)
    lines = []
    for (old, new, run), group in by.items():
        lost = sum(1 for s in group if s.new is None)
        lines.append(f"trace: reads of checkpoint {old} replayed as reads of {new}, the newest coherent checkpoint "
                     f"of run {run} ({len(group)} file{'s' if len(group) != 1 else ''}"
                     + (f"; {lost} without a counterpart there not replayed)" if lost else ")"))
    return lines
