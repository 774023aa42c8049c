"""``ogrefs prune``: delete packs no snapshot needs, safely next to live writers and mounts.

Deletion has two phases (docs/format.md, "Deleting data"):

1. A pack that no catalog references is *marked*: listed in a ``trash/<id>``
   record with the time of marking (and, for repacked packs, the snapshots
   that read them then). New snapshots treat trashed packs as absent and
   upload those chunks again rather than reference them.
2. A marked pack is deleted once it is still unreferenced *and* no live lock
   may read it: a lock older than the marking plus the allowed clock skew
   may have looked at the pack before it was marked (a snapshot about to
   reference it, a mount of a forgotten snapshot still reading it), except a
   mount whose snapshot still exists and did not read the pack (the lock
   names its snapshot). With no such lock the pack goes in the run that
   marked it, after the marks are written and the locks read again; else a
   later run deletes it. A marked pack that a catalog references again is
   unmarked.

A malformed trash record is reported and skipped (its packs are marked again
with the current time); it never makes anything be deleted.

Before marking, packs whose referenced blobs take less than half their bytes
are repacked (repack.py): the live blobs move to new packs, the catalogs that
used them are rewritten, and the old packs become unreferenced and go through
the same two phases.

Afterwards the index is rewritten as one consolidated object listing only the
packs that remain, and the old index objects are deleted.

First of all, a file store's temporary files that puts of killed processes
left (``.tmp-*``, invisible to listings) are removed once untouched for
``STALE_TEMPORARY_S``: a live put writes and renames its file within seconds.

Runs under the prune lock; never waits for shared locks.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

from ogrefs.repo.catalog import Catalog
from ogrefs.errors import CorruptObject, OgrefsError
from ogrefs.repo import Repository
from ogrefs.repo.fetchmany import in_order
from ogrefs.repo.index import decode_index
from ogrefs.repo.locks import CLOCK_SKEW_S, LockInfo, read_locks
from ogrefs.repo.pack import pack_key
from ogrefs.repo.trash import load_trash, write_trash
from ogrefs.maint.repack import plan_repack, repack
from ogrefs.store.base import NotFound

logger = logging.getLogger(__name__)
_PACK = re.compile(r"[0-9a-f]{64}")
#: A file store's temporary file untouched this long is a killed put's (a put writes and renames at once).
STALE_TEMPORARY_S = 3600.0


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
    stale_temporaries: int = 0  # files interrupted puts left (a file store's .tmp-*), removed
    stale_temporary_bytes: int = 0

    def as_dict(self) -> dict:
        return {"packs_total": self.packs_total, "referenced": self.referenced,
                "newly_marked": len(self.newly_marked), "deleted": len(self.deleted),
                "deferred": len(self.deferred), "unmarked": len(self.unmarked),
                "freed_bytes": self.freed_bytes, "pending_bytes": self.pending_bytes,
                "repacked": len(self.repack), "repack_bytes": self.repack_bytes, "repack_skipped": self.repack_skipped,
                "stale_temporaries": self.stale_temporaries, "stale_temporary_bytes": self.stale_temporary_bytes}


def protected(pack_readers: set[str] | None, when: float, locks: list[LockInfo], snapshots: set[str]) -> bool:
    """Whether a live lock may still read a pack marked at ``when``.

    A lock created later saw the mark (its holder reads the trash after
    taking it). An older one protects the pack unless it is a mount whose
    snapshot still exists and did not reference the pack when it was marked:
    such a mount reads only its own snapshot's packs.
    """
    for lk in locks:
        if lk.created >= when + CLOCK_SKEW_S:
            continue
        if lk.snapshot is None or lk.snapshot not in snapshots or pack_readers is None or lk.snapshot in pack_readers:
            return True
    return False


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


def _read_index(repo: Repository) -> tuple[list[str], dict[str, dict[bytes, tuple]], dict[str, int]]:
    """Index keys, entries by pack, and pack sizes; an index object that does not decode is skipped."""
    index_keys = list(repo.store.list("index/"))
    entries_by_pack: dict[str, dict[bytes, tuple]] = {}
    sizes: dict[str, int] = {}
    for key, fetched in in_order(lambda k: list(decode_index(repo.store.get(k), k, repo.codec)), index_keys):
        try:
            entries = fetched()
        except NotFound:
            continue  # consolidated away by a finishing snapshot meanwhile
        except CorruptObject as exc:
            logger.warning("warning: skipped index object %s: %s", key, exc)
            continue  # its packs are indexed again from their headers by the next snapshot
        for cid, pack, off, slen, rlen in entries:
            entries_by_pack.setdefault(pack, {})[cid] = (cid, pack, off, slen, rlen)
            sizes[pack] = max(sizes.get(pack, 0), off + slen)
    return index_keys, entries_by_pack, sizes


def _live_locks(repo: Repository) -> list[LockInfo]:
    now = time.time()
    return [lk for lk in read_locks(repo.store, repo.meta_codec) if lk.kind == "shared" and not lk.stale(now)]


def prune(repo: Repository, dry_run: bool = False, log: Callable[[str], None] | None = None,
          repack_below: float = 0.5, meter=None) -> PruneReport:
    """Mark and delete unreferenced packs; first repack packs used below ``repack_below`` (0 = never).

    ``meter``: told of the packs to repack and to delete (``grow(packs, bytes)``) and of each one done."""
    report = PruneReport()
    with repo.lock("prune", "prune"):
        report.stale_temporaries, report.stale_temporary_bytes = repo.store.remove_stale_temporaries(
            STALE_TEMPORARY_S, dry_run)
        packs = {k.rsplit("/", 1)[1] for k in repo.store.list("packs/")}
        report.packs_total = len(packs)
        used_blobs, by_snapshot = usage(repo)
        index_keys, entries_by_pack, sizes = _read_index(repo)
        trash = load_trash(repo)
        readers: dict[str, set[str] | None] = dict(trash.readers)
        if repack_below > 0:
            report.repack = plan_repack(used_blobs, sizes, repack_below, exclude=set(trash.marked) | (set(used_blobs) - packs))
            report.repack_bytes = sum(slen for p in report.repack for _o, slen, _r in used_blobs[p].values())
            if report.repack and not dry_run:
                moved = repack(repo, report.repack, used_blobs, by_snapshot, meter)
                report.repack_skipped = moved.skipped
                for pack in report.repack:  # mounts of these snapshots may still read the old packs
                    readers[pack] = {sid for sid, ps in by_snapshot.items() if pack in ps}
                used_blobs, by_snapshot = usage(repo)  # the rewritten catalogs point at the new packs
        used = set(used_blobs)
        snapshots = set(by_snapshot)
        report.referenced = len(packs & used)
        now = time.time()
        live = _live_locks(repo)
        keep_marked: dict[str, float] = {}
        for pack, when in trash.marked.items():
            if pack not in packs:
                continue  # already gone
            if pack in used:
                report.unmarked.append(pack)
            elif protected(readers.get(pack), when, live, snapshots):
                report.deferred.append(pack)
                keep_marked[pack] = when
                report.pending_bytes += sizes.get(pack, 0)
            else:
                report.deleted.append(pack)
                report.freed_bytes += sizes.get(pack, 0)
        for pack in sorted(packs - used - set(trash.marked)):
            report.newly_marked.append(pack)
            keep_marked[pack] = now
            readers.setdefault(pack, set())
        if log:
            log(f"{report.packs_total} packs, {report.referenced} referenced; "
                f"{len(report.deleted)} to delete, {len(report.newly_marked)} newly unreferenced, "
                f"{len(report.deferred)} waiting for older locks")
        if dry_run:
            _delete_unread_now(report, keep_marked, readers, now, live, snapshots, sizes)
            return report
        # Record the trash first: if we die after it, nothing is lost.
        write_trash(repo, keep_marked, {p: readers.get(p) for p in keep_marked})
        for key in trash.keys:
            repo.store.delete(key)
        # Only now, with the marks written, are the locks read again: a holder that took its lock
        # after this read sees the marks and never uses these packs.
        _delete_unread_now(report, keep_marked, readers, now, _live_locks(repo), snapshots, sizes)
        if report.deleted:
            gone = set(report.deleted)
            remaining = [e for pack, es in entries_by_pack.items() if pack not in gone and pack in packs
                         for e in es.values()]
            name = f"pruned-{secrets.token_hex(16)}"
            repo.write_index(name, remaining)
            for key in index_keys:
                repo.store.delete(key)
            if meter is not None:
                meter.grow(len(report.deleted), sum(sizes.get(p, 0) for p in report.deleted))
            for pack in report.deleted:
                repo.store.delete(pack_key(pack))
                if meter is not None:
                    meter.advance(1, sizes.get(pack, 0))
    return report


def _delete_unread_now(report: PruneReport, keep_marked: dict[str, float], readers: dict[str, set[str] | None],
                       now: float, live: list[LockInfo], snapshots: set[str], sizes: dict[str, int]) -> None:
    """Packs marked in this run that no live lock can read are deleted in this run, not a later one.

    Without this a ``forget --prune`` whose repack copied live blobs left the
    repository larger than before (new packs written, old ones only marked).
    """
    for pack in list(report.newly_marked):
        if protected(readers.get(pack), now, live, snapshots):
            report.pending_bytes += sizes.get(pack, 0)
            continue
        report.newly_marked.remove(pack)
        report.deleted.append(pack)
        report.freed_bytes += sizes.get(pack, 0)
        keep_marked.pop(pack, None)
