"""Group checkpoint files into checkpoints and runs, and judge coherence.

Input is what the directory walk noticed: ``{dir: [candidate names]}``.
The steps, in words:

1. *Pointers* (``latest``, ``latest_checkpointed_iteration.txt``, a
   ``latest``/``last*`` symlink) are read, not treated as checkpoints.
2. A *checkpoint directory* is one named like ``checkpoint-200``,
   ``global_step1000``, ``step_50``, ``iter_0001000``, ``epoch_3``, or
   one holding DeepSpeed ``*_model_states.pt`` / ``*_optim_states.pt`` or
   ``torch.distributed.checkpoint`` ``*.distcp`` files.  Candidate files in
   sub-directories up to two levels below a directory named like that
   (``checkpoint-200/global_step200/``, ``iter_0001000/mp_rank_00/``) belong
   to it.  Its *run* is its parent directory.
3. Loose files in any other directory form checkpoints by the progress
   point in their names (``model_step10.pt`` + ``optimizer_step10.pt``);
   unnumbered files that name a component (``model.safetensors``,
   ``optimizer.pt``) form one checkpoint; anything else stands alone.
   Their run is the directory.
4. Every file is checked (:mod:`ogrefs.inspect.ckptfiles`), then the
   checkpoint as a whole: shards named by an index or ``-0000N-of-0000M``
   all present, rank shards 0..N-1 all present (and as many as DeepSpeed's
   recorded ``dp_world_size``), DCP ``.metadata`` present and naming only
   present shards of sufficient size, the files its framework writes in
   every finished save present (:mod:`ogrefs.inspect.ckptrules`), the files
   every other finished save of its run holds present, no pickle naming a
   global outside torch's ``weights_only`` allowlist, and every progress
   point recorded (directory name, ``trainer_state.json``, pickle keys)
   agreeing.  accelerate's ``checkpoint_<N>`` is a save index, not a step.
5. Within a run, the components that the run's complete checkpoints hold
   are expected of every checkpoint; one lacking any is not coherent
   ("no optimizer state for step 10; optimizer state exists only for
   step 9").  The run's most advanced coherent checkpoint is the coherent
   one with the highest progress point (step, then epoch), then the newest
   mtime.  Its framework's own resume target (the highest ``checkpoint-N``,
   the newest ``last*.ckpt``, the ``latest`` pointer, ...) is reported beside
   it; the run's latest coherent checkpoint is that target when it is
   coherent, else the most advanced one, and a problem is named where the
   two disagree (a restart in the same directory, a torn target).
6. The overall latest coherent checkpoint is picked across runs: training
   checkpoints (with a progress point, optimizer or progress record) before
   bare weights, then the newest mtime.  Modification time only chooses
   between runs or breaks ties; it never makes a checkpoint coherent.
"""

from __future__ import annotations

import os
import re
import stat
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from ogrefs.inspect.deadline import Deadline
from ogrefs.inspect.ckptfiles import (
    FileCheck,
    check_file,
    components_from_name,
    kind_from_name,
)
from ogrefs.inspect.ckptrules import framework_problems, process_count, resume_rule, sibling_problems
from ogrefs.inspect.ckptsets import SHARD_RE, is_family_member, set_problems
from ogrefs.inspect.files import open_regular

__all__ = ["analyze_checkpoints", "is_candidate_name", "POINTER_NAMES", "COMPONENTS"]

COMPONENTS = ("model", "optimizer", "scheduler", "rng", "progress")
_LABEL = {
    "model": "model weights",
    "optimizer": "optimizer state",
    "scheduler": "scheduler state",
    "rng": "RNG state",
    "progress": "progress record",
}

#: Regular files with these names are pointers, read as text.
POINTER_NAMES = frozenset({
    "latest", "latest.txt", "last", "latest_checkpoint", "last_checkpoint",
    "latest_checkpointed_iteration.txt", "LATEST", "checkpoint_latest",
})

_POINTER_NAMES_B = frozenset(n.encode() for n in POINTER_NAMES)

_CKPT_DIR_RE = re.compile(
    r"^(checkpoint|ckpt|global_step|globalstep|step|steps|iter|iteration|epoch)[-_=]?(\d+)$",
    re.IGNORECASE,
)
_NAME_STEP_RE = re.compile(
    r"(?<![a-z])(?:global_?step|step|steps|iter|iteration|ckpt|checkpoint)[-_=]?(\d+)(?!\d)"
)
_NAME_EPOCH_RE = re.compile(r"(?<![a-z])epoch[-_=]?(\d+)(?!\d)")
_DS_RE = re.compile(r"(model_states|optim_states)\.pt$")


