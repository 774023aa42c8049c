"""The store interface: named byte objects, and nothing else.

Everything above this layer (packs, indexes, snapshots, catalogs) is built on
six operations -- get, get_range, put, exists, list, delete -- so that every
backend can be tested by one conformance suite and wrapped (retry, fault
injection) without knowing what the bytes mean.  The interface is kept this
small on purpose: each extra method is one more thing every backend and every
wrapper must get right.  One optional seventh, :meth:`Store.open_range`, has a
default built on ``get_range``: a backend overrides it only to deliver a long
range as its bytes arrive (S3), so a lazy reader waiting for the first chunk of
a 16 MiB range does not wait for the last.

Errors are part of the contract.  Callers decide what to do from the *class*
of the exception, never from its text:

* ``NotFound``          -- the key does not exist (permanent).
* ``TransientError``    -- worth retrying: timeouts, refused or reset
  connections, 5xx, throttling.  ``RetryingStore`` is the only place that
  retries.
* ``PermissionDenied``  -- the store refuses us (EACCES, S3 403); retrying
  will not help, fixing credentials or modes will.
* ``ShortRead``         -- a range read ran past the end of the object
  (truncated pack, wrong offset).  Permanent; never returned as short bytes.
* ``StoreError``        -- anything else (disk full, I/O error, missing
  bucket).  ``str(e)`` is always one line a human can act on.

Keys are validated in one place (:func:`validate_key`) so that no backend can
be tricked into escaping its root, and so that a key that works on one
backend works on all of them.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Iterator
from types import TracebackType

__all__ = [
    "StoreError",
    "NotFound",
    "TransientError",
    "PermissionDenied",
    "ShortRead",
    "Store",
    "RangeReader",
    "BytesRange",
    "validate_key",
    "validate_prefix",
    "check_range",
    "MAX_KEY_LENGTH",
    "MAX_SEGMENT_LENGTH",
]

#: S3 allows 1024 bytes per key; keep every key usable there.
MAX_KEY_LENGTH = 1024
#: Most local file systems allow 255 bytes per name.
MAX_SEGMENT_LENGTH = 255

_SEGMENT_RE = re.compile(r"[A-Za-z0-9._-]+")
_PREFIX_RE = re.compile(r"[A-Za-z0-9._/-]*")


class StoreError(Exception):
    """Base class of every store failure; ``str(e)`` is a one-line human reason."""


class InvalidStoreURL(ValueError):
    """A repository URL or S3 endpoint no backend understands (the user's typo, not a store failure)."""


class NotFound(StoreError):
    """The key does not exist."""


class TransientError(StoreError):
    """A failure that may go away if the same call is repeated later."""


class PermissionDenied(StoreError):
    """The store refused access (EACCES on a directory, 403 on S3, no credentials)."""


class ShortRead(StoreError):
    """A range read asked for bytes past the end of the object.

    Raised instead of returning fewer bytes, so that a truncated pack can
    never be mistaken for a short chunk.
    """


def validate_key(key: str) -> str:
    """Return ``key`` unchanged if it is a legal store key, else raise ValueError.

    Keys are ``/``-separated segments of ``[A-Za-z0-9._-]``: no empty
    segments, no leading or trailing ``/``.  A segment may not start with
    ``.``: that rules out ``.`` and ``..`` (no escaping the root) and keeps
    hidden names, such as the file store's ``.tmp-*`` files, outside the key
    space.  Length limits keep keys portable to S3 and to local file systems.

    Note that a key cannot also be a "directory" of another key on the file
    store (``a`` and ``a/b`` cannot both exist); the repository's layout
    never needs that.
    """
    if not isinstance(key, str):
        raise ValueError(f"store key must be a str, not {type(key).__name__}")
    if not key:
        raise ValueError("store key must not be empty")
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"store key is longer than {MAX_KEY_LENGTH} characters: {key[:60]!r}...")
    for segment in key.split("/"):
        if not segment:
            raise ValueError(f"store key {key!r} has an empty segment (leading, trailing or double '/')")
        if not _SEGMENT_RE.fullmatch(segment):
            raise ValueError(f"store key {key!r} has characters outside [A-Za-z0-9._-/]")
        if segment.startswith("."):
            raise ValueError(f"store key {key!r} has a segment starting with '.'")
        if len(segment) > MAX_SEGMENT_LENGTH:
            raise ValueError(f"store key {key!r} has a segment longer than {MAX_SEGMENT_LENGTH} characters")
    return key


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` if it could start a legal key, else raise ValueError.

    A prefix is a key cut anywhere: ``""``, ``"packs/"``, ``"packs/a"`` are
    all fine.  Only the last (possibly partial, possibly empty) segment may
    be empty.
    """
    if not isinstance(prefix, str):
        raise ValueError(f"store prefix must be a str, not {type(prefix).__name__}")
    if not prefix:
        return prefix
    if not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"store prefix {prefix!r} has characters outside [A-Za-z0-9._-/]")
    if prefix.startswith("/"):
        raise ValueError(f"store prefix {prefix!r} starts with '/'")
    *whole, last = prefix.split("/")
    if whole:
        try:
            validate_key("/".join(whole))
        except ValueError:
            raise ValueError(f"store prefix {prefix!r} cannot start any legal key") from None
    if last.startswith("."):
        raise ValueError(f"store prefix {prefix!r} has a segment starting with '.'")
    return prefix


def check_range(offset: int, length: int) -> None:
    """Reject negative or non-integer range arguments (a caller bug, not a store error)."""
    if not isinstance(offset, int) or not isinstance(length, int):
        raise ValueError("get_range offset and length must be integers")
    if offset < 0 or length < 0:
        raise ValueError(f"get_range needs offset >= 0 and length >= 0, got {offset}, {length}")


class RangeReader(abc.ABC):
    """The bytes of one range, read front to back as they arrive (see :meth:`Store.open_range`)."""

    @abc.abstractmethod
    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes (at least one unless the range is exhausted, then ``b""``).

        Raises the store errors of ``get_range``; a connection that breaks
        before the whole range arrived is a TransientError, never short data.
        """

    def close(self) -> None:
        """Release the connection; reading stops here."""

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BytesRange(RangeReader):
    """A range that is already in memory."""

    def __init__(self, data: bytes) -> None:
        self._view = memoryview(data)
        self._pos = 0

    def read(self, n: int) -> bytes | memoryview:
        out = self._view[self._pos:self._pos + n]
        self._pos += len(out)
        return out


class Store(abc.ABC):
    """A flat namespace of immutable-ish byte objects.

    Implementations must be safe to call from many threads at once; each
    documents how it achieves that.  ``url`` is a human-readable location
    used in messages (``file:///srv/repo``, ``s3://bucket/prefix``).
    """

    url: str

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """Return the whole object, or raise NotFound."""

    @abc.abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Return exactly ``length`` bytes starting at ``offset``.

        Raises NotFound for a missing key and ShortRead when the object
        ends before ``offset + length``.  ``length == 0`` returns ``b""``
        for any existing key and any ``offset`` up to its size.
        """

    def open_range(self, key: str, offset: int, length: int) -> RangeReader:
        """Like :meth:`get_range`, but the bytes can be consumed as they arrive.

        The default reads the whole range first (right for local files and
        memory); errors that ``get_range`` raises up front may also come from
        the reader's ``read``.
        """
        return BytesRange(self.get_range(key, offset, length))

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` atomically (all or nothing); overwrites are allowed."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` exists."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield every key that starts with ``prefix``, recursively, in no particular order."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""

    def modified(self, key: str) -> float:
        """When ``key`` was last written, by the store's clock (Unix seconds), or NotFound.

        Not one of the data path's calls: only a lock whose own heartbeat cannot be believed (from the
        future) asks it (locks.py).  The default cannot tell and says so.
        """
        raise StoreError(f"{self.url}: cannot tell when {key} was written")

    def remove_stale_temporaries(self, older_than_s: float, dry_run: bool = False) -> tuple[int, int]:
        """Remove what interrupted puts left behind, untouched for ``older_than_s`` seconds: (count, bytes)
        (``dry_run``: count them only).

        The default has nothing of the kind (an S3 PutObject is atomic and
        leaves nothing when it fails).
        """
        return 0, 0

    def close(self) -> None:
        """Release connections or handles; the default has nothing to release."""

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {getattr(self, 'url', '?')}>"
