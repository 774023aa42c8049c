"""``ogrefs prune``: delete packs no snapshot needs, safely next to live writers and mounts.

Deletion takes two prune runs (docs/format.md, "Deleting data"):

1. A pack that no catalog references is *marked*: listed in a ``trash/<id>``
   record with the time of marking. New snapshots treat trashed packs as
   absent and upload those chunks again rather than reference them.
2. A later prune deletes a marked pack only if it is still unreferenced *and*
   no live lock (snapshot or mount) is older than the marking plus the allowed
   clock skew: such a holder may have looked at the pack before it was marked
   (a snapshot about to reference it, a mount of a forgotten snapshot still
   reading it). A marked pack that a catalog references again is unmarked.

Before marking, packs whose referenced blobs take less than half their bytes
are repacked (repack.py): the live blobs move to new packs, the catalogs that
used them are rewritten, and the old packs become unreferenced and go through
the same two phases.

Afterwards the index is rewritten as one consolidated object listing only the
packs that remain, and the old index objects are deleted.

Runs under the prune lock; never waits for shared locks.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

from . import codec
from .catalog import Catalog
from .errors import OgrefsError
from .repo import Repository
from .repo.index import decode_index
from .repo.locks import CLOCK_SKEW_S, HeldLock, read_locks
from .repo.pack import pack_key
from .repack import plan_repack, repack
from .store.base import NotFound


@dataclass
class PruneReport:
    packs_total: int = 0
    referenced: int = 0
    newly_marked: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)  # marked, but a live lock predates the marking
    unmarked: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    pending_bytes: int = 0  # bytes in marked packs that a later prune will free
    repack: list[str] = field(default_factory=list)  # mostly unused packs whose live blobs were (or would be) moved
    repack_bytes: int = 0  # live bytes copied by the repack
    repack_skipped: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"packs_total": self.packs_total, "referenced": self.referenced,
                "newly_marked": len(self.newly_marked), "deleted": len(self.deleted),
                "deferred": len(self.deferred), "unmarked": len(self.unmarked),
                "freed_bytes": self.freed_bytes, "pending_bytes": self.pending_bytes,
                "repacked": len(self.repack), "repack_bytes": self.repack_bytes, "repack_skipped": self.repack_skipped}


def read_trash(repo: Repository) -> tuple[dict[str, float], list[str]]:
    """{pack: time marked} from every trash record, and the record keys."""
    marked: dict[str, float] = {}
    keys = []
    for key in repo.store.list("trash/"):
        try:
            body = json.loads(codec.unwrap(repo.store.get(key), key))
        except NotFound:
            continue
        keys.append(key)
        for pack, when in body.get("packs", {}).items():
            marked[pack] = min(when, marked.get(pack, when))
    return marked, keys


def referenced_packs(repo: Repository) -> set[str]:
    return set(usage(repo)[0])


def usage(repo: Repository) -> tuple[dict[str, dict[bytes, tuple[int, int, int]]], dict[str, set[str]]]:
    """Per pack, the referenced blobs {chunk: (offset, stored_len, raw_len)}; per snapshot, its packs."""
    used: dict[str, dict[bytes, tuple[int, int, int]]] = {}
    by_snapshot: dict[str, set[str]] = {}
    for sid in repo.snapshot_ids():
        try:
            cat = Catalog(repo.catalog_path(sid))
            blobs = list(cat.all_blobs())
        except OgrefsError:
            raise OgrefsError(f"snapshot {sid[:12]}: catalog unreadable; refusing to prune (run `ogrefs check`)")
        packs = by_snapshot[sid] = set()
        for chunk, pack, off, slen, rlen in blobs:
            used.setdefault(pack, {})[chunk] = (off, slen, rlen)
            packs.add(pack)
    return used, by_snapshot


def prune(repo: Repository, dry_run: bool = False, log: Callable[[str], None] | None = None,
          repack_below: float = 0.5) -> PruneReport:
    """Mark and delete unreferenced packs; first repack packs used below ``repack_below`` (0 = never)."""
    report = PruneReport()
    with HeldLock(repo.store, "prune", "prune"):
        packs = {k.rsplit("/", 1)[1] for k in repo.store.list("packs/")}
        report.packs_total = len(packs)
        used_blobs, by_snapshot = usage(repo)
        used = set(used_blobs)
        sizes: dict[str, int] = {}
        index_keys = list(repo.store.list("index/"))
        entries_by_pack: dict[str, dict[bytes, tuple]] = {}
        for key in index_keys:
            try:
                obj = repo.store.get(key)
            except NotFound:
                continue  # consolidated away by a finishing snapshot meanwhile
            for cid, pack, off, slen, rlen in decode_index(obj, key, repo.codec):
                entries_by_pack.setdefault(pack, {})[cid] = (cid, pack, off, slen, rlen)
                sizes[pack] = max(sizes.get(pack, 0), off + slen)
        marked, trash_keys = read_trash(repo)
        if repack_below > 0:
            report.repack = plan_repack(used_blobs, sizes, repack_below, exclude=set(marked) | (used - packs))
            report.repack_bytes = sum(slen for p in report.repack for _o, slen, _r in used_blobs[p].values())
            if report.repack and not dry_run:
                moved = repack(repo, report.repack, used_blobs, by_snapshot)
                report.repack_skipped = moved.skipped
                used_blobs, by_snapshot = usage(repo)  # the rewritten catalogs point at the new packs
                used = set(used_blobs)
        report.referenced = len(packs & used)
        now = time.time()
        live = [lk for lk in read_locks(repo.store) if lk.kind == "shared" and not lk.stale(now)]
        oldest_live = min((lk.created for lk in live), default=float("inf"))
        keep_marked: dict[str, float] = {}
        for pack, when in marked.items():
            if pack not in packs:
                continue  # already gone
            if pack in used:
                report.unmarked.append(pack)
            elif oldest_live < when + CLOCK_SKEW_S:
                report.deferred.append(pack)
                keep_marked[pack] = when
                report.pending_bytes += sizes.get(pack, 0)
            else:
                report.deleted.append(pack)
                report.freed_bytes += sizes.get(pack, 0)
        for pack in sorted(packs - used - set(marked)):
            report.newly_marked.append(pack)
            keep_marked[pack] = now
            report.pending_bytes += sizes.get(pack, 0)
        if log:
            log(f"{report.packs_total} packs, {report.referenced} referenced; "
                f"{len(report.deleted)} to delete, {len(report.newly_marked)} newly unreferenced, "
                f"{len(report.deferred)} waiting for older locks")
        if dry_run:
            return report
        # Record the trash first: if we die after it, nothing is lost.
        new_trash = f"trash/{secrets.token_hex(16)}"
        repo.store.put(new_trash, codec.wrap(json.dumps({"packs": keep_marked}).encode()))
        for key in trash_keys:
            repo.store.delete(key)
        if report.deleted:
            gone = set(report.deleted)
            remaining = [e for pack, es in entries_by_pack.items() if pack not in gone and pack in packs
                         for e in es.values()]
            name = f"pruned-{secrets.token_hex(16)}"
            repo.write_index(name, remaining)
            for key in index_keys:
                repo.store.delete(key)
            for pack in report.deleted:
                repo.store.delete(pack_key(pack))
    return report
