"""``ogrefs cat KIND NAME``: one repository object, decoded (restic's ``cat``).

Structured objects come back as JSON-ready values, data (a chunk's verified
bytes, a catalog's SQLite file) as bytes. Nothing here writes to the repository.
"""

from __future__ import annotations

import json
from typing import Any

from ogrefs.errors import OgrefsError, UsageError
from ogrefs.repo import Repository


def show_object(repo: Repository, kind: str, name: str) -> Any:
    if kind == "config":
        return json.loads(repo.config.to_bytes())
    if kind in ("snapshot", "catalog"):
        from ogrefs.snapshot.selection import resolve_snapshot

        manifest = resolve_snapshot(repo, name)  # ids, prefixes and selectors, as every command takes them
        return manifest if kind == "snapshot" else repo.catalog_path(manifest["id"]).read_bytes()
    if kind == "key":
        return _one(_keys(repo), name, "key")
    if kind == "lock":
        from ogrefs.repo.locks import read_locks

        return _one({lk.id: lk.__dict__ for lk in read_locks(repo.store, repo.meta_codec)}, name, "lock")
    if kind == "index":
        return _index(repo, name)
    return _blob(repo, name)


def _keys(repo: Repository) -> dict[str, dict]:
    from ogrefs.repo.keys import list_keys

    return {p["id"]: {k: v for k, v in p.items() if k != "wrapped"} for p in list_keys(repo.store) if "id" in p}


def _one(items: dict[str, Any], prefix: str, what: str) -> Any:
    hits = [k for k in items if k.startswith(prefix)]
    if len(hits) != 1:
        raise OgrefsError(f"{'no' if not hits else 'more than one'} {what} matches {prefix!r}")
    return items[hits[0]]


def _index(repo: Repository, name: str) -> list[dict[str, Any]]:
    from ogrefs.repo.index import decode_index

    keys = [k for k in repo.store.list("index/") if k.rsplit("/", 1)[1].startswith(name)]
    if len(keys) != 1:
        raise OgrefsError(f"{'no' if not keys else 'more than one'} index object matches {name!r}")
    rows = decode_index(repo.store.get(keys[0]), keys[0], repo.codec)
    return [{"chunk": cid.hex(), "pack": pack, "offset": off, "stored_len": slen, "raw_len": rlen}
            for cid, pack, off, slen, rlen in rows]


def _blob(repo: Repository, name: str) -> bytes:
    try:
        cid = bytes.fromhex(name)
    except ValueError:
        raise UsageError(f"{name!r} is not a chunk id (64 hex digits)") from None
    if len(cid) != 32:
        raise UsageError(f"{name!r} is not a chunk id (64 hex digits)")
    repo.index.sync()
    loc = repo.index.lookup(cid)
    if loc is None:
        raise OgrefsError(f"chunk {name[:16]} is not in the repository's index")
    return repo.codec.decode_blob(repo.read_pack_range(loc.pack, loc.offset, loc.stored_len), loc.raw_len, cid)
