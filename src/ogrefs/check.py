"""``ogrefs check``: prove that every snapshot can be restored.

Without ``--read-data``: every manifest and catalog decodes, every pack that a
catalog references exists, and every indexed pack exists.  With it, every
referenced pack is downloaded and every blob in it is decoded and verified
against its BLAKE3 id; the pack trailer must agree with the catalogs; and
every catalog's tree is walked, so a malformed row, extents that do not lay
out their file, or an entry that restore would refuse (a name such as ``..``,
a directory loop) is reported. Index objects and trash records that do not
decode are reported by name.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from .catalog import Catalog
from .errors import CorruptObject, OgrefsError
from .prune import load_trash
from .repo import Repository
from .repo.index import decode_index
from .repo.pack import pack_key, read_header
from .store.base import NotFound, StoreError


@dataclass
class CheckReport:
    snapshots: int = 0
    packs: int = 0
    blobs: int = 0
    read_bytes: int = 0
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


def _check_tree(cat: Catalog) -> None:
    """Walk every entry and read every file's extents: malformed rows raise, unsafe names land in ``rejected``."""
    for _path, node in cat.walk():
        if node.is_reg:
            cat.extents(node.ino)
        cat.xattrs(node.ino)


def check_repository(repo: Repository, read_data: bool = False, workers: int = 4,
                     progress: Callable[[str], None] | None = None) -> CheckReport:
    report = CheckReport()
    packs = {k.rsplit("/", 1)[1] for k in repo.store.list("packs/")}
    missing: set[str] = set()  # referenced but not in the store: reported once, never downloaded
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
                    if pack not in missing:
                        report.problems.append(f"snapshot {sid[:12]}: pack {pack[:16]} is missing")
                        missing.add(pack)
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
    if read_data:
        with ThreadPoolExecutor(workers) as pool:
            for problems, checked, nbytes in pool.map(lambda kv: _check_pack(repo, kv[0], kv[1]), expected.items()):
                report.problems.extend(problems)
                report.blobs += checked
                report.read_bytes += nbytes
    return report
