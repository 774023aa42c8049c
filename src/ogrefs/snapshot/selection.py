"""Which snapshot a name means: ids, ``latest`` of a box, and the most advanced coherent checkpoint.

A snapshot belongs to a *box*: a name that survives moves between machines
(``snapshot --box``, else the box of the snapshot the machine runs from, else
the host name; manifests written before boxes existed belong to their host).

Selectors, as the CLI takes them (``show``, ``restore``, ``mount``, ``diff``,
``forget``, ``tag``, ``ls``, ``dump``, ``snapshot --parent``):

* a full snapshot id or a unique prefix of one;
* ``latest``: the newest snapshot of *this* box (``$OGREFS_BOX``, else the box
  of the snapshot this machine runs from, else the host name), never another
  box's; ``BOX:latest`` names the box. A snapshot whose paths all lie inside
  those of another snapshot of the box (``/srv/box/proj`` beside ``/srv/box``,
  anything beside a whole-box ``/``) is a *partial* one: a bare ``latest``
  passes over it, so one quick snapshot of a directory never decides what a
  restore or the next boot brings back; ``--path`` picks it (:func:`widest`);
* ``latest-checkpoint`` / ``BOX:latest-checkpoint``: of the box's snapshots,
  the one holding the most advanced coherent training checkpoint (step, then
  epoch; the newest snapshot breaks ties) of the run its newest
  checkpoint-holding snapshot trains, so a later snapshot that holds an older
  or torn checkpoint is never taken for progress.

Every selector is narrowed by :class:`Filters` (``--path``, ``--tag``,
``--host``, as restic's): ``--path`` keeps the snapshots whose recorded paths
are exactly the given set, ``--tag`` those carrying every given tag,
``--host`` those taken on one of the given hosts (and ``latest`` is then
that host's newest, whatever its box). A snapshot named by id must match
them too: a mismatch is an error, never a silent pick.

Pure functions of the manifests; no threads.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Any

from ogrefs.errors import SnapshotNotFound

Manifest = dict[str, Any]
_HEX = re.compile(r"^[0-9a-f]{1,64}$", re.IGNORECASE)
SELECTORS = ("latest", "latest-checkpoint")


def box_of(m: Manifest) -> str:
    """The box a manifest belongs to (older manifests: their host)."""
    box = m.get("box")
    return box if isinstance(box, str) and box else str(m.get("host", ""))


def default_box(repo=None) -> str:
    """``$OGREFS_BOX``, else the box of the snapshot this machine runs from (in ``repo``), else the host name."""
    env = os.environ.get("OGREFS_BOX")
    if env:
        return env
    if repo is not None:
        from ogrefs.snapshot.mounted import own_mounts

        for m in own_mounts():
            try:
                return box_of(repo.load_manifest(m.snapshot))
            except SnapshotNotFound:
                continue  # mounted from another repository
    return socket.gethostname()


def checkpoint_of(m: Manifest) -> dict[str, Any] | None:
    """The coherent checkpoint a snapshot holds: {run, step, epoch, path} of its latest coherent one, or None."""
    env = m.get("environment")
    ck = ((env or {}).get("checkpoints") or {}).get("latest_coherent") if isinstance(env, dict) else None
    if not isinstance(ck, dict) or not ck.get("coherent"):
        return None
    step, epoch = ck.get("step"), ck.get("epoch")
    return {"run": ck.get("run"), "step": step if isinstance(step, int) else None,
            "epoch": epoch if isinstance(epoch, (int, float)) else None, "path": ck.get("path")}


def _progress(ck: dict[str, Any]) -> tuple:
    return (ck["step"] if ck["step"] is not None else -1, ck["epoch"] if ck["epoch"] is not None else -1)


@dataclass(frozen=True)
class Filters:
    """``--path`` / ``--tag`` / ``--host`` of a command that takes snapshots (see the module docstring)."""

    paths: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()

    @classmethod
    def of(cls, paths=(), tags=(), hosts=()) -> "Filters":
        """From the options as typed: paths made absolute and normal, empty tags dropped."""
        return cls(tuple(sorted({os.path.normpath(os.path.abspath(os.fsdecode(p))) for p in paths})),
                   tuple(t for t in tags if t), tuple(hosts))

    def matches(self, m: Manifest) -> bool:
        return ((not self.paths or tuple(sorted(os.path.normpath(p) for p in m.get("paths", []))) == self.paths)
                and set(self.tags) <= set(m.get("tags") or [])
                and (not self.hosts or m.get("host") in self.hosts))

    def describe(self) -> str:
        return " ".join([*(f"--path {p}" for p in self.paths), *(f"--tag {t}" for t in self.tags),
                         *(f"--host {h}" for h in self.hosts)])


NO_FILTERS = Filters()


def _inside(p: str, q: str) -> bool:
    return p == q or q == "/" or p.startswith(q.rstrip("/") + "/")


def _narrower(a: frozenset, b: frozenset) -> bool:
    """Every path of ``a`` lies inside one of ``b``'s, and the sets differ."""
    return a != b and all(any(_inside(p, q) for q in b) for p in a)