def is_candidate_name(name: bytes) -> bool:
    """Cheap filter for the walker: could this entry belong to a checkpoint?"""
    return (
        name.endswith((b".pt", b".pth", b".bin", b".ckpt", b".safetensors", b".distcp"))
        or name == b"trainer_state.json"
        or name == b".metadata"
        or name.endswith((b".safetensors.index.json", b".bin.index.json"))
        or name in _POINTER_NAMES_B
        or name.endswith(b".pkl") and name.startswith(_ACCELERATE_PKL)
    )


#: accelerate's save_state files that end in .pkl (other .pkl files are data, not checkpoints)
_ACCELERATE_PKL = (b"random_states_", b"custom_checkpoint_", b"sampler", b"dl_state_dict")


@dataclass
class _Unit:
    id: str
    path: str
    name: str
    run: str
    files: list[str]
    is_dir: bool
    name_step: int | None = None
    name_epoch: float | None = None
    checks: list[FileCheck] = field(default_factory=list)
    # results
    format: str = "unknown"
    step: int | None = None
    epoch: float | None = None
    components: set[str] = field(default_factory=set)
    components_known: bool = True
    complete: bool | None = True
    coherent: bool = False
    problems: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    mtime: float = 0.0
    size: int = 0
    inner_pointers: list[str] = field(default_factory=list)

    def order_key(self) -> tuple:
        return (
            self.step is not None or self.epoch is not None,
            self.step if self.step is not None else -1,
            self.epoch if self.epoch is not None else -1,
            self.mtime,
        )

    def where(self) -> str:
        if self.step is not None:
            return f"step {self.step}"
        if self.epoch is not None:
            return f"epoch {self.epoch:g}"
        return self.name

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "path": self.path,
            "name": self.name,
            "run": self.run,
            "format": self.format,
            "step": self.step,
            "epoch": self.epoch,
            "components": [c for c in COMPONENTS if c in self.components]
            + ([] if self.components_known else ["unknown"]),
            "complete": self.complete,
            "coherent": self.coherent,
            "problems": list(self.problems),
            "evidence": list(self.evidence),
            "warnings": list(self.warnings),
            "files": [c.to_json() for c in self.checks],
            "mtime": self.mtime,
            "size": self.size,
        }


def _name_progress(stem: str) -> tuple[int | None, float | None]:
    low = stem.lower()
    m = SHARD_RE.match(low)
    if m:
        low = m.group("stem")
    step = epoch = None
    ms = _NAME_STEP_RE.search(low)
    if ms:
        step = int(ms.group(1))
    me = _NAME_EPOCH_RE.search(low)
    if me:
        epoch = float(int(me.group(1)))
    return step, epoch


def _dir_progress(name: str) -> tuple[int | None, float | None]:
    m = _CKPT_DIR_RE.match(name)
    if not m:
        return None, None
    if m.group(1).lower() == "epoch":
        return None, float(int(m.group(2)))
    return int(m.group(2)), None


