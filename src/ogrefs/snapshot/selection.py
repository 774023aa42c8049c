"""Which snapshot a name means: ids, ``latest`` of a box, and the most advanced coherent checkpoint.

A snapshot belongs to a *box*: a name that survives moves between machines
(``snapshot --box``, else the box of the snapshot the machine runs from, else
the host name; manifests written before boxes existed belong to their host).

Selectors, as the CLI takes them (``show``, ``restore``, ``mount``, ``diff``,
``forget``, ``tag``, ``ls``, ``dump``, ``snapshot --parent``):

* a full snapshot id or a unique prefix of one;
* ``latest``: the newest snapshot of *this* box (``$OGREFS_BOX``, else the box
  of the snapshot this machine runs from, else the host name), never another
  box's; ``BOX:latest`` names the box;
* ``latest-checkpoint`` / ``BOX:latest-checkpoint``: of the box's snapshots,
  the one holding the most advanced coherent training checkpoint (step, then
  epoch; the newest snapshot breaks ties) of the run its newest
  checkpoint-holding snapshot trains, so a later snapshot that holds an older
  or torn checkpoint is never taken for progress.

Pure functions of the manifests; no threads.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Any

from ogrefs.errors import SnapshotNotFound

Manifest = dict[str, Any]
_HEX = re.compile(r"^[0-9a-f]{1,64}$")
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


def split_selector(name: str) -> tuple[str | None, str]:
    """``BOX:latest`` -> (BOX, latest); ``latest`` -> (None, latest); anything else -> (None, name)."""
    box, sep, sel = name.rpartition(":")
    if sep and sel in SELECTORS:
        return (box or None), sel
    return None, name


def resolve_snapshot(repo, name: str, *, box: str | None = None) -> Manifest:
    """The manifest ``name`` selects (see the module docstring); SnapshotNotFound with a one-line reason."""
    named_box, sel = split_selector(name)
    if sel not in SELECTORS:
        if not _HEX.match(name):
            raise SnapshotNotFound(f"{name!r} is not a snapshot id (hex digits) nor a selector "
                                   "(latest, latest-checkpoint, BOX:latest, BOX:latest-checkpoint)")
        return repo.resolve(name)
    want = named_box or box or default_box(repo)
    snaps = repo.list_snapshots()
    mine = [m for m in snaps if box_of(m) == want]
    if not snaps:
        raise SnapshotNotFound(f"{repo.store.url} has no snapshots yet")
    if not mine:
        others = sorted({box_of(m) for m in snaps})
        hint = f" (boxes here: {', '.join(others[:8])}; name one as BOX:{sel})" if others else ""
        raise SnapshotNotFound(f"{repo.store.url} has no snapshot of box {want!r}{hint}")
    if sel == "latest":
        return mine[-1]
    return _latest_checkpoint(mine, want)


def _latest_checkpoint(mine: list[Manifest], box: str) -> Manifest:
    held = [(m, ck) for m in mine if (ck := checkpoint_of(m)) is not None]
    if not held:
        raise SnapshotNotFound(f"no snapshot of box {box!r} holds a coherent training checkpoint")
    run = held[-1][1]["run"]  # the run the box trains now: that of its newest checkpoint-holding snapshot
    same_run = [(i, m, ck) for i, (m, ck) in enumerate(held) if ck["run"] == run]
    return max(same_run, key=lambda t: (_progress(t[2]), t[0]))[1]
