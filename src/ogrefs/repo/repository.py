"""Open, create and read a repository: config, manifests, catalogs, packs, index.

A Repository is shared by the threads of one command; the store it wraps is
thread-safe, the manifest cache is written through atomic renames, and the
chunk index documents its own threading rules.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable

from .. import codec
from ..errors import CorruptObject, NoRepository, RepositoryError, SnapshotNotFound
from ..store import open_store
from ..store.base import NotFound, RangeReader, Store, StoreError
from .config import RepoConfig
from .index import ChunkIndex, IndexEntry, encode_index
from .keys import Secret, add_key, open_master
from .pack import TAIL_SIZE, pack_key, parse_header, parse_trailer_tail

Manifest = dict[str, Any]

#: The first bytes of an envelope identify its content: magic, version, codec and the
#: plaintext digest (or, encrypted, the random nonce). Enough to tell a rewritten catalog.
CATALOG_STAMP_BYTES = 38

_HEX = re.compile(r"^[0-9a-f]{1,64}$")


def default_cache_dir() -> Path:
    """``$OGREFS_CACHE_DIR``, else ``$XDG_CACHE_HOME/ogrefs``, else ``~/.cache/ogrefs``."""
    env = os.environ.get("OGREFS_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ogrefs"


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _check_manifest_fields(m: Manifest, what: str) -> None:
    """The fields every reader relies on have the right types (a malformed object is corrupt, not a crash)."""
    ok = (isinstance(m.get("time"), str) and isinstance(m.get("host"), str)
          and isinstance(m.get("paths"), list) and all(isinstance(p, str) for p in m["paths"])
          and isinstance(m.get("tags", []), list) and all(isinstance(t, str) for t in m.get("tags", []))
          and isinstance(m.get("totals", {}), dict)
          and (m.get("parent") is None or isinstance(m.get("parent"), str)))
    if not ok:
        raise CorruptObject(f"{what}: manifest fields have the wrong types")


class Repository:
    def __init__(self, store: Store, config: RepoConfig, cache_root: Path | None = None,
                 master: bytes | None = None, key_id: str | None = None) -> None:
        self.store = store
        self.config = config
        root = cache_root or default_cache_dir()
        for d in (root, root / "repos"):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.cache_dir = root / "repos" / config.id
        self.cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if config.encryption and master is None:
            raise RepositoryError(f"{store.url}: repository is encrypted; a passphrase or key file is needed")
        self.key_id = key_id
        self._master = master
        self.codec = codec.RepoCodec(config.compression_level, master[:32] if master else None,
                                     master[32:] if master else None)
        self._index: ChunkIndex | None = None

    # -- opening ----------------------------------------------------------------
    @classmethod
    def init(cls, url: str, *, s3_endpoint: str | None = None, cache_root: Path | None = None,
             pack_target_size: int | None = None, compression_level: int = 3,
             secret: Secret | None = None) -> "Repository":
        """Create a repository; with ``secret``, an encrypted one whose first key it wraps."""
        store = open_store(url, s3_endpoint=s3_endpoint)
        if store.exists("config"):
            raise RepositoryError(f"{store.url}: a repository already exists here")
        kwargs: dict = {"compression_level": compression_level}
        if pack_target_size:
            kwargs["pack_target_size"] = pack_target_size
        master = key_id = None
        if secret is not None:
            kwargs["encryption"] = "aes-256-gcm"
            master = os.urandom(64)
            key_id = add_key(store, master, secret, label="initial")["id"]
        config = RepoConfig.new(**kwargs)
        store.put("config", config.to_bytes())
        return cls(store, config, cache_root, master, key_id)

    @classmethod
    def open(cls, url: str, *, s3_endpoint: str | None = None, cache_root: Path | None = None,
             store: Store | None = None, secret: Secret | None = None,
             secret_source: "Callable[[], Secret] | None" = None) -> "Repository":
        """Open a repository; an encrypted one needs ``secret`` (or asks ``secret_source`` for it)."""
        store = store or open_store(url, s3_endpoint=s3_endpoint)
        try:
            raw = store.get("config")
        except NotFound:
            raise NoRepository(f"{store.url}: no ogrefs repository here (run `ogrefs init` first)") from None
        config = RepoConfig.from_bytes(raw, store.url)
        master = key_id = None
        if config.encryption:
            if secret is None:
                if secret_source is None:
                    raise RepositoryError(f"{store.url}: repository is encrypted; give a passphrase or key file")
                secret = secret_source()
            master, key_id = open_master(store, secret)
        elif any(True for _ in store.list("keys/")):
            # Keys exist but the config says plaintext: someone replaced the config.
            raise RepositoryError(f"{store.url}: config says unencrypted but key objects exist; refusing "
                                  "(a replaced config would make new data leave this box in plaintext)")
        return cls(store, config, cache_root, master, key_id)

    def add_key(self, secret: Secret, label: str = "") -> dict:
        if self._master is None:
            raise RepositoryError("repository is not encrypted; it has no keys")
        return add_key(self.store, self._master, secret, label)

    # -- packs and index ---------------------------------------------------------
    @property
    def index(self) -> ChunkIndex:
        if self._index is None:
            self._index = ChunkIndex(self.store, self.cache_dir / "index.sqlite", self.codec)
        return self._index

    def put_pack(self, name: str, body: bytes) -> None:
        self.store.put(pack_key(name), body)

    def read_pack_range(self, pack: str, offset: int, length: int) -> bytes:
        return self.store.get_range(pack_key(pack), offset, length)

    def open_pack_range(self, pack: str, offset: int, length: int) -> RangeReader:
        """A pack range as a stream (the fetcher hands out chunks as they arrive)."""
        return self.store.open_range(pack_key(pack), offset, length)

    def write_index(self, name: str, entries: list[IndexEntry]) -> None:
        self.store.put(f"index/{name}", encode_index(entries, self.codec, f"index/{name}"))

    def read_pack_header(self, name: str) -> list[tuple[bytes, int, int, int]]:
        """A pack's own list of blobs, from its trailer.

        Only used for orphans (at most a few per interrupted run), so it reads
        the whole pack rather than widening the store interface with a HEAD.
        """
        key = pack_key(name)
        body = self.store.get(key)
        header_len = parse_trailer_tail(body[-TAIL_SIZE:], key, len(body))
        header = body[len(body) - TAIL_SIZE - header_len:len(body) - TAIL_SIZE]
        return parse_header(header, len(body), key)

    def recover_orphan_packs(self, live_packs: set[str]) -> int:
        """Index packs that have no index entry (an interrupted run's last uploads)."""
        known = self.index.packs()
        recovered = 0
        for name in sorted(live_packs - known):
            try:
                entries = self.read_pack_header(name)
            except (CorruptObject, NotFound):
                continue  # unreadable packs are check's business, never referenced
            rows = [(cid, name, off, slen, rlen) for cid, off, slen, rlen in entries]
            self.write_index(name, rows)
            self.index.add(rows, merged_name=name)
            recovered += 1
        return recovered

    # -- manifests ---------------------------------------------------------------
    def put_manifest(self, manifest: Manifest) -> None:
        body = json.dumps(manifest, sort_keys=True).encode()
        self.store.put(f"snapshots/{manifest['id']}", self.codec.seal(f"snapshots/{manifest['id']}", body))

    def load_manifest(self, snap_id: str) -> Manifest:
        cached = self.cache_dir / "manifests" / snap_id
        try:
            obj = cached.read_bytes()
        except FileNotFoundError:
            try:
                obj = self.store.get(f"snapshots/{snap_id}")
            except NotFound:
                raise SnapshotNotFound(f"no snapshot {snap_id} in {self.store.url}") from None
            self.codec.open(f"snapshots/{snap_id}", obj)
            _atomic_write(cached, obj)
        try:
            manifest = json.loads(self.codec.open(f"snapshots/{snap_id}", obj))
        except (ValueError, RecursionError):
            raise CorruptObject(f"snapshots/{snap_id}: manifest is not valid JSON") from None
        if not isinstance(manifest, dict) or manifest.get("id") != snap_id:
            raise CorruptObject(f"snapshots/{snap_id}: manifest does not describe this snapshot")
        _check_manifest_fields(manifest, f"snapshots/{snap_id}")
        return manifest

    def snapshot_ids(self) -> list[str]:
        return [k.rsplit("/", 1)[1] for k in self.store.list("snapshots/")]

    def list_snapshots(self, on_error: "Callable[[str, Exception], None] | None" = None) -> list[Manifest]:
        """Every readable manifest, oldest first.

        Without ``on_error`` an unreadable manifest is an error (retention and
        prune must not decide on a partial list); with it, it is reported and skipped.
        """
        out = []
        for i in self.snapshot_ids():
            try:
                out.append(self.load_manifest(i))
            except CorruptObject as exc:
                if on_error is None:
                    raise
                on_error(i, exc)
        out.sort(key=lambda m: (m.get("time", ""), m["id"]))
        return out

    def resolve(self, name: str) -> Manifest:
        """A snapshot by full id, unique id prefix, or ``latest``."""
        if name == "latest":
            snaps = self.list_snapshots()
            if not snaps:
                raise SnapshotNotFound(f"{self.store.url} has no snapshots yet")
            return snaps[-1]
        if not _HEX.match(name):
            raise SnapshotNotFound(f"{name!r} is not a snapshot id (hex digits) nor 'latest'")
        matches = [i for i in self.snapshot_ids() if i.startswith(name)]
        if not matches:
            raise SnapshotNotFound(f"no snapshot matches {name!r} in {self.store.url}")
        if len(matches) > 1:
            raise SnapshotNotFound(f"{name!r} is ambiguous: {len(matches)} snapshots start with it")
        return self.load_manifest(matches[0])

    # -- catalogs ----------------------------------------------------------------
    def put_catalog(self, snap_id: str, db_path: Path) -> int:
        obj = self.codec.seal(f"catalogs/{snap_id}", db_path.read_bytes())
        self.store.put(f"catalogs/{snap_id}", obj)
        return len(obj)

    def replace_catalog(self, snap_id: str, db_path: Path) -> None:
        """Store a rewritten catalog (prune's repack) and refresh the local cache with it."""
        key = f"catalogs/{snap_id}"
        obj = self.codec.seal(key, db_path.read_bytes())
        self.store.put(key, obj)
        path = self.cache_dir / "catalogs" / f"{snap_id}.sqlite"
        _atomic_write(path, db_path.read_bytes())
        _atomic_write(path.with_suffix(".stamp"), obj[:CATALOG_STAMP_BYTES])

    def catalog_path(self, snap_id: str) -> Path:
        """The snapshot's catalog as a local SQLite file, cached.

        Catalogs change only when prune repacks (their chunk locations move), so
        a cached copy is checked against the first bytes of the stored object
        (its digest, or its nonce when encrypted: one small ranged GET) and
        fetched again when they differ. A store that cannot be reached leaves
        the cached copy in use.
        """
        key = f"catalogs/{snap_id}"
        path = self.cache_dir / "catalogs" / f"{snap_id}.sqlite"
        stamp_path = path.with_suffix(".stamp")
        if path.exists() and stamp_path.exists():
            try:
                current = self.store.get_range(key, 0, CATALOG_STAMP_BYTES)
            except NotFound:
                raise CorruptObject(f"catalog of snapshot {snap_id[:12]} is missing from the repository") from None
            except StoreError:
                return path  # offline: the cached copy is the best there is
            if current == stamp_path.read_bytes():
                return path
        try:
            obj = self.store.get(key)
        except NotFound:
            raise CorruptObject(f"catalog of snapshot {snap_id[:12]} is missing from the repository") from None
        _atomic_write(path, self.codec.open(key, obj))
        _atomic_write(stamp_path, obj[:CATALOG_STAMP_BYTES])
        return path
