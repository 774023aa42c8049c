"""The stored access-trace format: what a trace object holds, where it lives, and which one a mount replays.

A trace is a list of ``(path, file offset)`` entries: the first touch of each
chunk of each file during a mount's first minutes, in order (recorded by
:mod:`ogrefs.lazy.trace.recorder`, replayed by :mod:`ogrefs.lazy.trace.replay`).  Paths,
not inode numbers, so a trace recorded on one snapshot also serves a *newer*
snapshot of the same paths.

Storage (docs/format.md, "Traces"): ``traces/<snapshot-id>/<time>-<random>``,
an envelope (encrypted like every other object of an encrypted repository,
the key as associated data) of JSON.  Keys sort by age.  Traces are hints: an
unreadable one is skipped with a warning, never an error.

Blocking functions for any thread; nothing here has an event loop (the
repository layer never does).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Iterable

from ogrefs.errors import CorruptObject
from ogrefs.store.base import NotFound, StoreError

if TYPE_CHECKING:
    from ogrefs.repo.repository import Repository

log = logging.getLogger(__name__)

TRACE_FORMAT = "ogrefs-trace"
TRACE_VERSION = 1

Entry = tuple[bytes, int]  # (absolute path in the snapshot, file offset)


def trace_prefix(snap_id: str) -> str:
    """Where the traces of one snapshot live in the store."""
    return f"traces/{snap_id}/"


def new_trace_key(snap_id: str) -> str:
    """A fresh key under the snapshot's prefix: UTC time (keys sort by age), then 8 random hex digits."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    return f"{trace_prefix(snap_id)}{stamp}-{secrets.token_hex(4)}"


def merge_traces(current: Iterable[Entry], previous: Iterable[Entry] | None, *, limit: int) -> list[Entry]:
    """``current`` in order, then the entries of ``previous`` it does not hold; at most ``limit``.

    This is how later traces refine earlier ones: a mount's own order first,
    then what the trace it replayed knew and this mount did not touch.
    """
    seen: dict[Entry, None] = {}
    for e in current:
        seen.setdefault(e, None)
    for e in previous or ():
        if len(seen) >= limit:
            break
        seen.setdefault(e, None)
    return list(seen)[:limit]


def encode_trace(entries: list[Entry], *, snap_id: str | None = None) -> bytes:
    """The JSON body of a trace object."""
    body = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "snapshot": snap_id,
            "created": datetime.now(timezone.utc).isoformat(),
            "entries": [[os.fsdecode(p), off] for p, off in entries]}
    return json.dumps(body, separators=(",", ":")).encode()


def _valid_entry(item: object) -> bool:
    return (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and item[0].startswith("/")
            and type(item[1]) is int and 0 <= item[1] < 2**63)


def decode_trace(data: bytes, what: str = "trace") -> list[Entry]:
    """Entries of a trace body; CorruptObject (one line) if it is not one.  Malformed entries are skipped."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        raise CorruptObject(f"{what} is not valid JSON") from None
    if not isinstance(body, dict) or body.get("format") != TRACE_FORMAT or not isinstance(body.get("entries"), list):
        raise CorruptObject(f"{what} is not an ogrefs trace")
    if body.get("version") != TRACE_VERSION:
        raise CorruptObject(f"{what} has trace version {body.get('version')!r}, this ogrefs reads {TRACE_VERSION}")
    out: list[Entry] = []
    for item in body["entries"]:
        if _valid_entry(item):
            try:
                out.append((os.fsencode(item[0]), item[1]))
            except UnicodeEncodeError:  # a lone surrogate that surrogateescape never produces (JSON "\ud800")
                continue
    return out


def store_trace(repo: Repository, snap_id: str, entries: list[Entry]) -> str:
    """Seal and store ``entries`` as a new trace of ``snap_id``; returns its key.  Blocking (a store put)."""
    key = new_trace_key(snap_id)
    repo.store.put(key, repo.codec.seal(key, encode_trace(entries, snap_id=snap_id)))
    return key


def newest_trace(repo: Repository, snap_id: str) -> tuple[str, list[Entry]] | None:
    """(key, entries) of the newest readable trace of one snapshot; unreadable ones are skipped with a warning."""
    try:
        keys = sorted(repo.store.list(trace_prefix(snap_id)), reverse=True)
    except StoreError as exc:
        log.warning("cannot list the traces of snapshot %s: %s", snap_id[:12], exc)
        return None
    for key in keys:
        try:
            return key, decode_trace(repo.codec.open(key, repo.store.get(key)), key)
        except NotFound:
            continue
        except (CorruptObject, StoreError) as exc:
            log.warning("skipping access trace %s: %s", key, exc)
    return None


@dataclass(frozen=True)
class FoundTrace:
    """The trace a mount replays: its key, its entries, and the manifest of the snapshot it was recorded on."""

    key: str | None
    entries: list[Entry] = field(default_factory=list)
    recorded_on: dict[str, Any] | None = None  # that snapshot's manifest (the mounted one, or an older one)


def _older_of_same_paths(repo: Repository, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Snapshots of the same paths older than ``manifest``, oldest first."""
    paths = sorted(manifest.get("paths", []))
    try:
        snaps = repo.list_snapshots()
    except (StoreError, CorruptObject) as exc:
        log.warning("cannot list snapshots to find an older access trace: %s", exc)
        return []
    return [m for m in snaps if m["id"] != manifest["id"] and sorted(m.get("paths", [])) == paths
            and (m.get("time", ""), m["id"]) < (manifest.get("time", ""), manifest["id"])]


def find_trace(repo: Repository, manifest: dict[str, Any]) -> FoundTrace:
    """The trace a mount of ``manifest`` should replay (``key`` None when there is none).  Blocking.

    The newest trace of this snapshot; else the newest trace of the newest
    *older* snapshot of the same paths (a new snapshot of the same box has
    none yet, and its paths are mostly the same files).
    """
    found = newest_trace(repo, manifest["id"])
    if found is not None:
        log.info("replaying access trace %s of this snapshot (%d entries)", found[0], len(found[1]))
        return FoundTrace(found[0], found[1], manifest)
    for m in reversed(_older_of_same_paths(repo, manifest)):
        found = newest_trace(repo, m["id"])
        if found is not None:
            log.info("no access trace of this snapshot yet; replaying %s of older snapshot %s (%d entries)",
                     found[0], m["id"][:12], len(found[1]))
            return FoundTrace(found[0], found[1], m)
    log.info("no access trace to replay (none for this snapshot or an older one of the same paths)")
    return FoundTrace(None)
