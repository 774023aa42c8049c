"""``ogrefs check``: prove that every snapshot can be restored.

Without ``--read-data``: every manifest and catalog decodes, every pack that a
catalog references exists, and every indexed pack exists.  With it, every
referenced pack is downloaded and every blob in it is decoded and verified
against its BLAKE3 id; the pack trailer must agree with the catalogs; and
every catalog's tree is walked, so a malformed row, extents that do not lay
out their file, or an entry that restore would refuse (a name such as ``..``,
a directory loop) is reported. Index objects and trash records that do not
decode are reported by name.

A missing pack is one problem naming every snapshot that needs it. With
``--read-data-subset`` only part of the referenced packs is downloaded, as
restic does: ``N/T`` takes the packs whose name's first byte is N-1 modulo T
(so T runs with N = 1..T check everything, each pack once), ``P%`` a random
P percent of the packs, ``SIZE`` (``500M``, ``2G``) random packs up to about
that many bytes (each pack counted at the repository's pack size).
"""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from ogrefs.repo.catalog import Catalog
from ogrefs.errors import CorruptObject, OgrefsError, UsageError
from ogrefs.repo.trash import load_trash
from ogrefs.repo import Repository
from ogrefs.repo.index import decode_index
from ogrefs.repo.pack import pack_key, read_header
from ogrefs.store.base import NotFound, StoreError


@dataclass
class CheckReport:
    snapshots: int = 0
    packs: int = 0
    blobs: int = 0
    read_bytes: int = 0
    packs_read: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_pack(repo: Repository, name: str, expected: dict[bytes, tuple[int, int, int]]) -> tuple[list[str], int, int]:
    """Download one pack and verify it; returns (problems, blobs checked, bytes read)."""
    problems: list[str] = []
    try:
        body = repo.store.get(pack_key(name))
    except NotFound:
        return [f"pack {name[:16]} is missing"], 0, 0
    except StoreError as exc:
        return [f"pack {name[:16]}: {exc}"], 0, 0
    try:
        entries = read_header(body, name, repo.codec, repo.config.sealed_metadata, f"pack {name[:16]}")
    except CorruptObject as exc:
        return [str(exc)], 0, len(body)
    by_id = {cid: (off, slen, rlen) for cid, off, slen, rlen in entries}
    checked = 0
    for cid, (off, slen, rlen) in by_id.items():
        try:
            repo.codec.decode_blob(body[off:off + slen], rlen, cid)
        except CorruptObject as exc:
            problems.append(f"pack {name[:16]}: {exc}")
        checked += 1
    for cid, loc in expected.items():
        if by_id.get(cid) != loc:
            problems.append(f"pack {name[:16]}: chunk {cid.hex()[:16]} is not where the catalog says")
    return problems, checked, len(body)


@dataclass(frozen=True)
class Subset:
    """Which referenced packs ``--read-data-subset`` downloads (see the module docstring)."""

    kind: str  # "slice", "percent" or "bytes"
    n: int = 0
    t: int = 0
    percent: float = 0.0
    max_bytes: int = 0

    @classmethod
    def parse(cls, text: str) -> "Subset":
        text = text.strip()
        if m := re.fullmatch(r"(\d+)/(\d+)", text):
            n, t = int(m.group(1)), int(m.group(2))
            if not 1 <= n <= t:
                raise UsageError(f"--read-data-subset {text}: N/T needs 1 <= N <= T")
            return cls("slice", n=n, t=t)
        if m := re.fullmatch(r"(\d+(?:\.\d+)?)%", text):
            p = float(m.group(1))
            if not 0 < p <= 100:
                raise UsageError(f"--read-data-subset {text}: a percentage is above 0 and at most 100")
            return cls("percent", percent=p)
        if m := re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT])", text, re.IGNORECASE):
            size = float(m.group(1)) * 1024 ** ("KMGT".index(m.group(2).upper()) + 1)
            if size < 1:
                raise UsageError(f"--read-data-subset {text}: a size above zero")
            return cls("bytes", max_bytes=int(size))
        raise UsageError(f"--read-data-subset {text!r}: expected N/T (e.g. 1/5), P% (e.g. 10%) or a size (e.g. 2G)")

    def choose(self, packs: dict[str, int], rng: random.Random | None = None) -> set[str]:
        """The packs to download, of ``packs`` (name -> size in the store)."""
        rng = rng or random.Random()
        if self.kind == "slice":
            return {p for p in packs if int(p[:2], 16) % self.t == self.n - 1}
        order = sorted(packs)
        rng.shuffle(order)
        if self.kind == "percent":
            return set(order[:max(1, round(len(order) * self.percent / 100))]) if order else set()
        chosen, total = set(), 0
        for p in order:
            if chosen and total + packs[p] > self.max_bytes:
                break
            chosen.add(p)
            total += packs[p]
        return chosen


