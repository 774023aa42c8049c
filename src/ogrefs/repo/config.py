"""The ``config`` object: what every reader must understand before anything else."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import asdict, dataclass, field

from ogrefs.errors import RepositoryError
from ogrefs.units import MiB

FORMAT_NAME = "ogrefs-repository"
#: Version 2 (encrypted repositories only): the config carries a MAC under a key derived from the
#: master key, pack headers, locks and trash records are sealed. Unencrypted repositories stay version 1.
FORMAT_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)


_ID = re.compile(r"[0-9a-f]{8,64}")


def _int(v: object) -> bool:
    return type(v) is int  # not bool, not float


@dataclass(frozen=True)
class ChunkerParams:
    """FastCDC parameters; docs/format.md explains why these defaults."""

    algorithm: str = "fastcdc2020"
    min_size: int = 256 * 1024
    avg_size: int = 1 * MiB
    max_size: int = 4 * MiB


@dataclass(frozen=True)
class RepoConfig:
    id: str
    version: int = FORMAT_VERSION
    chunker: ChunkerParams = field(default_factory=ChunkerParams)
    hash: str = "blake3-256"
    compression: str = "zstd"
    compression_level: int = 3
    pack_target_size: int = 32 * MiB
    encryption: str | None = None
    #: hex keyed BLAKE3 of the config without this field (version 2; see ``mac_body``)
    mac: str | None = None

    @classmethod
    def new(cls, pack_target_size: int = 32 * MiB, compression_level: int = 3,
            encryption: str | None = None) -> "RepoConfig":
        return cls(id=secrets.token_hex(16), pack_target_size=pack_target_size, compression_level=compression_level,
                   encryption=encryption, version=FORMAT_VERSION if encryption else 1)

    @property
    def sealed_metadata(self) -> bool:
        """Whether pack headers, locks and trash records are sealed (encrypted, version 2)."""
        return bool(self.encryption) and self.version >= 2

    def mac_body(self) -> bytes:
        """The canonical bytes the MAC covers: every field but the MAC itself."""
        body = {"format": FORMAT_NAME, **asdict(self)}
        body.pop("mac")
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def to_bytes(self) -> bytes:
        body = {"format": FORMAT_NAME, **asdict(self)}
        if body["mac"] is None:
            body.pop("mac")  # version 1 configs have no MAC field
        return json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> "RepoConfig":
        """Parse and validate a config object; anything malformed is a one-line RepositoryError.

        Every field is checked for type and range, because each one flows
        somewhere that would fail obscurely otherwise: the id names a local
        cache directory (so it must be plain hex), the sizes drive the chunker
        and the packer, the level goes to zstd.
        """
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise RepositoryError(f"{where}: config is not valid JSON; is this an ogrefs repository?") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            raise RepositoryError(f"{where}: not an ogrefs repository (config has no ogrefs format tag)")
        version = body.get("version")
        if type(version) is not int or version not in SUPPORTED_VERSIONS:
            raise RepositoryError(
                f"{where}: repository format version {version!r} is not supported by this ogrefs "
                f"(it reads versions {', '.join(map(str, SUPPORTED_VERSIONS))}); upgrade ogrefs"
            )
        try:
            chunker = ChunkerParams(**body["chunker"])
            cfg = cls(
                id=body["id"],
                version=version,
                chunker=chunker,
                hash=body["hash"],
                compression=body["compression"],
                compression_level=body["compression_level"],
                pack_target_size=body["pack_target_size"],
                encryption=body.get("encryption"),
                mac=body.get("mac"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            detail = str(exc).replace("\n", "\\n").replace("\r", "\\r")  # a key may hold a newline: one line
            raise RepositoryError(f"{where}: config is malformed ({detail})") from None
        if not (isinstance(cfg.id, str) and _ID.fullmatch(cfg.id)):
            raise RepositoryError(f"{where}: config is malformed (id {cfg.id!r} is not a hex repository id)")
        if cfg.hash != "blake3-256" or cfg.compression != "zstd":
            raise RepositoryError(f"{where}: unsupported hash {cfg.hash!r} or compression {cfg.compression!r}")
        if cfg.encryption not in (None, "aes-256-gcm"):
            raise RepositoryError(f"{where}: unknown encryption {cfg.encryption!r}; upgrade ogrefs")
        if cfg.mac is not None and not (isinstance(cfg.mac, str) and re.fullmatch(r"[0-9a-f]{64}", cfg.mac)):
            raise RepositoryError(f"{where}: config is malformed (its MAC is not 64 hex digits)")
        if version >= 2 and not (cfg.encryption and cfg.mac):
            raise RepositoryError(f"{where}: a version {version} config must be encrypted and carry a MAC; "
                                  "refusing a config that was altered")
        if not (_int(cfg.compression_level) and -(1 << 17) <= cfg.compression_level <= 22):
            raise RepositoryError(f"{where}: compression level {cfg.compression_level!r} is out of range")
        if not (_int(cfg.pack_target_size) and 1 <= cfg.pack_target_size <= 4 * 1024 * MiB):
            raise RepositoryError(f"{where}: pack target size {cfg.pack_target_size!r} is out of range")
        if chunker.algorithm != "fastcdc2020":
            raise RepositoryError(f"{where}: unsupported chunker {chunker.algorithm!r}; upgrade ogrefs")
        sizes = (chunker.min_size, chunker.avg_size, chunker.max_size)
        if not (all(_int(v) for v in sizes) and 64 <= chunker.min_size <= chunker.avg_size <= chunker.max_size <= 16 * MiB):
            raise RepositoryError(f"{where}: chunker parameters out of range")
        return cfg