def widest(snaps: list[Manifest]) -> list[Manifest]:
    """The snapshots that are not partial: none whose paths all lie inside another snapshot's (order kept)."""
    sets = {frozenset(os.path.normpath(p) for p in m.get("paths", [])) for m in snaps}
    narrow = {a for a in sets if any(_narrower(a, b) for b in sets)}
    return [m for m in snaps if frozenset(os.path.normpath(p) for p in m.get("paths", [])) not in narrow]


def split_selector(name: str) -> tuple[str | None, str]:
    """``BOX:latest`` -> (BOX, latest); ``latest`` -> (None, latest); anything else -> (None, name)."""
    box, sep, sel = name.rpartition(":")
    if sep and sel in SELECTORS:
        return (box or None), sel
    return None, name


def resolve_snapshot(repo, name: str, *, box: str | None = None, filters: Filters = NO_FILTERS) -> Manifest:
    """The manifest ``name`` selects (see the module docstring); SnapshotNotFound with a one-line reason."""
    return select_snapshot(repo, name, box=box, filters=filters)[0]


def select_snapshot(repo, name: str, *, box: str | None = None,
                    filters: Filters = NO_FILTERS) -> tuple[Manifest, list[Manifest]]:
    """The manifest ``name`` selects, and the newer partial snapshots a bare ``latest`` passed over."""
    named_box, sel = split_selector(name)
    if sel not in SELECTORS:
        if not _HEX.match(name):
            raise SnapshotNotFound(f"{name!r} is not a snapshot id (hex digits) nor a selector "
                                   "(latest, latest-checkpoint, BOX:latest, BOX:latest-checkpoint)")
        m = repo.resolve(name.lower())
        if not filters.matches(m):
            raise SnapshotNotFound(f"snapshot {m['id'][:12]} does not match {filters.describe()}")
        return m, []
    snaps = repo.list_snapshots()
    if not snaps:
        raise SnapshotNotFound(f"{repo.store.url} has no snapshots yet")
    want = named_box or box or (None if filters.hosts else default_box(repo))
    mine = [m for m in snaps if want is None or box_of(m) == want]
    if not mine:
        others = sorted({box_of(m) for m in snaps})
        hint = f" (boxes here: {', '.join(others[:8])}; name one as BOX:{sel})" if others else ""
        raise SnapshotNotFound(f"{repo.store.url} has no snapshot of box {want!r}{hint}")
    picked = [m for m in mine if filters.matches(m)]
    if not picked:
        whose = f"box {want!r}" if want is not None else "the repository"
        raise SnapshotNotFound(f"no snapshot of {whose} matches {filters.describe()}")
    if sel == "latest-checkpoint":
        return _latest_checkpoint(picked, want or "/".join(filters.hosts)), []
    if filters.paths:
        return picked[-1], []
    best = widest(picked)[-1]
    return best, picked[picked.index(best) + 1:]


def _latest_checkpoint(mine: list[Manifest], box: str) -> Manifest:
    held = [(m, ck) for m in mine if (ck := checkpoint_of(m)) is not None]
    if not held:
        raise SnapshotNotFound(f"no snapshot of box {box!r} holds a coherent training checkpoint")
    run = held[-1][1]["run"]  # the run the box trains now: that of its newest checkpoint-holding snapshot
    same_run = [(i, m, ck) for i, (m, ck) in enumerate(held) if ck["run"] == run]
    return max(same_run, key=lambda t: (_progress(t[2]), t[0]))[1]
