"""Is a checkpoint's set of files whole? Shards, ranks and DCP metadata, judged across files.

Each file has been checked on its own (:mod:`ogrefs.inspect.ckptfiles`); here
the files of one checkpoint are judged together, per directory:

* an ``*.index.json`` names shards that must all be present;
* ``-0000N-of-0000M`` families must have every N in 1..M;
* rank families (RNG state, ZeRO optimizer shards, model-parallel ranks,
  DCP writers) must have every rank 0..max, and ZeRO shards as many as the
  recorded ``dp_world_size``;
* a ``torch.distributed.checkpoint`` directory must have its ``.metadata``
  (written last), naming only present shards at least as long as it needs.

Pure functions over :class:`FileCheck` results: no file is read here.
"""

from __future__ import annotations

import os
import re

from ogrefs.inspect.ckptfiles import FileCheck

SHARD_RE = re.compile(r"^(?P<stem>.*?)-(?P<i>\d+)-of-(?P<n>\d+)(?P<ext>\..+)$")
_RANK_FAMILIES = (
    # (regex over the name, label), rank is group "r", the rest is the family
    (re.compile(r"^(?P<pre>rng_state_)(?P<r>\d+)(?P<post>\.pth)$"), "RNG state rank"),
    (re.compile(r"^(?P<pre>(?:bf16_)?zero_pp_rank_)(?P<r>\d+)(?P<post>_mp_rank_\d+_optim_states\.pt)$"),
     "ZeRO optimizer shard rank"),
    (re.compile(r"^(?P<pre>mp_rank_)(?P<r>\d+)(?P<post>_model_states\.pt)$"), "model-parallel rank"),
    (re.compile(r"^(?P<pre>__)(?P<r>\d+)(?P<post>_\d+\.distcp)$"), "DCP writer rank"),
    (re.compile(r"^(?P<pre>random_states_)(?P<r>\d+)(?P<post>\.pkl)$"), "accelerate RNG state process"),
)


def is_family_member(name: str) -> bool:
    """Is ``name`` one of a rank or shard family, whose count depends on the world size or the model size?"""
    return bool(SHARD_RE.match(name)) or any(rx.match(name) for rx, _label in _RANK_FAMILIES)


def set_problems(checks: list[FileCheck], root: str | None, dp_world_size: int | None) -> tuple[list[str], list[str]]:
    """(problems, evidence) of one checkpoint's files as a set.

    ``root`` is the checkpoint directory (DCP directories are named relative
    to it), None for loose files.
    """
    by_dir: dict[str, dict[str, FileCheck]] = {}
    for c in checks:
        by_dir.setdefault(os.path.dirname(c.path), {})[os.path.basename(c.path)] = c
    problems = _index_shards(checks, by_dir)
    evidence: list[str] = []
    for files in by_dir.values():
        problems += _numbered_shards(files)
    for files in by_dir.values():
        problems += _rank_families(files, dp_world_size)
    for d, files in by_dir.items():
        dcp_problems, dcp_evidence = _dcp(d, files, root)
        problems += dcp_problems
        evidence += dcp_evidence
    return problems, evidence


def _index_shards(checks: list[FileCheck], by_dir: dict[str, dict[str, FileCheck]]) -> list[str]:
    problems = []
    for c in checks:
        listed = c.facts.get("index_files")
        if listed:
            here = by_dir.get(os.path.dirname(c.path), {})
            missing = [f for f in listed if os.path.basename(f) not in here]
            if missing:
                problems.append(f"{os.path.basename(c.path)} lists {len(missing)} missing shard(s): "
                                + ", ".join(missing[:3]))
    return problems


def _numbered_shards(files: dict[str, FileCheck]) -> list[str]:
    """``-0000N-of-0000M`` families with a gap."""
    fams: dict[tuple, set[int]] = {}
    for base in files:
        m = SHARD_RE.match(base)
        if m:
            key = (m.group("stem"), m.group("n"), m.group("ext"), len(m.group("i")))
            fams.setdefault(key, set()).add(int(m.group("i")))
    problems = []
    for (stem, n, ext, width), have in fams.items():
        missing = sorted(set(range(1, int(n) + 1)) - have)
        if missing:
            names = [f"{stem}-{i:0{width}d}-of-{n}{ext}" for i in missing[:3]]
            problems.append(f"missing shard(s): {', '.join(names)}")
    return problems


def _rank_families(files: dict[str, FileCheck], dp_world_size: int | None) -> list[str]:
    """Rank families 0..N-1 with a gap, and ZeRO shards fewer than the recorded world size."""
    problems = []
    for rx, label in _RANK_FAMILIES:
        fams: dict[tuple, set[int]] = {}
        for base in files:
            m = rx.match(base)
            if m:
                fams.setdefault((m.group("pre"), m.group("post")), set()).add(int(m.group("r")))
        for (pre, post), ranks in fams.items():
            missing = sorted(set(range(max(ranks) + 1)) - ranks)
            if missing:
                problems.append(
                    f"{label}(s) {', '.join(map(str, missing[:5]))} missing "
                    f"(e.g. {pre}{missing[0]}{post}); present: {', '.join(map(str, sorted(ranks)[:8]))}"
                )
            world = dp_world_size if "optim_states" in post else None
            if world and max(ranks) + 1 < world:
                problems.append(
                    f"model_states records dp_world_size={world} but only "
                    f"{len(ranks)} ZeRO optimizer shard(s) ({pre}*{post}) are present"
                )
    return problems


def _dcp(d: str, files: dict[str, FileCheck], root: str | None) -> tuple[list[str], list[str]]:
    """A torch.distributed.checkpoint directory: its .metadata present, its shards there and long enough."""
    shards = {b for b in files if b.endswith(".distcp")}
    meta = files.get(".metadata")
    if not shards and not meta:
        return [], []
    rel = os.path.relpath(d, root) if root is not None else d
    where = "" if rel == "." else f" in {rel}"
    if meta is None:
        return [f"no .metadata{where} (torch.distributed.checkpoint writes it last; the save did not finish)"], []
    problems = []
    named = set(meta.facts.get("distcp_files", []))
    missing = sorted(named - shards)
    if missing:
        problems.append(f".metadata{where} names {len(missing)} missing shard(s): {', '.join(missing[:3])}")
    for fname, end in meta.facts.get("extents", {}).items():
        c = files.get(fname)
        if c is not None and c.size < end:
            problems.append(f"{fname}: .metadata needs {end} bytes, file has {c.size}; truncated")
    evidence = [] if missing else [f".metadata{where} present and all {len(named)} named shard(s) found"]
    return problems, evidence