def _read_pointer(path: str) -> tuple[str, str] | None:
    """(kind, target text) of a pointer file or link; None if unreadable."""
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return "symlink", os.readlink(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 4096:
            return None
        with open_regular(path) as f:
            text = f.read(4096).decode("utf-8", "replace").strip()
        first = text.splitlines()[0].strip() if text else ""
        return "file", first
    except OSError:
        return None


def analyze_checkpoints(
    candidates: dict[str, list[str]], deadline: Deadline,
    known: "Callable[[str], FileCheck | None] | None" = None,
) -> tuple[dict, list[str], list[str]]:
    """Return (checkpoints section, files of the latest coherent one, notes).

    ``known(path)`` may give the verdict on a file already judged and known
    unchanged (a snapshot of a box running from an ogrefs mount), so that it is
    not read again.
    """
    notes: list[str] = []
    pointers, files_by_dir = _sort_candidates(candidates)
    units = _build_units(files_by_dir, pointers)
    not_examined = _examine(units, deadline, known)
    # A lone file that is neither a known checkpoint format nor named like
    # one ("notes.bin", "data.pt" holding something else) is not a checkpoint.
    units = [u for u in units if not _not_a_checkpoint(u)]
    if not_examined:
        notes.append(
            f"deadline reached: {not_examined} checkpoint file(s) were not examined"
        )
    run_out, run_best, incomplete = _judge_runs(units, pointers)
    overall = None
    if run_best:
        overall = max(
            run_best,
            key=lambda u: (
                u.step is not None or u.epoch is not None
                or bool(u.components & {"optimizer", "progress"}),
                u.mtime,
            ),
        )
    section = {
        "latest_coherent": overall.to_json() if overall else None,
        "runs": run_out,
        "incomplete": incomplete,
        "count": len(units),
    }
    hint_files = [c.path for c in overall.checks] if overall else []
    return section, hint_files, notes


_Pointers = dict[str, list[tuple[str, str, str]]]  # dir -> (path, kind, target)


def _sort_candidates(candidates: dict[str, list[str]]) -> tuple[_Pointers, dict[str, list[str]]]:
    """Pointers (read) apart from the regular files that may hold checkpoint data, per directory."""
    pointers: _Pointers = {}
    files_by_dir: dict[str, list[str]] = {}
    for d, names in candidates.items():
        for name in names:
            full = os.path.join(d, name)
            low = name.lower()
            try:
                st = os.lstat(full)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                if name in POINTER_NAMES or low.startswith(("latest", "last")):
                    ptr = _read_pointer(full)
                    if ptr:
                        pointers.setdefault(d, []).append((full, ptr[0], ptr[1]))
                continue  # other links: the target is examined where it lives
            if not stat.S_ISREG(st.st_mode):
                continue
            if name in POINTER_NAMES:
                ptr = _read_pointer(full)
                if ptr:
                    pointers.setdefault(d, []).append((full, ptr[0], ptr[1]))
                continue
            files_by_dir.setdefault(d, []).append(name)
    return pointers, files_by_dir


def _examine(units: list[_Unit], deadline: Deadline, known: "Callable[[str], FileCheck | None] | None") -> int:
    """Check every file of every unit (or take its known verdict), then judge the unit; the count left unread."""
    not_examined = 0
    for u in units:
        for fpath in u.files:
            if deadline.expired():
                not_examined += 1
                fc = FileCheck(path=fpath, ok=None)
                fc.problems.append("not examined: deadline reached")
                u.checks.append(fc)
                continue
            prior = known(fpath) if known is not None else None
            u.checks.append(prior if prior is not None else check_file(fpath, deadline))
        _evaluate(u)
    return not_examined


def _judge_runs(units: list[_Unit], pointers: _Pointers) -> tuple[list[dict], list[_Unit], list[dict]]:
    """Per run: its latest coherent checkpoint and pointers; (runs section, each run's best, incomplete ones)."""
    runs: dict[str, list[_Unit]] = {}
    for u in units:
        runs.setdefault(u.run, []).append(u)
    run_out = []
    run_best: list[_Unit] = []
    incomplete = []
    for run_dir in sorted(runs):
        members = runs[run_dir]
        _expect_siblings(members)
        advanced = _judge_run(members)
        ptr_out, hits = _resolve_pointers(run_dir, pointers.get(run_dir, []), members, advanced)
        resume, resume_out, run_problems = _resume(members, hits, advanced)
        best = resume if resume is not None and resume.coherent else advanced
        members.sort(key=_Unit.order_key, reverse=True)
        run_out.append({
            "dir": run_dir,
            "framework": _run_format(members),
            "latest_coherent": best.id if best else None,
            "most_advanced_coherent": advanced.id if advanced else None,
            "resume": resume_out,
            "problems": run_problems,
            "pointers": ptr_out,
            "checkpoints": [m.to_json() for m in members],
        })
        if best:
            run_best.append(best)
        incomplete += [{"id": m.id, "path": m.path, "reason": "; ".join(m.problems) or "not coherent"}
                       for m in members if not m.coherent]
    # Pointers in directories that hold no checkpoints of their own.
    for d, ptrs in pointers.items():
        if d not in runs and not any(
            u.is_dir and (d == u.path or d.startswith(u.path + os.sep)) for u in units
        ):
            run_out.append({
                "dir": d,
                "framework": None,
                "latest_coherent": None,
                "most_advanced_coherent": None,
                "resume": None,
                "problems": [],
                "pointers": _resolve_pointers(d, ptrs, [], None)[0],
                "checkpoints": [],
            })
    return run_out, run_best, incomplete


def _not_a_checkpoint(u: _Unit) -> bool:
    if u.is_dir or len(u.checks) != 1:
        return False
    c = u.checks[0]
    if c.kind == "unknown" and not c.problems:
        return True  # neither zip, safetensors nor pickle: "shard-00087.bin" is data
    if c.ok is not False and c.facts.get("top_type") == "tensor":
        return True  # one tensor ("data/tokens.pt"): data, never a model's state_dict
    if u.name_step is not None or u.name_epoch is not None:
        return False  # "ckpt_100.pt" left empty by a crash is worth reporting
    if components_from_name(os.path.basename(c.path)):
        return False
    return (
        (c.kind == "unknown" and not c.problems)  # unexamined files have problems
        or c.kind == "empty"
        or (c.kind == "zip" and c.ok is True)  # a sound zip that is not torch.save's
    )


def _owner_dir(d: str) -> str | None:
    """The checkpoint directory d belongs to, or None for a loose directory."""
    parent = os.path.dirname(d)
    grand = os.path.dirname(parent)
    for anc in (parent, grand):
        if anc and anc != d and _CKPT_DIR_RE.match(os.path.basename(anc)):
            return anc
    return None


def _build_units(files_by_dir: dict[str, list[str]], pointers: dict) -> list[_Unit]:
    owned: dict[str, list[str]] = {}
    loose: dict[str, list[str]] = {}
    for d, names in files_by_dir.items():
        owner = _owner_dir(d)
        if owner is None:
            base = os.path.basename(d)
            if _CKPT_DIR_RE.match(base) or any(
                _DS_RE.search(n) or n.endswith(".distcp") for n in names
            ):
                owner = d
        if owner is None:
            loose[d] = names
        else:
            owned.setdefault(owner, []).extend(os.path.join(d, n) for n in names)

    units: list[_Unit] = []
    for owner, paths in owned.items():
        step, epoch = _dir_progress(os.path.basename(owner))
        u = _Unit(
            id=owner, path=owner, name=os.path.basename(owner),
            run=os.path.dirname(owner), files=sorted(paths), is_dir=True,
            name_step=step, name_epoch=epoch,
        )
        for d, ptrs in pointers.items():
            if d == owner or d.startswith(owner + os.sep):
                u.inner_pointers.extend(f"{os.path.basename(p)} -> {t}" for p, _k, t in ptrs)
        units.append(u)

    for d, names in loose.items():
        groups: dict[object, list[str]] = {}
        for n in sorted(names):
            kind = kind_from_name(n)
            if kind in ("args", "other-json"):
                continue
            stem = n.rsplit(".", 1)[0] if "." in n else n
            step, epoch = _name_progress(stem)
            if n.endswith(".ckpt"):
                key = ("file", n)  # Lightning: one file per checkpoint ("step=20.ckpt", "step=20-v1.ckpt")
            elif step is not None or epoch is not None:
                key: object = ("at", step, epoch)
            elif components_from_name(n) or kind in ("index", "progress"):
                key = ("unnumbered",)
            else:
                key = ("file", n)
            groups.setdefault(key, []).append(n)
        for key, members in groups.items():
            if key[0] == "file":
                step, epoch = _name_progress(key[1].rsplit(".", 1)[0])
                label = key[1]
            elif key[0] == "at":
                step, epoch = key[1], key[2]
                label = f"step {step}" if step is not None else f"epoch {epoch:g}"
            else:
                step = epoch = None
                label = "unnumbered files"
            if len(members) == 1:
                full = os.path.join(d, members[0])
                uid, path, name = full, full, members[0]
            else:
                uid, path, name = f"{d}#{label}", d, label
            units.append(_Unit(
                id=uid, path=path, name=name, run=d,
                files=[os.path.join(d, m) for m in members], is_dir=False,
                name_step=step, name_epoch=epoch,
            ))
    return units


@dataclass
class _Read:
    """What a checkpoint's files say about it, gathered file by file."""

    components: set[str] = field(default_factory=set)
    steps: dict[str, int] = field(default_factory=dict)  # where it is written -> step
    epoch: float | None = None  # the first epoch a file's content records
    opaque: bool = False  # some content could not be read for components (legacy pickle, unknown keys)
    facts: dict = field(default_factory=dict)  # DeepSpeed/Lightning facts: world sizes, flags


def _evaluate(u: _Unit) -> None:
    """Per-checkpoint verdict: completeness, components, progress point."""
    read = _read_files(u)
    u.format = _format_of(u, read.facts)
    if u.format == "accelerate":
        _accelerate_progress(u, read)
    if u.name_step is not None:
        what = "directory" if u.is_dir else "file name"
        u.evidence.insert(0, f"{what} says step {u.name_step}")
    elif u.name_epoch is not None:
        u.evidence.insert(0, f"name says epoch {u.name_epoch:g}")
    problems, evidence = set_problems(u.checks, u.path if u.is_dir else None, read.facts.get("dp_world_size"))
    u.problems += problems + framework_problems(u.format, u.checks)
    u.evidence += evidence
    _settle_progress(u, read)
    u.components = read.components
    # Opaque content (legacy pickle, non-dict pickle, unrecognised DCP keys)
    # leaves the components unknown unless something else names them.
    u.components_known = not read.opaque or bool(read.components - {"progress"})
    if u.format.startswith("hf-trainer") and "progress" not in read.components:
        u.problems.append("no trainer_state.json (the HF Trainer writes it when a save completes)")
    for p in u.inner_pointers:
        u.evidence.append(f"pointer {p}")
    u.mtime = max((c.mtime for c in u.checks), default=0.0)
    u.size = sum(c.size for c in u.checks)
    # Complete: every file intact and the set structurally whole.  Which
    # components it holds is judged per run, in _judge_run.
    if u.complete is not None:
        u.complete = not any(c.ok is False for c in u.checks) and not u.problems


def _read_files(u: _Unit) -> _Read:
    """Each file's verdict into the unit (problems, evidence, warnings) and what they say together."""
    read = _Read()
    if u.name_step is not None:
        read.steps[f"{'directory' if u.is_dir else 'file name'} {u.name!r}"] = u.name_step
    for c in u.checks:
        base = os.path.basename(c.path)
        if c.ok is False:
            u.problems.extend(f"{base}: {p}" for p in c.problems)
        elif c.ok is None and c.problems:
            u.problems.extend(f"{base}: {p}" for p in c.problems)
            u.complete = None
        if kind_from_name(base) != "args":
            read.components |= c.components | components_from_name(base)
        if c.step is not None:
            read.steps[base] = c.step
        if c.epoch is not None and read.epoch is None:
            read.epoch = c.epoch
        if c.facts.get("opaque"):
            read.opaque = True
        read.facts.update({k: c.facts[k] for k in ("dp_world_size", "mp_world_size", "deepspeed", "lightning")
                           if k in c.facts})
        if "scheduler_steps" in c.facts:
            read.facts["scheduler_steps"] = c.facts["scheduler_steps"]
        if c.unusual_globals:
            u.problems.append(
                f"{base}: its pickle names {', '.join(c.unusual_globals[:5])}, outside torch's weights_only "
                "allowlist: torch.load(weights_only=True), torch's default, refuses it, and loading it "
                "otherwise would run them"
            )
        for e in c.evidence:
            u.evidence.append(e if e.startswith(base) else f"{base}: {e}")
    return read


def _accelerate_progress(u: _Unit, read: _Read) -> None:
    """accelerate's ``checkpoint_<N>`` counts saves, not steps: the step is in the saved state."""
    if u.name_step is not None:
        read.steps.pop(f"directory {u.name!r}", None)
        u.evidence.insert(0, f"directory {u.name} is accelerate's save index {u.name_step}, not a step")
        u.name_step = None
    for base in [b for b, v in read.steps.items() if b.startswith("random_states_") and v == 0]:
        del read.steps[base]  # accelerate's own step counter only moves under accelerator.accumulate()
    sched = read.facts.get("scheduler_steps")
    world = sum(1 for c in u.checks if re.match(r"^random_states_\d+\.pkl$", os.path.basename(c.path)))
    if not read.steps and sched is not None and world and sched % world == 0:
        # accelerate steps a prepared scheduler once per process per optimizer step (its default)
        read.steps["scheduler.bin last_epoch"] = sched // world
        u.evidence.append(f"step {sched // world} from the LR scheduler's last_epoch {sched}"
                          + (f" over {world} processes" if world > 1 else ""))


def _settle_progress(u: _Unit, read: _Read) -> None:
    """The unit's step and epoch; every place that records a step must agree."""
    if len(set(read.steps.values())) > 1:
        u.problems.append(
            "progress points disagree: "
            + ", ".join(f"{src} says {v}" for src, v in read.steps.items())
        )
    content_steps = [v for k, v in read.steps.items() if not k.startswith(("directory ", "file name "))]
    u.step = content_steps[0] if content_steps else u.name_step
    u.epoch = read.epoch if read.epoch is not None else u.name_epoch


_HF_FILES = {"model.safetensors", "pytorch_model.bin", "optimizer.pt", "scheduler.pt", "trainer_state.json"}


def _format_of(u: _Unit, facts: dict) -> str:
    """Which framework wrote the checkpoint, from its file names and facts."""
    names = {os.path.basename(c.path) for c in u.checks}
    if any(_DS_RE.search(n) for n in names) or facts.get("deepspeed"):
        fmt = "deepspeed"
    elif any(n.endswith(".distcp") for n in names) or ".metadata" in names:
        fmt = "torch-dcp"
    elif "trainer_state.json" in names:
        fmt = "hf-trainer"
    elif names & {"random_states_0.pkl", "optimizer.bin"} or any(
            n.startswith(("random_states_", "custom_checkpoint_")) for n in names):
        fmt = "accelerate"
    elif "model_optim_rng.pt" in names:
        fmt = "megatron"
    elif facts.get("lightning") or any(n.endswith(".ckpt") for n in names):
        fmt = "lightning"
    elif u.is_dir:
        fmt = "checkpoint-dir"
    elif len(u.checks) == 1:
        k = u.checks[0].kind
        fmt = {"torch-zip": "torch", "zip": "zip"}.get(k, k)
    else:
        fmt = "files"
    if u.is_dir and re.match(r"^checkpoint-\d+$", u.name) and fmt in ("checkpoint-dir", "deepspeed", "torch-dcp"):
        if names & _HF_FILES or any(n.startswith(("rng_state", "model-0", "pytorch_model-0")) for n in names):
            fmt = "hf-trainer" if fmt == "checkpoint-dir" else f"hf-trainer+{fmt}"
    return fmt


def _run_format(members: list[_Unit]) -> str:
    """The run's framework: the format most of its checkpoints have."""
    fmts = [m.format for m in members]
    return max(sorted(set(fmts)), key=fmts.count)


def _expect_siblings(members: list[_Unit]) -> None:
    """A directory checkpoint lacking a file that every other finished save of its run and framework holds.

    Rank and shard families are left to the world-size rules (a restart may change the world).
    Counted once per run, so a run of thousands of saves costs thousands of steps, not millions.
    """
    def names(u: _Unit) -> set[str]:
        # "global_step50/x.pt" and "global_step60/x.pt" are the same file of two saves
        return {re.sub(r"\d+(?=[^/]*/)", "N", rel) for c in u.checks
                if not is_family_member(base := os.path.basename(c.path)) and base != "rng_state.pth"
                and (rel := os.path.relpath(c.path, u.path))}

    dirs = [m for m in members if m.is_dir and m.complete is not None]
    whole = {id(m) for m in dirs if not m.problems}
    held: dict[str, Counter] = {}  # format -> file name -> how many finished saves hold it
    worlds: dict[str, Counter] = {}  # format -> process count -> how many finished saves have it
    saves: Counter = Counter()  # format -> how many finished saves
    for m in dirs:
        if id(m) in whole:
            saves[m.format] += 1
            held.setdefault(m.format, Counter()).update(names(m))
            worlds.setdefault(m.format, Counter())[process_count(m.format, m.checks)] += 1
    for m in dirs:
        mine = id(m) in whole
        others = saves[m.format] - mine
        if not others:
            continue
        have = names(m)
        missing = [n for n, k in sorted(held[m.format].items())
                   if k == others and n not in have and not any(n in p for p in m.problems)]  # not said twice
        if missing:
            m.problems.append(f"no {', '.join(missing[:3])} (every other {m.format} save in this run has it: "
                              "the save did not finish or the file was removed)")
        other_worlds = worlds[m.format] - Counter([process_count(m.format, m.checks)] if mine else [])
        more = [p for p in sibling_problems(m.format, m.checks, other_worlds) if p not in m.problems]
        m.problems += more
        if missing or more:
            m.complete = False


def _resume(members: list[_Unit], hits: list[_Unit],
            advanced: _Unit | None) -> tuple[_Unit | None, dict | None, list[str]]:
    """The framework's own resume target, its JSON, and the run's problems.

    A problem wherever the target and the most advanced coherent checkpoint disagree: the
    target torn, or coherent but behind another save (two runs in one directory).
    """
    fmt = _run_format(members)
    target, rule = resume_rule(fmt, members, hits)
    problems: list[str] = []
    if target is None:
        return None, ({"id": None, "rule": rule} if rule else None), problems
    out = {"id": target.id, "name": target.name, "step": target.step, "epoch": target.epoch,
           "coherent": target.coherent, "rule": rule}
    if not target.coherent:
        problems.append(f"the run would resume from {target.name}, which is not coherent"
                        + (f"; the most advanced coherent checkpoint is {advanced.name}" if advanced else ""))
    elif advanced is not None and advanced is not target and advanced.order_key()[:3] > target.order_key()[:3]:
        problems.append(f"the run would resume from {target.name} ({target.where()}) but {advanced.name} "
                        f"({advanced.where()}) is more advanced: two runs in one directory (a restart)?")
    later = [m for m in members if m.coherent and m.step is not None and target.step is not None
             and m.step > target.step and m.mtime < target.mtime and m is not target]
    if later and not problems:
        problems.append(f"{target.name} ({target.where()}) was written after {later[0].name} "
                        f"({later[0].where()}): a restarted run in the same directory")
    return target, out, problems


def _judge_run(members: list[_Unit]) -> _Unit | None:
    expected: set[str] = set()
    for m in members:
        if m.complete and m.components_known:
            expected |= m.components
    for m in members:
        if m.complete is not True:
            m.coherent = False
            continue
        if m.components_known and "model" not in m.components:
            m.problems.append("no model weights")
            m.coherent = False
            continue
        missing = [c for c in COMPONENTS if c in expected and c not in m.components] if m.components_known else []
        for c in missing:
            holders = sorted(
                (o for o in members if o is not m and c in o.components),
                key=_Unit.order_key,
            )
            where = ", ".join(o.where() for o in holders[-3:])
            m.problems.append(
                f"no {_LABEL[c]} for {m.where()}"
                + (f"; {_LABEL[c]} exists only for {where}" if where else "")
            )
        m.coherent = not missing
        if m.coherent:
            m.evidence.append(
                "coherent: complete, with "
                + (", ".join(c for c in COMPONENTS if c in m.components) or "unknown components")
            )
    coherent = [m for m in members if m.coherent]
    return max(coherent, key=_Unit.order_key) if coherent else None


def _resolve_pointers(run_dir: str, ptrs, members: list[_Unit], best: _Unit | None) -> tuple[list[dict], list[_Unit]]:
    """Each pointer's record, and the checkpoints they resolve to (the newest pointer's first)."""
    out = []
    hits: list[tuple[float, _Unit]] = []
    for path, kind, target in ptrs:
        tgt_path = os.path.normpath(os.path.join(run_dir, target)) if target else ""
        hit = None
        for m in members:
            if m.path == tgt_path or tgt_path in m.files:
                hit = m
                break
        if hit is None and target:
            step, _ = _name_progress(os.path.basename(target))
            if step is None and target.isdigit():
                step = int(target)
            if step is not None:
                hit = next((m for m in members if m.step == step or m.name_step == step), None)
        rec = {
            "path": path,
            "kind": kind,
            "target": target,
            "resolves_to": hit.id if hit else None,
            "target_coherent": hit.coherent if hit else None,
        }
        if hit is None:
            rec["problem"] = f"{os.path.basename(path)} points to {target!r}, which is not a checkpoint here"
        elif not hit.coherent:
            rec["problem"] = (
                f"{os.path.basename(path)} points to {hit.name}, which is not coherent"
                + (f"; latest coherent is {best.name}" if best else "")
            )
        if hit is not None:
            hits.append((_mtime(path), hit))
            hit.evidence.append(f"{os.path.basename(path)} ({kind}) points here")
            if best is not None and best is not hit and best.order_key() > hit.order_key():
                best.evidence.append(
                    f"newer than what {os.path.basename(path)} points to ({hit.name}); "
                    "pointers are usually written after a save finishes"
                )
        out.append(rec)
    return out, [h for _t, h in sorted(hits, key=lambda t: -t[0])]


def _mtime(path: str) -> float:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return 0.0
