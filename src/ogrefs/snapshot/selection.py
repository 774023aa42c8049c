"""Which snapshot a name means: ids, ``latest`` of a box, and the most advanced coherent checkpoint.

A snapshot belongs to a *box*: a name that survives moves between machines
(``snapshot --box``, else the box of the snapshot the machine runs from, else
this machine's own box, :func:`machine_box`; manifests written before boxes
existed belong to their host).

Why a machine's own box is not its host name alone: machines made from one
cloned image share their host name, and two boxes under one name take each
other's snapshots for their own (``latest`` restored the other's files, the
agent's retention forgot the other's).  :func:`machine_box` is the host name
and 8 hex digits of a hash of the machine id (``/etc/machine-id``, unique per
installation; systemd makes a new one on a clone's first boot) and, where
cloud-init left it, the cloud instance id (unique per instance even when an
image kept its machine id).  Snapshots of an older ogrefs carry the host
name alone: they stay listed and selectable by name (``HOST:latest``), and
a box adopts that name on purpose with ``OGREFS_BOX=HOST`` (or ``--box``);
``latest`` never falls back to it by itself, since that name may be another
machine's too.

Selectors, as the CLI takes them (``show``, ``restore``, ``mount``, ``diff``,
``forget``, ``tag``, ``ls``, ``dump``, ``snapshot --parent``):

* a full snapshot id or a unique prefix of one;
* ``latest``: the newest snapshot of *this* box (``$OGREFS_BOX``, else the box
  of the snapshot this machine runs from, else :func:`machine_box`), never
  another box's; ``BOX:latest`` names the box. A snapshot whose paths all lie
  inside those of another snapshot of the box (``/srv/box/proj`` beside
  ``/srv/box``, anything beside a whole-box ``/``) is a *partial* one: a bare
  ``latest`` passes over it, so one quick snapshot of a directory never
  decides what a restore or the next boot brings back; ``--path`` picks it
  (:func:`widest`);
* ``latest-checkpoint`` / ``BOX:latest-checkpoint``: of the box's snapshots,
  the one holding the most advanced coherent training checkpoint (step, then
  epoch; the newest snapshot breaks ties) of the run its newest
  checkpoint-holding snapshot trains, so a later snapshot that holds an older
  or torn checkpoint is never taken for progress; except where the newest
  snapshot's checkpoint was written after that most advanced one: a run
  restarted in the same directory, which its framework resumes from.

Every selector is narrowed by :class:`Filters` (``--path``, ``--tag``,
``--host``, as restic's): ``--path`` keeps the snapshots whose recorded paths
are exactly the given set, ``--tag`` those carrying every given tag,
``--host`` those taken on one of the given hosts (and ``latest`` is then
that host's newest, whatever its box). A snapshot named by id must match
them too: a mismatch is an error, never a silent pick.

Pure functions of the manifests; no threads.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import stat
from dataclasses import dataclass
from typing import Any

from ogrefs.errors import SnapshotNotFound
from ogrefs.repo.repository import box_of

__all__ = ["SELECTORS", "box_of", "checkpoint_of", "default_box", "machine_box", "resolve_snapshot",
           "split_selector"]

Manifest = dict[str, Any]
_HEX = re.compile(r"^[0-9a-f]{1,64}$", re.IGNORECASE)
SELECTORS = ("latest", "latest-checkpoint")


#: Where the machine id is (systemd's, then D-Bus's older place) and cloud-init's record of the instance.
MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")
INSTANCE_ID_FILE = "/var/lib/cloud/data/instance-id"


def _read_id(path: str) -> bytes:
    """The first line of a small file, or b"" (missing, unreadable, not a regular file: never blocks on a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        return os.read(fd, 256).split(b"\n", 1)[0].strip()
    except OSError:
        return b""
    finally:
        os.close(fd)


def machine_box(host: str | None = None) -> str:
    """This machine's own box: ``HOST-xxxxxxxx`` (see the module docstring); the host name alone when the
    machine has no machine id."""
    host = host or socket.gethostname()
    machine = next((i for i in map(_read_id, MACHINE_ID_FILES) if i), b"")
    return box_name(host, machine, _read_id(INSTANCE_ID_FILE))


def box_name(host: str, machine_id: bytes, instance_id: bytes = b"") -> str:
    """The box of a machine with this host name, machine id and cloud instance id (the host name alone
    without a machine id): what :func:`machine_box` reads, named here so a lab can say it of another root."""
    if not machine_id:
        return host
    digest = hashlib.sha256(b"ogrefs box\0" + machine_id + b"\0" + instance_id).hexdigest()
    return f"{host}-{digest[:8]}"


def default_box(repo=None) -> str:
    """``$OGREFS_BOX``, else the box of the snapshot this machine runs from (in ``repo``), else this machine's."""
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
    return machine_box()


def checkpoint_of(m: Manifest) -> dict[str, Any] | None:
    """The coherent checkpoint a snapshot holds: {run, step, epoch, path, mtime} of its latest coherent one, or None."""
    env = m.get("environment")
    ck = ((env or {}).get("checkpoints") or {}).get("latest_coherent") if isinstance(env, dict) else None
    if not isinstance(ck, dict) or not ck.get("coherent"):
        return None
    step, epoch = ck.get("step"), ck.get("epoch")
    return {"run": ck.get("run"), "step": step if isinstance(step, int) else None,
            "epoch": epoch if isinstance(epoch, (int, float)) else None, "path": ck.get("path"),
            "mtime": ck["mtime"] if isinstance(ck.get("mtime"), (int, float)) else None}


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
        raise SnapshotNotFound(_no_such_box(repo.store.url, snaps, want, sel, bool(named_box or box)))
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


def _no_such_box(url: str, snaps: list[Manifest], want: str | None, sel: str, named: bool) -> str:
    """One line for a box with no snapshot here: whose box that was, every box the repository holds, what to type.

    On a new machine nobody named a box yet: ``latest`` means this machine's
    own (``HOST-xxxxxxxx``), which has none. The line says so, lists the boxes
    (``ogrefs snapshots`` shows them too) and both ways to name the one to
    bring back: ``BOX:latest`` for one command, ``OGREFS_BOX=BOX`` for good
    (``/etc/ogrefs/env``, which the boot's unit reads: README).
    """
    boxes = sorted({box_of(m) for m in snaps})
    listed = ", ".join(boxes[:16]) + (f" and {len(boxes) - 16} more (ogrefs snapshots)" if len(boxes) > 16 else "")
    env = os.environ.get("OGREFS_BOX")
    whose = (f"box {want!r}" if named or (env and env == want) else
             f"this machine's own box {want!r} (OGREFS_BOX is not set)" if want == machine_box() else f"box {want!r}")
    line = (f"{url} has no snapshot of {whose}; boxes here: {listed}; name the box to bring back: "
            f"BOX:{sel}, or OGREFS_BOX=BOX (in /etc/ogrefs/env for the units)")
    host = socket.gethostname()
    if not named and host in boxes:  # snapshots of an older ogrefs, named by the host alone
        line += f"; to adopt box {host!r} as this box's own: OGREFS_BOX={host}"
    return line


def _latest_checkpoint(mine: list[Manifest], box: str) -> Manifest:
    held = [(m, ck) for m in mine if (ck := checkpoint_of(m)) is not None]
    if not held:
        raise SnapshotNotFound(f"no snapshot of box {box!r} holds a coherent training checkpoint")
    run = held[-1][1]["run"]  # the run the box trains now: that of its newest checkpoint-holding snapshot
    same_run = [(i, m, ck) for i, (m, ck) in enumerate(held) if ck["run"] == run]
    best = max(same_run, key=lambda t: (_progress(t[2]), t[0]))
    newest = same_run[-1]
    # A run restarted in the same directory saves a lower step later, and resumes from it (the
    # capture's latest coherent checkpoint follows the framework's resume rule): written after the
    # most advanced one, it is the state to go back to.
    if newest[2]["mtime"] is not None and best[2]["mtime"] is not None and newest[2]["mtime"] > best[2]["mtime"]:
        return newest[1]
    return best[1]
