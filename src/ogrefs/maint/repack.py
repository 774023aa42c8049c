"""Repack packs that are mostly unused (part of ``ogrefs prune``).

A pack whose referenced blobs take less than ``threshold`` of its bytes
(after ``forget``, say) is rewritten: its referenced blobs are copied, as
stored (an encrypted blob stays bound to its chunk id), into new packs that
get their own index object; then every catalog that pointed into the old
pack is rewritten with the new locations (``Repository.replace_catalog``;
readers notice the change through the catalog's stamp). The old packs are
then unreferenced, and the ordinary two-phase deletion of ``prune`` removes
them once no lock older than their marking is alive: a mount or a snapshot
that still uses an old catalog keeps its packs until it is done.

Runs inside prune's lock, in the calling thread.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ogrefs.repo.catalog import Catalog, rewrite_blobs
from ogrefs.errors import CorruptObject
from ogrefs.repo import Repository
from ogrefs.repo.pack import BlobLocation


@dataclass
class RepackReport:
    packs: list[str] = field(default_factory=list)  # old packs whose blobs were moved
    moved_blobs: int = 0
    moved_bytes: int = 0
    new_packs: list[str] = field(default_factory=list)
    catalogs_rewritten: int = 0
    skipped: list[str] = field(default_factory=list)  # blobs left where they were (failed verification)


def plan_repack(used: dict[str, dict[bytes, tuple[int, int, int]]], sizes: dict[str, int],
                threshold: float, exclude: set[str]) -> list[str]:
    """Packs whose referenced bytes are below ``threshold`` of their size (and not empty: those just go)."""
    out = []
    for pack, blobs in used.items():
        size = sizes.get(pack, 0)
        if pack in exclude or not blobs or size <= 0:
            continue
        if sum(slen for _off, slen, _rlen in blobs.values()) < threshold * size:
            out.append(pack)
    return sorted(out)


def repack(repo: Repository, candidates: list[str], used: dict[str, dict[bytes, tuple[int, int, int]]],
           snapshots: dict[str, set[str]], meter=None) -> RepackReport:
    """Move the referenced blobs of ``candidates`` into new packs and rewrite the catalogs that used them.

    ``snapshots`` maps each snapshot id to the packs its catalog references. ``meter``: told of the packs
    to read (``grow``) and of each one read (``advance``).
    """
    report = RepackReport()
    moves: dict[tuple[str, bytes], BlobLocation] = {}
    builder = repo.new_pack()
    in_builder: list[tuple[str, bytes]] = []  # (old pack, chunk) of the blobs in the open new pack

    def seal() -> None:
        nonlocal builder
        if not len(builder):
            return
        name, body, entries = builder.finish()
        builder = repo.new_pack()
        repo.put_pack(name, body)
        repo.write_index(name, [(cid, name, off, slen, rlen) for cid, off, slen, rlen in entries])
        where = {cid: BlobLocation(name, off, slen, rlen) for cid, off, slen, rlen in entries}
        for old_pack, cid in in_builder:
            moves[(old_pack, cid)] = where[cid]
        in_builder.clear()
        report.new_packs.append(name)

    spans = {p: (min(off for off, _s, _r in used[p].values()), max(off + slen for off, slen, _r in used[p].values()))
             for p in candidates}
    if meter is not None:
        meter.grow(len(candidates), sum(end - start for start, end in spans.values()))
    for pack in candidates:
        blobs = sorted(used[pack].items(), key=lambda kv: kv[1][0])
        start, end = spans[pack]
        body = repo.read_pack_range(pack, start, end - start)
        if meter is not None:
            meter.advance(1, end - start)
        for cid, (off, slen, rlen) in blobs:
            blob = body[off - start:off - start + slen]
            try:
                repo.codec.decode_blob(blob, rlen, cid)  # never copy a damaged blob into a new pack
            except CorruptObject as exc:
                report.skipped.append(f"chunk {cid.hex()[:16]} in pack {pack[:16]}: {exc}")
                continue
            builder.add(cid, bytes(blob), rlen)
            in_builder.append((pack, cid))
            report.moved_blobs += 1
            report.moved_bytes += slen
            if builder.size >= repo.config.pack_target_size:
                seal()
        report.packs.append(pack)
    seal()
    repacked = set(candidates)
    for sid, packs in snapshots.items():
        if packs & repacked:
            _rewrite_catalog(repo, sid, moves)
            report.catalogs_rewritten += 1
    return report


def _rewrite_catalog(repo: Repository, sid: str, moves: dict[tuple[str, bytes], BlobLocation]) -> None:
    """Snapshot ``sid``'s catalog with the repacked blobs at their new places (the same rewrite as ``copy``'s)."""
    src = repo.catalog_path(sid)
    relocated = {chunk: (chunk, moves.get((pack, chunk)) or BlobLocation(pack, off, slen, rlen))
                 for chunk, pack, off, slen, rlen in Catalog(src).all_blobs()}
    with tempfile.TemporaryDirectory(dir=repo.cache_dir, prefix="repack-") as tmp:
        copy = Path(tmp) / "catalog.sqlite"
        rewrite_blobs(src, copy, relocated)  # checked as a readable catalog before it replaces the old one
        repo.replace_catalog(sid, copy)
