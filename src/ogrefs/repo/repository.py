"""Open, create and read a repository: config, manifests, catalogs, packs, index.

A Repository is shared by the threads of one command; the store it wraps is
thread-safe, the manifest cache is written through atomic renames, and the
chunk index documents its own threading rules. ``list_snapshots`` fetches the
manifests a box has not cached in a pool of threads that each only run
``load_manifest``; the caller's thread alone collects and sorts them.
``open`` reads the key objects in one thread of its own beside the config
(the thread only reads the store and returns what it read).

Nothing read back from the local cache is trusted: a cached manifest is an
envelope that verifies itself (and is fetched again when it fails), a cached
catalog is checked against the digest in the stored object's stamp (or, in an
encrypted repository, a keyed MAC only the key holder can make) on every
open, and index rows carry a checksum (index.py).  A box remembers which
repositories it has known as encrypted (``known.json`` under the cache root),
so a config replaced by a plaintext one is refused there (docs/format.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import os
import re
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import blake3

from ogrefs.repo import codec
from ogrefs.errors import CorruptObject, NoRepository, RepositoryError, SnapshotNotFound
from ogrefs.store import open_store
from ogrefs.store.base import NotFound, RangeReader, Store, StoreError
from ogrefs.repo.config import RepoConfig
from ogrefs.repo.fetchmany import in_order
from ogrefs.repo.index import ChunkIndex, IndexEntry, encode_index
from ogrefs.repo.keys import Secret, add_key, open_master, read_keys
from ogrefs.repo.locks import HeldLock
from ogrefs.repo.pack import PackBuilder, pack_key, read_header

log = logging.getLogger(__name__)

Manifest = dict[str, Any]

#: Bound on a manifest's plaintext: JSON of a few KB, plus the lists of skipped and unreadable paths.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024

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


def config_mac(config: RepoConfig, master: bytes) -> str:
    """The MAC that authenticates a config (format version 2): keyed BLAKE3 under a key from the master key."""
    key = blake3.blake3(master, derive_key_context="ogrefs 2026 config mac").digest()
    return blake3.blake3(config.mac_body(), key=key).hexdigest()


def _known_path(cache_root: Path) -> Path:
    return cache_root / "repos" / "known.json"


def _known(cache_root: Path) -> dict:
    try:
        data = json.loads(_known_path(cache_root).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _remember(cache_root: Path, url: str, config: RepoConfig, key_id: str | None = None) -> None:
    """Record that this box has known ``url`` (and its id) as encrypted or not, and with a MAC or not, and
    which key opened it here last (tried first next time: planted key objects then cost nothing)."""
    known = _known(cache_root)
    before = [e for e in (known.get(url), known.get(config.id)) if isinstance(e, dict)]
    # Once known as encrypted (or with a MAC), always: a later plaintext config is the attack.
    entry = {"id": config.id,
             "encrypted": bool(config.encryption) or any(bool(e.get("encrypted")) for e in before),
             "mac": bool(config.mac) or any(bool(e.get("mac")) for e in before)}
    if key_id:
        entry["key_id"] = key_id
    if known.get(url) == entry and known.get(config.id) == entry:
        return
    known[url] = known[config.id] = entry
    with contextlib.suppress(OSError):
        _atomic_write(_known_path(cache_root), json.dumps(known, sort_keys=True).encode())


def _refuse_downgrade(url: str, config: RepoConfig, cache_root: Path, expect_encrypted: bool) -> None:
    """A plaintext config where this box knows, or is told, the repository is encrypted: refused.

    A passphrase given for a repository this box has itself used unencrypted (same URL, same id)
    is no sign of a downgrade: one ``OGREFS_PASSWORD`` may serve several repositories.
    """
    known = _known(cache_root)
    was = [e for e in (known.get(url), known.get(config.id)) if isinstance(e, dict)]
    if not config.encryption:
        if any(e.get("encrypted") for e in was):
            raise RepositoryError(f"{url}: config says unencrypted, but this box has known the repository as "
                                  "encrypted; refusing (a replaced config would make data leave in plaintext; if "
                                  f"you replaced it on purpose, remove its entries from {_known_path(cache_root)})")
        used_plain = len(was) == 2 and all(e.get("id") == config.id for e in was)
        if expect_encrypted and not used_plain:
            raise RepositoryError(f"{url}: config says unencrypted although a passphrase or key file was given, "
                                  "and this box has never used it unencrypted; refusing (a replaced config would "
                                  "make data leave in plaintext)")
    elif not config.mac and any(e.get("mac") for e in was):
        raise RepositoryError(f"{url}: config has lost its MAC since this box last opened it; refusing (replaced?)")


def box_of(m: Manifest) -> str:
    """The box a manifest belongs to (older manifests: their host; snapshot/selection.py says what a box is)."""
    box = m.get("box")
    return box if isinstance(box, str) and box else str(m.get("host", ""))


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
        self.cache_root = root
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
            raise RepositoryError(f"{store.url}: already a repository (ogrefs snapshots lists what it holds)")
        if next(iter(store.list("")), None) is not None:  # a typo must not mix a repository into other files
            raise RepositoryError(f"{store.url}: not empty and not a repository; init needs an empty or new "
                                  "directory or prefix")
        kwargs: dict = {"compression_level": compression_level}
        if pack_target_size:
            kwargs["pack_target_size"] = pack_target_size
        master = key_id = None
        if secret is not None:
            kwargs["encryption"] = "aes-256-gcm"
            master = os.urandom(64)
            key_id = add_key(store, master, secret, label="initial")["id"]
        config = RepoConfig.new(**kwargs)
        if master is not None:
            config = dataclasses.replace(config, mac=config_mac(config, master))
        store.put("config", config.to_bytes())
        repo = cls(store, config, cache_root, master, key_id)
        _remember(repo.cache_root, store.url, config, key_id)
        return repo

    @classmethod
    def open(cls, url: str, *, s3_endpoint: str | None = None, cache_root: Path | None = None,
             store: Store | None = None, secret: Secret | None = None,
             secret_source: "Callable[[], Secret] | None" = None, expect_encrypted: bool = False) -> "Repository":
        """Open a repository; an encrypted one needs ``secret`` (or asks ``secret_source`` for it).

        A plaintext config is refused when a ``secret`` is given, when
        ``expect_encrypted`` (the user configured a passphrase or key file), or
        when this box has known the repository as encrypted: with write access
        to the bucket alone, nobody can make a box send its data in plaintext.
        """
        store = store or open_store(url, s3_endpoint=s3_endpoint)
        root = cache_root or default_cache_dir()
        # The key objects are read beside the config, not after it: either way they are needed (to
        # open the master key, or to refuse a plaintext config that keys contradict), and behind a
        # far link every request that waits for the one before costs a round trip.
        last = _known(root).get(store.url)
        prefer = last.get("key_id") if isinstance(last, dict) and isinstance(last.get("key_id"), str) else None
        with ThreadPoolExecutor(1, thread_name_prefix="ogrefs-keys") as pool:
            keys = pool.submit(read_keys, store, prefer)
            try:
                raw = store.get("config")
            except NotFound:
                raise NoRepository(f"{store.url}: no ogrefs repository here (run `ogrefs init` first)") from None
            return cls._opened(store, root, raw, keys, secret, secret_source, expect_encrypted, prefer)

    @classmethod
    def _opened(cls, store: Store, root: Path, raw: bytes, keys: "Future[tuple[list[str], list[dict]]]",
                secret: Secret | None, secret_source: "Callable[[], Secret] | None",
                expect_encrypted: bool, prefer: str | None = None) -> "Repository":
        """The repository whose config is ``raw``; ``keys``: the key objects, being read; ``prefer``: the key
        that opened it on this box last (known.json), tried first."""
        if len(raw) > 64 * 1024:
            raise RepositoryError(f"{store.url}: config is {len(raw)} bytes, not an ogrefs config")
        config = RepoConfig.from_bytes(raw, store.url)
        _refuse_downgrade(store.url, config, root, expect_encrypted or secret is not None)
        master = key_id = None
        if config.encryption:
            if secret is None:
                if secret_source is None:
                    raise RepositoryError(f"{store.url}: repository is encrypted; give a passphrase or key file")
                secret = secret_source()
            master, key_id = open_master(store, secret, keys.result()[1], prefer=prefer)
            if config.mac is not None and not hmac.compare_digest(config.mac, config_mac(config, master)):
                raise RepositoryError(f"{store.url}: config fails its MAC (altered or replaced); refusing")
        elif keys.result()[0]:
            # Keys exist but the config says plaintext: someone replaced the config.
            raise RepositoryError(f"{store.url}: config says unencrypted but key objects exist; refusing "
                                  "(a replaced config would make new data leave this box in plaintext)")
        repo = cls(store, config, root, master, key_id)
        _remember(root, store.url, config, key_id)
        return repo

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

    @property
    def meta_codec(self) -> codec.RepoCodec | None:
        """The codec of lock and trash records: sealed in version-2 encrypted repositories, else plain envelopes."""
        return self.codec if self.config.sealed_metadata else None

    def lock(self, kind: str, purpose: str, snapshot: str | None = None) -> HeldLock:
        """A lock object for this repository (not yet acquired), sealed where the format says so."""
        return HeldLock(self.store, kind, purpose, rc=self.meta_codec, snapshot=snapshot)

    def new_pack(self) -> PackBuilder:
        """A pack builder whose header is sealed in a version-2 encrypted repository."""
        return PackBuilder(self.codec if self.config.sealed_metadata else None)

    def pack_entries(self, name: str, body: bytes) -> list[tuple[bytes, int, int, int]]:
        """The entries of pack ``name`` from its whole bytes (its header, sealed or not, checked)."""
        return read_header(body, name, self.codec, sealed_required=self.config.sealed_metadata)

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
        return self.pack_entries(name, self.store.get(pack_key(name)))

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
        """Store ``manifest``; a cached copy of what was under its id before (``copy`` repairing a planted
        one) is dropped, so that this box reads the stored one next."""
        body = json.dumps(manifest, sort_keys=True).encode()
        self.store.put(f"snapshots/{manifest['id']}", self.codec.seal(f"snapshots/{manifest['id']}", body))
        with contextlib.suppress(FileNotFoundError):
            (self.cache_dir / "manifests" / manifest["id"]).unlink()

    def load_manifest(self, snap_id: str) -> Manifest:
        """A snapshot's manifest, from the local cache when it is there and verifies, else from the store.

        The cache holds the stored envelope itself, so it verifies like the
        original (digest or authentication tag); a cached copy that fails is
        dropped and fetched again, and only the store's own copy can be corrupt.
        """
        key = f"snapshots/{snap_id}"
        cached = self.cache_dir / "manifests" / snap_id
        try:
            obj = cached.read_bytes()
        except FileNotFoundError:
            obj = None
        if obj is not None:
            try:
                return self._parse_manifest(snap_id, obj)
            except CorruptObject as exc:
                log.warning("warning: cached copy of %s is damaged (%s); fetching it again", key, exc)
                with contextlib.suppress(OSError):
                    cached.unlink()
        try:
            obj = self.store.get(key)
        except NotFound:
            raise SnapshotNotFound(f"no snapshot {snap_id} in {self.store.url}") from None
        manifest = self._parse_manifest(snap_id, obj)
        _atomic_write(cached, obj)
        return manifest

    def _parse_manifest(self, snap_id: str, obj: bytes) -> Manifest:
        key = f"snapshots/{snap_id}"
        try:
            manifest = json.loads(self.codec.open(key, obj, MAX_MANIFEST_BYTES))
        except (ValueError, RecursionError):
            raise CorruptObject(f"{key}: manifest is not valid JSON") from None
        if not isinstance(manifest, dict) or manifest.get("id") != snap_id:
            raise CorruptObject(f"{key}: manifest does not describe this snapshot")
        _check_manifest_fields(manifest, key)
        return manifest

    def snapshot_ids(self) -> list[str]:
        return [k.rsplit("/", 1)[1] for k in self.store.list("snapshots/")]

    def list_snapshots(self, on_error: "Callable[[str, Exception], None] | None" = None,
                       strict: bool = False) -> list[Manifest]:
        """Every readable manifest, oldest first.

        An unreadable manifest (damaged, stray, deleted meanwhile) is skipped
        and reported to ``on_error`` (default: one warning line naming it), so
        one bad object never hides every other snapshot. ``strict``: it is an
        error instead (retention must not decide on a partial list).
        """
        out = []
        for i, loaded in self._load_manifests(self.snapshot_ids()):
            try:
                out.append(loaded())
            except (CorruptObject, SnapshotNotFound) as exc:
                if strict:
                    raise
                if isinstance(exc, SnapshotNotFound):
                    continue  # forgotten between the listing and the read
                if on_error is None:
                    log.warning("warning: skipped snapshot %s: %s", i[:12], exc)
                else:
                    on_error(i, exc)
        out.sort(key=lambda m: (m.get("time", ""), m["id"]))
        return out

    def _load_manifests(self, ids: list[str]) -> Iterator[tuple[str, Callable[[], Manifest]]]:
        """``(id, result)`` per manifest, in order; ``result()`` returns it or raises its error.

        A box that has not cached them (a fresh box at boot, mounting
        ``latest``, or at a notice, finding its parent) fetches every
        manifest of a bucket that several boxes share: one round trip each,
        so they go several at a time (fetchmany.py; load_manifest is
        thread-safe: the store is, each cached copy is written by rename).
        """
        cached = self.cache_dir / "manifests"
        if sum(1 for i in ids if not (cached / i).exists()) <= 1:
            return ((i, functools.partial(self.load_manifest, i)) for i in ids)
        return in_order(self.load_manifest, ids)

    def resolve(self, name: str) -> Manifest:
        """A snapshot by full id, unique id prefix (hex digits in either case), or ``latest``."""
        name = name.lower()
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
        plain = db_path.read_bytes()
        obj = self.codec.seal(key, plain)
        self.store.put(key, obj)
        self._cache_catalog(snap_id, plain, obj[:CATALOG_STAMP_BYTES])

    def _catalog_files(self, snap_id: str) -> tuple[Path, Path, Path]:
        path = self.cache_dir / "catalogs" / f"{snap_id}.sqlite"
        return path, path.with_suffix(".stamp"), path.with_suffix(".mac")

    def _cache_mac(self, stamp: bytes, path: Path) -> bytes:
        """What vouches for a cached catalog: the stored digest (plaintext) or a keyed MAC (encrypted).

        Unencrypted, the stamp holds the BLAKE3 of the plaintext as the store
        has it. Encrypted, the stamp is only a nonce, so the cache keeps a MAC
        of stamp and content under a key derived from the master key: nobody
        without the key can make a changed file pass.
        """
        h = (blake3.blake3(key=self._cache_mac_key()) if self.codec.encrypted else blake3.blake3())
        if self.codec.encrypted:
            h.update(stamp)
        with open(path, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
        return h.digest()

    def _cache_mac_key(self) -> bytes:
        return blake3.blake3(self._master, derive_key_context="ogrefs 2026 local catalog cache mac").digest()

    def _cached_catalog_ok(self, snap_id: str, stamp: bytes) -> bool:
        path, _stamp_path, mac_path = self._catalog_files(snap_id)
        try:
            actual = self._cache_mac(stamp, path)
            expected = mac_path.read_bytes() if self.codec.encrypted else stamp[6:38]
        except OSError:
            return False
        return len(stamp) == CATALOG_STAMP_BYTES and hmac.compare_digest(actual, expected)

    def _cache_catalog(self, snap_id: str, plain: bytes, stamp: bytes) -> None:
        path, stamp_path, mac_path = self._catalog_files(snap_id)
        _atomic_write(path, plain)
        if self.codec.encrypted:
            _atomic_write(mac_path, self._cache_mac(stamp, path))
        _atomic_write(stamp_path, stamp)

    def catalog_path(self, snap_id: str) -> Path:
        """The snapshot's catalog as a local SQLite file, cached and verified on every call.

        Catalogs change only when prune repacks (their chunk locations move), so
        a cached copy is checked against the first bytes of the stored object
        (its digest, or its nonce when encrypted: one small ranged GET) and
        fetched again when they differ.  The cached file itself is then checked
        against that digest (or its keyed MAC, see ``_cache_mac``): a damaged
        copy is fetched again, never used.  A store that cannot be reached
        leaves a cached copy that verifies in use.
        """
        key = f"catalogs/{snap_id}"
        path, stamp_path, _mac = self._catalog_files(snap_id)
        if path.exists() and stamp_path.exists():
            local = stamp_path.read_bytes()
            try:
                current = self.store.get_range(key, 0, CATALOG_STAMP_BYTES)
            except NotFound:
                raise CorruptObject(f"catalog of snapshot {snap_id[:12]} is missing from the repository") from None
            except StoreError:
                if self._cached_catalog_ok(snap_id, local):
                    return path  # offline: the cached copy is the best there is, and it verifies
                raise
            if current == local:
                if self._cached_catalog_ok(snap_id, local):
                    return path
                log.warning("warning: cached catalog of snapshot %s is damaged; fetching it again", snap_id[:12])
        try:
            obj = self.store.get(key)
        except NotFound:
            raise CorruptObject(f"catalog of snapshot {snap_id[:12]} is missing from the repository") from None
        self._cache_catalog(snap_id, self.codec.open(key, obj), obj[:CATALOG_STAMP_BYTES])
        return path
