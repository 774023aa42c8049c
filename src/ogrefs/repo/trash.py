"""The trash records of two-phase deletion (docs/format.md, "Deleting data"): reading and writing them.

``maint/prune`` marks and deletes; ``snapshot`` must not reference a marked pack
and ``maint/check``/``copy`` report or skip them, so the record format lives
here, in the repository layer, where each of them can read it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Callable

from ogrefs.errors import CorruptObject
from ogrefs.repo import codec
from ogrefs.repo.repository import Repository
from ogrefs.store.base import NotFound

logger = logging.getLogger(__name__)
_PACK = re.compile(r"[0-9a-f]{64}")


#: Bound on a trash record's plaintext (a pack id and a time per pack: ~100 bytes each).
MAX_TRASH_BYTES = 64 * 1024 * 1024


@dataclass
class Trash:
    """What the trash records say: when each pack was marked and which snapshots could read it then."""

    marked: dict[str, float] = field(default_factory=dict)
    #: pack -> snapshots whose catalogs referenced it when it was marked (repack); None: unknown (old record)
    readers: dict[str, set[str] | None] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)  # every record read, malformed ones included
    malformed: list[str] = field(default_factory=list)


def parse_trash(plain: bytes, key: str) -> tuple[dict[str, float], dict[str, set[str] | None]]:
    """The content of one record; CorruptObject if it is not exactly the shape prune writes."""
    try:
        body = json.loads(plain)
    except (ValueError, RecursionError):
        raise CorruptObject(f"{key}: trash record is not JSON") from None
    packs = body.get("packs") if isinstance(body, dict) else None
    if not isinstance(packs, dict) or not all(
            isinstance(p, str) and _PACK.fullmatch(p) and type(t) in (int, float) and math.isfinite(t)
            for p, t in packs.items()):
        raise CorruptObject(f"{key}: trash record is malformed")
    readers_raw = body.get("readers", {})  # a record of an older ogrefs has none: every reader unknown
    if not (isinstance(readers_raw, dict) and all(
            v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)) for v in readers_raw.values())):
        raise CorruptObject(f"{key}: trash record is malformed (readers)")
    readers = {p: (None if readers_raw.get(p) is None else set(readers_raw[p])) for p in packs}
    return {p: float(t) for p, t in packs.items()}, readers


def load_trash(repo: Repository, warn: Callable[[str], None] | None = None) -> Trash:
    """Every trash record; a malformed one is reported (one line naming it) and contributes nothing."""
    trash = Trash()
    warn = warn or (lambda msg: logger.warning("warning: %s", msg))
    for key in repo.store.list("trash/"):
        try:
            obj = repo.store.get(key)
        except NotFound:
            continue
        trash.keys.append(key)
        try:
            rc = repo.meta_codec
            plain = (rc.open(key, obj, MAX_TRASH_BYTES) if rc is not None
                     else codec.unwrap(obj, key, MAX_TRASH_BYTES))
            marked, readers = parse_trash(plain, key)
        except CorruptObject as exc:
            trash.malformed.append(key)
            warn(f"skipped trash record {key}: {exc}")
            continue
        for pack, when in marked.items():
            if pack not in trash.marked or when < trash.marked[pack]:
                trash.marked[pack] = when
            old, new = trash.readers.get(pack, set()), readers[pack]
            trash.readers[pack] = None if (old is None or new is None) else old | new
    return trash


def read_trash(repo: Repository) -> tuple[dict[str, float], list[str]]:
    """{pack: time marked} from every readable trash record, and the record keys."""
    trash = load_trash(repo)
    return trash.marked, trash.keys


def write_trash(repo: Repository, marked: dict[str, float], readers: dict[str, set[str] | None]) -> str:
    key = f"trash/{secrets.token_hex(16)}"
    body = {"packs": marked, "readers": {p: None if readers.get(p) is None else sorted(readers[p]) for p in marked}}
    plain = json.dumps(body).encode()
    rc = repo.meta_codec
    repo.store.put(key, rc.seal(key, plain) if rc is not None else codec.wrap(plain))
    return key