def _check_tree(cat: Catalog) -> None:
    """Walk every entry and read every file's extents: malformed rows raise, unsafe names land in ``rejected``."""
    for _path, node in cat.walk():
        if node.is_reg:
            cat.extents(node.ino)
        cat.xattrs(node.ino)


def check_repository(repo: Repository, read_data: bool = False, workers: int = 4,
                     progress: Callable[[str], None] | None = None, subset: Subset | None = None,
                     meter=None) -> CheckReport:
    """``meter``: told of the packs to read (``grow(packs, bytes)``) and of each one read (``advance``)."""
    report = CheckReport()
    packs = {k.rsplit("/", 1)[1] for k in repo.store.list("packs/")}
    missing: set[str] = set()  # referenced but not in the store: reported once, never downloaded
    needed_by: dict[str, list[str]] = {}  # missing pack -> the snapshots that reference it
    expected: dict[str, dict[bytes, tuple[int, int, int]]] = {}
    for sid in repo.snapshot_ids():
        try:
            manifest = repo.load_manifest(sid)
            cat = Catalog(repo.catalog_path(sid))
        except (OgrefsError, StoreError) as exc:
            report.problems.append(f"snapshot {sid[:12]}: {exc}")
            continue
        report.snapshots += 1
        if progress:
            progress(f"snapshot {sid[:12]} ({manifest.get('time', '?')})")
        try:
            for chunk, pack, off, slen, rlen in cat.all_blobs():
                if pack not in packs:
                    missing.add(pack)
                    if sid[:12] not in needed_by.setdefault(pack, []):
                        needed_by[pack].append(sid[:12])
                    continue
                expected.setdefault(pack, {})[chunk] = (off, slen, rlen)
            if read_data:
                _check_tree(cat)
        except OgrefsError as exc:
            report.problems.append(f"snapshot {sid[:12]}: {exc}")
            continue
        for (parent, name), reason in sorted(cat.rejected.items()):
            report.problems.append(f"snapshot {sid[:12]}: catalog entry {name!r} in directory inode {parent} "
                                   f"cannot be restored: {reason}")
    for pack, sids in needed_by.items():
        report.problems.append(f"pack {pack[:16]} is missing; snapshot{'s' if len(sids) > 1 else ''} "
                               f"{', '.join(sids)} cannot be restored whole")
    for name in repo.store.list("index/"):
        try:
            for _cid, pack, *_ in decode_index(repo.store.get(name), name, repo.codec):
                if pack not in packs and pack not in missing:
                    report.problems.append(f"{name}: refers to missing pack {pack[:16]}")
                    missing.add(pack)
        except (OgrefsError, StoreError) as exc:
            report.problems.append(f"{name}: {exc}")
    load_trash(repo, warn=report.problems.append)  # a malformed trash record is a problem to fix, not a crash
    report.packs = len(expected) + len(missing)
    if read_data or subset is not None:
        todo = expected
        if subset is not None:
            # (the store lists names, not sizes: a pack counts as the repository's pack size)
            chosen = subset.choose({p: repo.config.pack_target_size for p in expected})
            todo = {p: e for p, e in expected.items() if p in chosen}
        report.packs_read = len(todo)
        if meter is not None:
            meter.grow(len(todo), sum(max(off + slen for off, slen, _r in e.values()) for e in todo.values()))
        with ThreadPoolExecutor(workers) as pool:
            for problems, checked, nbytes in pool.map(lambda kv: _check_pack(repo, kv[0], kv[1]), todo.items()):
                report.problems.extend(problems)
                report.blobs += checked
                report.read_bytes += nbytes
                if meter is not None:
                    meter.advance(1, nbytes)
    return report
