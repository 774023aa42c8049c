"""``ogrefs copy``: snapshots from one repository into another, sending only missing chunks.

A snapshot keeps its id in the destination, so a second copy skips it, once
it has checked what the destination holds under that id: a manifest that
opens (digest, or authentication when encrypted) and is the source's, a catalog that verifies
and parses, and every chunk the catalog names known to the destination's
index in a pack that exists and is not trash.  Anything less (an object a
bucket writer planted under the id, a damaged or half-deleted copy) is
copied again, over it, and reported as repaired: "already in the destination"
means the destination can restore it.  Its
chunks are looked up in the destination's index: those already there are not
sent again. When both repositories name chunks alike (both unencrypted, or the
same key) that is decided from the catalog alone; otherwise (an encrypted
side: chunk ids are keyed BLAKE3) each chunk is fetched and verified to learn
its destination id, and sent only if that id is missing. Chunks are decoded
and encoded again for the destination (its encryption and compression level).
The copied catalog is rewritten with the destination's ids and packs
(``catalog.rewrite_blobs``); the manifest is stored last, so an interrupted
copy leaves only packs that a later copy or prune reuses or removes.

Both repositories carry a shared lock for the whole copy (prune on either side
must not delete what is being read or not yet referenced). Runs in the calling thread.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ogrefs.errors import OgrefsError
from ogrefs.repo.catalog import Catalog, rewrite_blobs
from ogrefs.repo.trash import read_trash
from ogrefs.repo import Repository
from ogrefs.repo.pack import BlobLocation
from ogrefs.store.base import NotFound

_PROBE = b"ogrefs copy: do both repositories name chunks alike?"


@dataclass
class CopyReport:
    copied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # already in the destination, checked restorable
    repaired: dict[str, str] = field(default_factory=dict)  # in the destination but not restorable -> why; copied
    chunks_sent: int = 0
    chunks_present: int = 0
    bytes_sent: int = 0  # stored bytes uploaded in new packs

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _Uploader:
    """Packs chunks for the destination; ``moves`` maps source chunk id -> (destination id, location)."""

    def __init__(self, dst: Repository, report: CopyReport, live: set[str]) -> None:
        self.dst, self.report, self.live = dst, report, live
        self.builder = dst.new_pack()
        self.pending: list[tuple[bytes, bytes]] = []  # (source id, destination id) in the open pack
        self.moves: dict[bytes, tuple[bytes, BlobLocation]] = {}
        self.sent: dict[bytes, BlobLocation] = {}  # destination id -> where this copy put it
        self.in_open_pack: set[bytes] = set()

    def add(self, src_id: bytes, dst_id: bytes, data: bytes) -> None:
        if dst_id in self.sent:
            self.moves[src_id] = (dst_id, self.sent[dst_id])
            return
        self.pending.append((src_id, dst_id))
        if dst_id in self.in_open_pack:
            return
        self.in_open_pack.add(dst_id)
        self.builder.add(dst_id, self.dst.codec.encode_blob(dst_id, data), len(data))
        if self.builder.size >= self.dst.config.pack_target_size:
            self.seal()

    def seal(self) -> None:
        if not len(self.builder):
            return
        name, body, entries = self.builder.finish()
        self.builder = self.dst.new_pack()
        self.dst.put_pack(name, body)
        rows = [(cid, name, off, slen, rlen) for cid, off, slen, rlen in entries]
        self.dst.write_index(name, rows)
        self.dst.index.add(rows, merged_name=name)
        self.live.add(name)
        where = {cid: BlobLocation(name, off, slen, rlen) for cid, off, slen, rlen in entries}
        self.sent.update(where)
        for src_id, dst_id in self.pending:
            self.moves[src_id] = (dst_id, where[dst_id])
        self.report.chunks_sent += len(entries)
        self.report.bytes_sent += len(body)
        self.pending.clear()
        self.in_open_pack.clear()


def copy_snapshots(src: Repository, dst: Repository, manifests: list[dict[str, Any]],
                   log: Callable[[str], None] | None = None, meter=None) -> CopyReport:
    """``meter``: told of each snapshot's source packs to read (``grow(packs, bytes)``) and of each read."""
    report = CopyReport()
    with src.lock("shared", "copy (source)"), dst.lock("shared", "copy"):
        dst.index.sync()
        # only chunks in packs that exist and that prune has not marked for deletion count as present
        live = {k.rsplit("/", 1)[1] for k in dst.store.list("packs/")} - set(read_trash(dst)[0])
        have = set(dst.snapshot_ids())
        for m in manifests:
            if m["id"] in have:
                why = _unrestorable(dst, m, live)
                if why is None:
                    report.skipped.append(m["id"])
                    continue
                report.repaired[m["id"]] = why
            if log:
                log(f"copying snapshot {m['id'][:12]} ({m['time'][:19]}, {' '.join(m['paths'])})")
            _copy_one(src, dst, m, report, live, meter)
            report.copied.append(m["id"])
    return report


