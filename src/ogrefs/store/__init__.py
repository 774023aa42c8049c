"""Store backends: where repository objects live.

``open_store(url)`` is the one entry point the rest of ogrefs uses.  It picks
a backend from the URL and wraps it in :class:`RetryingStore`, so callers get
retries for transient failures without knowing which backend they talk to.

Backends: ``file://`` or a plain path (FileStore), ``s3://bucket/prefix``
(S3Store), ``memory://name`` (MemoryStore, process-global, for tests).
Wrappers: RetryingStore (retries), FaultyStore (fault injection in tests).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from ogrefs.store.base import (
    InvalidStoreURL,
    NotFound,
    PermissionDenied,
    ShortRead,
    Store,
    StoreError,
    TransientError,
    validate_key,
    validate_prefix,
)
from ogrefs.store.faults import FaultyStore
from ogrefs.store.file import FileStore
from ogrefs.store.memory import MemoryStore, named_memory_store
from ogrefs.store.retry import RetryingStore

__all__ = [
    "open_store", "Store", "StoreError", "NotFound", "TransientError", "PermissionDenied", "ShortRead",
    "validate_key", "validate_prefix", "FileStore", "MemoryStore", "RetryingStore", "FaultyStore",
    "S3_ENDPOINT_ENV", "InvalidStoreURL",
]

#: Environment variable naming the S3 endpoint when ``s3_endpoint`` is not given.
S3_ENDPOINT_ENV = "OGREFS_S3_ENDPOINT"


def open_store(url: str, *, s3_endpoint: str | None = None, retry: bool = True,
               retry_for: float | None = None, sleep: Callable[[float], None] | None = None,
               on_retry: Callable | None = None) -> Store:
    """Open the store at ``url``; wrapped in RetryingStore unless ``retry=False``
    (``retry_for``: seconds each call may retry an outage; None: a few attempts;
    ``on_retry``: told of each retry, see :class:`RetryNote`).

    ``s3_endpoint`` (else ``$OGREFS_S3_ENDPOINT``) points s3:// URLs at an
    S3-compatible server; without either, boto3's own configuration applies
    (AWS_* variables, profiles, AWS_ENDPOINT_URL).  Raises InvalidStoreURL (a
    ValueError), with a one-line message, for a URL no backend understands.
    """
    backend = _open_backend(url, s3_endpoint)
    if not retry:
        return backend
    return RetryingStore(backend, retry_for=retry_for, on_retry=on_retry,
                         **({"sleep": sleep} if sleep is not None else {}))


#: Schemes people type (ours, and other tools' that a user of restic or rclone may try).
_SCHEME_LIKE = re.compile(r"^(s3|file|memory|https?|sftp|rest|b2|gs|azure|swift|rclone):", re.IGNORECASE)


def _open_backend(url: str, s3_endpoint: str | None) -> Store:
    if not isinstance(url, str) or not url:
        raise InvalidStoreURL("store URL must be a non-empty string")
    scheme, sep, rest = url.partition("://")
    if not sep:
        like = _SCHEME_LIKE.match(url)
        if like:  # "s3:/bucket/x" is a typo, not a directory named "s3:" to create
            raise InvalidStoreURL(f"{url!r} looks like a URL but lacks '://' (did you mean "
                                  f"{like.group(1).lower()}://{url[like.end():].lstrip('/')}? for a directory "
                                  f"of that name write ./{url})")
        return FileStore(url)  # a plain path, absolute or relative
    if scheme == "file":
        if rest.startswith("localhost/"):
            rest = rest[len("localhost"):]
        if not rest.startswith("/"):
            raise InvalidStoreURL(f"file URL must name an absolute path (file:///path): {url!r}")
        return FileStore(rest)
    if scheme == "memory":
        if not rest:
            raise InvalidStoreURL(f"memory URL needs a name (memory://name): {url!r}")
        return named_memory_store(rest)
    if scheme == "s3":
        from ogrefs.store.s3 import S3Store, parse_s3_url  # botocore is slow to import; only pay for it when used

        bucket, prefix = parse_s3_url(url)
        endpoint = s3_endpoint or os.environ.get(S3_ENDPOINT_ENV) or None
        return S3Store(bucket, prefix, endpoint_url=check_endpoint(endpoint) if endpoint else None)
    raise InvalidStoreURL(f"unknown repository URL scheme {scheme!r} in {url!r} "
                          "(use a path, file:///path, s3://bucket/prefix or memory://name)")


def check_endpoint(endpoint: str) -> str:
    """An S3 endpoint is an http(s) URL with a host (boto3 would raise a traceback-worthy ValueError)."""
    m = re.fullmatch(r"(https?)://([^/\s]+)(/\S*)?", endpoint)
    if not m:
        raise InvalidStoreURL(f"S3 endpoint {endpoint!r} must be an http:// or https:// URL with a host "
                              f"(e.g. http://{endpoint.split('://')[-1] or 'localhost:8333'})")
    return endpoint
