"""What a snapshot owns in the store besides packs, and how it moves or goes.

A snapshot is its manifest (``snapshots/<id>``), its catalog
(``catalogs/<id>``) and the access traces its mounts recorded
(``traces/<id>/...``, :mod:`ogrefs.repo.traces`); packs are shared and only
``prune`` frees them. ``forget`` (and the agent's retention) removes all three
kinds, so no trace is left that no snapshot will ever replay; ``tag``, which
gives a snapshot a new id, carries its traces to the new id so the next
mount of the retagged snapshot still replays them.

Blocking store calls for the calling thread; nothing here is shared.
"""

from __future__ import annotations

import logging

from ogrefs.errors import CorruptObject
from ogrefs.repo import Repository
from ogrefs.repo.traces import decode_trace, encode_trace, trace_prefix
from ogrefs.store.base import NotFound

log = logging.getLogger(__name__)


def carry_traces(repo: Repository, old_id: str, new_id: str) -> int:
    """Store every readable trace of ``old_id`` again under ``new_id`` (same names: they sort by age).

    Each is re-sealed for its new key (an encrypted object is bound to its
    key) and names the new id. An unreadable trace is skipped with a warning,
    as a mount would skip it. Returns how many were carried.
    """
    carried = 0
    old_prefix, new_prefix = trace_prefix(old_id), trace_prefix(new_id)
    for key in sorted(repo.store.list(old_prefix)):
        try:
            entries = decode_trace(repo.codec.open(key, repo.store.get(key)), key)
        except NotFound:
            continue
        except CorruptObject as exc:
            log.warning("not carrying access trace %s to %s: %s", key, new_id[:12], exc)
            continue
        new_key = new_prefix + key[len(old_prefix):]
        repo.store.put(new_key, repo.codec.seal(new_key, encode_trace(entries, snap_id=new_id)))
        carried += 1
    return carried


def remove_snapshot(repo: Repository, snap_id: str) -> None:
    """Delete a snapshot's manifest first (it is then gone for every reader), then its catalog and traces."""
    repo.store.delete(f"snapshots/{snap_id}")
    repo.store.delete(f"catalogs/{snap_id}")
    for key in list(repo.store.list(trace_prefix(snap_id))):
        repo.store.delete(key)