def _unrestorable(dst: Repository, manifest: dict[str, Any], live: set[str]) -> str | None:
    """Why the destination cannot restore what it holds under ``manifest``'s id as ``manifest``, or None when
    it can (as far as manifest, catalog and index tell: the packs' bytes are ``check --read-data``'s to read)."""
    snap_id = manifest["id"]
    try:
        if dst.load_manifest(snap_id) != manifest:
            return "its manifest is not the source's"
        for chunk, pack, _off, _slen, _rlen in Catalog(dst.catalog_path(snap_id)).all_blobs():
            if pack not in live or dst.index.lookup(chunk, live) is None:
                return f"a chunk of its catalog is missing (pack {pack[:12]})"
    except NotFound as exc:
        return f"incomplete ({exc})"
    except OgrefsError as exc:
        return str(exc)
    return None


def _copy_one(src: Repository, dst: Repository, manifest: dict[str, Any], report: CopyReport,
              live: set[str], meter=None) -> None:
    cat_path = src.catalog_path(manifest["id"])
    same_ids = src.codec.chunk_id(_PROBE) == dst.codec.chunk_id(_PROBE)
    up = _Uploader(dst, report, live)
    by_pack: dict[str, list[tuple[bytes, int, int, int]]] = {}
    for chunk, pack, off, slen, rlen in Catalog(cat_path).all_blobs():
        loc = dst.index.lookup(chunk, live) if same_ids else None
        if loc is not None:
            up.moves[chunk] = (chunk, loc)
            report.chunks_present += 1
        else:
            by_pack.setdefault(pack, []).append((chunk, off, slen, rlen))
    if meter is not None:
        meter.grow(len(by_pack), sum(_span(b) for b in by_pack.values()))
    for pack, blobs in sorted(by_pack.items()):
        _transfer_pack(src, dst, up, pack, sorted(blobs, key=lambda b: b[1]), report)
        if meter is not None:
            meter.advance(1, _span(blobs))
    up.seal()
    with tempfile.TemporaryDirectory(dir=dst.cache_dir, prefix="copy-") as tmp:
        rewritten = Path(tmp) / "catalog.sqlite"
        rewrite_blobs(cat_path, rewritten, up.moves)
        dst.put_catalog(manifest["id"], rewritten)
    dst.put_manifest(manifest)


def _span(blobs: list[tuple[bytes, int, int, int]]) -> int:
    """The bytes of the one ranged read that fetches ``blobs`` (chunk, offset, stored length, raw length)."""
    return max(off + slen for _c, off, slen, _r in blobs) - min(off for _c, off, _s, _r in blobs)


def _transfer_pack(src: Repository, dst: Repository, up: _Uploader, pack: str,
                   blobs: list[tuple[bytes, int, int, int]], report: CopyReport) -> None:
    """Fetch the blobs of one source pack in one ranged read, verify them, send those the destination lacks."""
    start = blobs[0][1]
    end = max(off + slen for _c, off, slen, _r in blobs)
    body = src.read_pack_range(pack, start, end - start)
    for chunk, off, slen, rlen in blobs:
        data = src.codec.decode_blob(body[off - start:off - start + slen], rlen, chunk)
        dst_id = dst.codec.chunk_id(data)
        loc = dst.index.lookup(dst_id, up.live)
        if loc is not None:
            up.moves[chunk] = (dst_id, loc)
            report.chunks_present += 1
        else:
            up.add(chunk, dst_id, data)
