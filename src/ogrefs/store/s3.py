"""A store in an S3 bucket (AWS, or any S3-compatible server such as SeaweedFS).

Why it looks the way it does:

* One S3 client per store, shared by every thread.  botocore clients are
  thread-safe once created; *creating* them from the shared default session
  is not, so each store makes its own session.  The connection pool is sized
  for the fetcher's thread count.
* The client is botocore's, made by a ``botocore.session.Session`` (the
  session boto3 wraps; boto3 stays the declared dependency that pins it):
  boto3's session adds nothing to a client's calls but, for S3, the
  managed-transfer methods (``upload_file``...), and injecting them imports
  s3transfer.  With a cold page cache behind other work on the box, boto3
  and s3transfer were half of a mount's imports (docs/benchmarks.md, "A
  mount's start on a busy box").  Credentials, region and configuration
  files resolve exactly as with boto3: they are botocore's.
* botocore's own retries are switched off (``max_attempts=1``):
  ``RetryingStore`` is the only place that retries, so an outage costs one
  predictable backoff schedule instead of two multiplied together.
* Every botocore/urllib3 failure is translated in one place
  (:func:`_translate`) into NotFound / PermissionDenied / TransientError /
  ShortRead / StoreError with a one-line message that names the object and,
  for connection failures, the endpoint.
* Range reads check what came back: a short body is either the object
  being shorter than asked (ShortRead, permanent) or a connection that died
  mid-body (TransientError).  Never silently short.
* Ranged GETs (the packs a lazy mount reads) go out on a presigned URL per
  object, reused for every range of it, on the client's own HTTP session:
  botocore's per-call work (~1.1 ms of CPU a GET) is paid once per pack.
  Any answer but the range asked for is asked again through botocore, which
  says what went wrong as it does for every other call (store/s3ranges.py).
* Every request has a wall-clock deadline (store/deadline.py): the retry
  layer gives each attempt one, and each request here runs in a
  ``deadline.guard`` from its first byte out to the last byte of its answer
  read; at the deadline its connection is shut down (store/s3conns.py finds
  it), and the request fails as a TransientError that says so.  botocore's
  ``read_timeout`` is per socket read: a store trickling a byte at a time
  never trips it.  A request moving many bytes (a put, a range, an object
  whose length the answer gives) has at least their time at
  ``deadline.MIN_RATE``.
* put is a single PutObject: S3 makes it atomic (all or nothing) and packs
  are tens of MiB, far below the 5 GiB single-part limit.
* A small put sends its body at once.  botocore asks every PutObject to
  wait for the server's ``100 Continue`` before the body (``Expect:
  100-continue``), which costs a whole round trip per put: a lock, a
  manifest, a trace took two round trips instead of one, and a mount's
  start has two lock writes on its path (70 ms each behind a 30 ms link,
  docs/benchmarks.md).  The wait pays only when a refused request would
  otherwise send a body that takes longer than a round trip, so only a
  body above :data:`CONTINUE_ABOVE` (a pack) still waits.
* The client's data loader knows only S3 (:class:`_S3OnlyLoader`): botocore's
  own lists every service it ships (~450 directories, each listed, a file
  stat'ed in each) only to check that "s3" is among them.  On a box that
  boots with a cold page cache that scan was the slowest part of a mount's
  start (docs/benchmarks.md, "Where a busy box's time goes").

Locking: none of our own.  ``_client`` is created in ``__init__`` and only
read afterwards; botocore guards its connection pool itself.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any, NoReturn

import botocore.exceptions as bx
import botocore.loaders
import botocore.session
import botocore.utils
from botocore.config import Config

from ogrefs.store import deadline
from ogrefs.store.base import (
    BytesRange,
    InvalidStoreURL,
    NotFound,
    PermissionDenied,
    RangeReader,
    ShortRead,
    Store,
    StoreError,
    TransientError,
    check_range,
    validate_key,
    validate_prefix,
)
from ogrefs.store.s3conns import connection_of, track_connections
from ogrefs.store.s3ranges import CONTENT_RANGE_RE, PresignedRanges, scrub_signed

__all__ = ["S3Store", "parse_s3_url"]

#: Ranges up to this size are read whole (one call); longer ones are streamed (open_range).
STREAM_ABOVE = 256 * 1024

#: A PutObject body above this size waits for the server's ``100 Continue``; a smaller one is sent at once.
CONTINUE_ABOVE = 1024 * 1024

#: Threads that may talk to one store at once without queueing for a connection.
MAX_POOL_CONNECTIONS = 32
CONNECT_TIMEOUT_S = 5.0
#: Per socket read, not per request: a 32 MiB pack that keeps flowing never times out.
READ_TIMEOUT_S = 30.0

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_DENIED_CODES = frozenset({
    "AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "AllAccessDisabled", "AccountProblem", "InvalidToken", "ExpiredToken", "InvalidSecurity",
    "InvalidObjectState",
})
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable",
    "OperationAborted", "RequestThrottled", "BandwidthLimitExceeded", "EC2ThrottledException",
    "PriorRequestNotComplete",
})


def parse_s3_url(url: str) -> tuple[str, str]:
    """Split ``s3://bucket/some/prefix`` into ("bucket", "some/prefix")."""
    if not url.startswith("s3://"):
        raise InvalidStoreURL(f"not an s3:// URL: {url!r}")
    rest = url[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise InvalidStoreURL(f"s3 URL has no bucket: {url!r}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{2,254}", bucket):
        raise InvalidStoreURL(f"s3 URL has an invalid bucket name {bucket!r} "
                         "(at least 3 characters of a-z, 0-9, '.', '-')")
    prefix = prefix.strip("/")
    if prefix:
        try:
            validate_key(prefix)
        except ValueError as exc:
            raise InvalidStoreURL(f"s3 URL has an invalid prefix: {exc}") from None
    return bucket, prefix


def _continue_only_for_large_bodies(model: Any, params: dict[str, Any], **_: Any) -> None:
    """Drop botocore's ``Expect: 100-continue`` from a PutObject whose body is at most CONTINUE_ABOVE bytes."""
    headers = params.get("headers") or {}
    if getattr(model, "name", None) != "PutObject" or "Expect" not in headers:
        return
    size = botocore.utils.determine_content_length(params.get("body"))
    if size is not None and size <= CONTINUE_ABOVE:
        del headers["Expect"]


class _S3OnlyLoader(botocore.loaders.Loader):
    """botocore's data loader, asked about S3 alone (see the module docstring).

    ``list_available_services`` answers what botocore's would, restricted to
    S3: ``["s3"]`` when S3 has data of ``type_name`` on the search path, else
    nothing.  Everything else (finding, loading and caching the data, the
    search path with ``AWS_DATA_PATH``) is botocore's.
    """

    SERVICE = "s3"

    def list_available_services(self, type_name: str) -> list[str]:
        try:
            self.list_api_versions(self.SERVICE, type_name)
        except bx.DataNotFoundError:
            return []
        return [self.SERVICE]


def _s3_session() -> botocore.session.Session:
    """A fresh botocore session whose data loader is :class:`_S3OnlyLoader` (as botocore makes its own)."""
    core = botocore.session.Session()
    search = core.get_config_variable("data_path")
    extra = [os.path.expanduser(os.path.expandvars(p)) for p in search.split(os.pathsep)] if search else None
    core.register_component("data_loader", _S3OnlyLoader(extra_search_paths=extra))
    return core


class S3Store(Store):
    """Keys live at ``<prefix>/<key>`` in ``bucket``."""

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 client: Any | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._key_base = f"{self.prefix}/" if self.prefix else ""
        self._client = client if client is not None else self._make_client(endpoint_url)
        events = getattr(getattr(self._client, "meta", None), "events", None)
        if events is not None:  # last on botocore's own event: it runs after the handler that adds the header
            # (once per client, however many stores share it)
            events.register_last("before-call.s3", _continue_only_for_large_bodies, unique_id="ogrefs-small-puts")
        #: ranged GETs on presigned URLs (store/s3ranges.py); None: every GET through botocore
        self._ranges = PresignedRanges.for_client(self._client, bucket)
        track_connections(self._client)  # each request's connection, for its deadline

    @staticmethod
    def _make_client(endpoint_url: str | None) -> Any:
        s3_options: dict[str, str] = {}
        if endpoint_url:
            # S3-compatible servers on an IP/port have no per-bucket DNS names.
            s3_options["addressing_style"] = "path"
        config = Config(
            max_pool_connections=MAX_POOL_CONNECTIONS,
            connect_timeout=CONNECT_TIMEOUT_S,
            read_timeout=READ_TIMEOUT_S,
            retries={"mode": "standard", "max_attempts": 1},
            s3=s3_options or None,
            # botocore signs its calls with SigV4 anyway; named here, its presigned URLs
            # (store/s3ranges.py) are SigV4 too instead of the legacy SigV2 that newer
            # regions refuse.
            signature_version="s3v4",
        )
        session = _s3_session()
        kwargs: dict[str, Any] = {"config": config}
        if endpoint_url:
            kwargs["endpoint_url"] = endpoint_url
        if session.get_config_variable("region") is None:
            # Signing needs a region; S3-compatible servers accept us-east-1.
            kwargs["region_name"] = "us-east-1"
        return session.create_client("s3", **kwargs)

    # -- helpers ----------------------------------------------------------

    def _full(self, key: str) -> str:
        return self._key_base + key

    def _where(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _fail(self, exc: BaseException, op: str, key: str) -> NoReturn:
        if isinstance(exc, (ValueError, TypeError)) and not isinstance(exc, bx.BotoCoreError):
            raise exc  # a bug of ours (bad argument), not a store condition
        err = _translate(exc, op, self._where(key), self.bucket, self.endpoint_url)
        scrubbed = scrub_signed(str(err))
        if scrubbed != str(err):  # a presigned URL's signature never reaches a message or a traceback
            raise type(err)(scrubbed) from None
        raise err from exc

    @contextlib.contextmanager
    def _in_time(self, op: str, key: str, conns: Iterable[Any] = (), size: int = 0) -> Iterator[deadline.Guard]:
        """One request (moving about ``size`` bytes) within its deadline (see the module docstring).  Once
        the deadline has cut the connection, whatever the request made of the rest is not an answer (a
        status line cut after ``200 OK`` parses as an empty body): it fails, saying why."""
        with deadline.guard(conns, size) as g:
            try:
                yield g
            except Exception:  # noqa: BLE001 - re-raised unless the deadline explains it
                if not g.fired:
                    raise
            if g.fired:
                raise TransientError(f"{self._where(key)}: {op}: no whole answer by the request's deadline "
                                     f"(the store stalled or trickles)") from None

    def _open_presigned(self, key: str, offset: int, length: int) -> _S3Range | None:
        """The range's body fetched on a presigned URL; None: ask botocore (see store/s3ranges.py)."""
        if self._ranges is None:
            return None
        try:
            raw = self._ranges.open(self._full(key), offset, length)
        except TransientError as exc:  # the server's own answer: says what, not where
            raise TransientError(f"{self._where(key)}: get_range: {exc}") from None
        except Exception as exc:
            self._fail(exc, "get_range", key)
        return None if raw is None else _S3Range(self, raw, key, length)

    # -- the interface ----------------------------------------------------

    def get(self, key: str) -> bytes:
        validate_key(key)
        with self._in_time("get", key) as g:
            try:
                resp = self._client.get_object(Bucket=self.bucket, Key=self._full(key))
                data = _read_body(resp["Body"], int(resp.get("ContentLength") or 0), g)
            except Exception as exc:  # translated; nothing escapes untyped
                self._fail(exc, "get", key)
            expected = resp.get("ContentLength")
            if expected is not None and len(data) != expected:
                raise TransientError(f"{self._where(key)}: get: body ended after {len(data)} of {expected} bytes")
        return data

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        validate_key(key)
        check_range(offset, length)
        with self._in_time("get_range", key, size=length):
            return self._get_range(key, offset, length)

    def _get_range(self, key: str, offset: int, length: int) -> bytes:
        if length == 0:
            # HTTP cannot ask for zero bytes; HEAD tells existence and size.
            size = self._head_size(key, "get_range")
            if offset > size:
                raise ShortRead(f"{self._where(key)}: range {offset}+0 is past the end "
                                f"of the object ({size} bytes)")
            return b""
        fast = self._open_presigned(key, offset, length)
        if fast is not None:
            with fast:
                data = fast.read(length)  # one read: urllib3 reads until ``length`` bytes or the body's end
            if len(data) != length:
                raise TransientError(f"{self._where(key)}: get_range: the connection closed after "
                                     f"{len(data)} of {length} bytes")
            return data
        want = f"bytes={offset}-{offset + length - 1}"
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=self._full(key), Range=want)
            data: bytes = resp["Body"].read()
        except Exception as exc:
            self._fail(exc, "get_range", key)
        content_range = resp.get("ContentRange")
        if not content_range:
            # The server ignored Range and sent the whole object.
            if offset + length > len(data):
                raise ShortRead(f"{self._where(key)}: range {offset}+{length} is past the end "
                                f"of the object ({len(data)} bytes)")
            return data[offset:offset + length]
        if len(data) == length:
            return data
        m = CONTENT_RANGE_RE.fullmatch(content_range.strip())
        total = int(m.group(3)) if m and m.group(3) != "*" else None
        if total is not None and offset + length > total:
            raise ShortRead(f"{self._where(key)}: range {offset}+{length} is past the end "
                            f"of the object ({total} bytes)")
        raise TransientError(f"{self._where(key)}: get_range: got {len(data)} of {length} bytes "
                             f"at offset {offset} (Content-Range {content_range!r})")

    def open_range(self, key: str, offset: int, length: int) -> RangeReader:
        """The range as a stream: the body is read as it arrives (see Store.open_range)."""
        validate_key(key)
        check_range(offset, length)
        if length < STREAM_ABOVE:
            return BytesRange(self.get_range(key, offset, length))
        with self._in_time("get_range", key):
            return self._open_range(key, offset, length)

    def _open_range(self, key: str, offset: int, length: int) -> RangeReader:
        fast = self._open_presigned(key, offset, length)
        if fast is not None:
            return fast
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=self._full(key),
                                           Range=f"bytes={offset}-{offset + length - 1}")
        except Exception as exc:
            self._fail(exc, "get_range", key)
        body = resp["Body"]
        if not resp.get("ContentRange") or int(resp.get("ContentLength", -1)) != length:
            # the server ignored the Range or answered with another length: let get_range sort it out
            body.close()
            return BytesRange(self.get_range(key, offset, length))
        return _S3Range(self, body, key, length)

    def _head_size(self, key: str, op: str) -> int:
        with self._in_time(op, key):
            try:
                resp = self._client.head_object(Bucket=self.bucket, Key=self._full(key))
            except Exception as exc:
                self._fail(exc, op, key)
        return int(resp["ContentLength"])

    def put(self, key: str, data: bytes) -> None:
        validate_key(key)
        body = data if isinstance(data, bytes) else bytes(data)
        with self._in_time("put", key, size=len(body)):
            try:
                self._client.put_object(Bucket=self.bucket, Key=self._full(key), Body=body)
            except Exception as exc:
                self._fail(exc, "put", key)

    def modified(self, key: str) -> float:
        validate_key(key)
        try:
            resp = self._client.head_object(Bucket=self.bucket, Key=self._full(key))
        except Exception as exc:
            self._fail(exc, "modified", key)
        return float(resp["LastModified"].timestamp())

    def exists(self, key: str) -> bool:
        validate_key(key)
        try:
            self._head_size(key, "exists")
        except NotFound:
            return False
        return True

    def list(self, prefix: str = "") -> Iterator[str]:
        validate_prefix(prefix)
        return self._list(prefix)

    def _list(self, prefix: str) -> Iterator[str]:
        cut = len(self._key_base)
        try:
            pages = iter(self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._full(prefix)))
            while True:
                with self._in_time("list", prefix):  # one page: its request and its answer
                    page = next(pages, None)
                if page is None:
                    return
                for obj in page.get("Contents", ()):
                    full: str = obj["Key"]
                    if full.startswith(self._key_base):
                        yield full[cut:]
        except StoreError:
            raise
        except Exception as exc:
            self._fail(exc, "list", prefix)

    def delete(self, key: str) -> None:
        validate_key(key)
        with self._in_time("delete", key):
            try:
                self._client.delete_object(Bucket=self.bucket, Key=self._full(key))
            except Exception as exc:
                try:
                    self._fail(exc, "delete", key)
                except NotFound:
                    return

    def close(self) -> None:
        close = getattr(self._client, "close", None)
        if close is not None:
            close()


#: A whole object's body is read in pieces of this size, each given its time at ``deadline.MIN_RATE``.
BODY_PIECE = 1024 * 1024


def _read_body(body: Any, declared: int, g: deadline.Guard) -> bytes:
    """All of a GET's body, piece by piece: a large object on a slow link keeps its deadline moving while
    each piece comes at ``deadline.MIN_RATE``, and a length the store declared buys no time of itself."""
    parts: list[bytes] = []
    got = 0
    while True:
        g.allow(min(BODY_PIECE, max(declared - got, 0)))
        piece: bytes = body.read(BODY_PIECE)
        if not piece:
            return b"".join(parts)
        parts.append(piece)
        got += len(piece)


class _S3Range(RangeReader):
    """A GET body read piece by piece; ends early only with an error."""

    def __init__(self, store: S3Store, body: Any, key: str, length: int) -> None:
        self._store = store
        self._body = body
        self._key = key
        self._left = length

    def read(self, n: int) -> bytes:
        if self._left <= 0 or n <= 0:
            return b""
        with self._store._in_time("get_range", self._key, [connection_of(self._body)], size=min(n, self._left)):
            return self._read(n)

    def _read(self, n: int) -> bytes:
        try:
            data: bytes = self._body.read(min(n, self._left))
        except Exception as exc:
            self.close()
            self._store._fail(exc, "get_range", self._key)
        if not data:
            self.close()
            raise TransientError(f"{self._store._where(self._key)}: get_range: the connection closed with "
                                 f"{self._left} bytes of the range still to come")
        self._left -= len(data)
        return data

    def close(self) -> None:
        try:
            self._body.close()
        except Exception:  # noqa: BLE001 - closing a broken connection may fail again; nothing to lose
            pass


def _translate(exc: BaseException, op: str, where: str, bucket: str, endpoint: str | None) -> StoreError:
    """Map any exception from boto3/botocore/urllib3 to a store error with a one-line message."""
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {}) or {}
        code = str(err.get("Code", "") or "")
        message = str(err.get("Message", "") or "").strip()
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        detail = f"{code or status}" + (f": {message}" if message else "")
        if code in _NOT_FOUND_CODES or (status == 404 and code not in ("NoSuchBucket",)):
            if code == "404" or not code:
                return NotFound(f"{where}: no such object")
            return NotFound(f"{where}: no such object ({detail})")
        if code == "NoSuchBucket":
            return StoreError(f"bucket {bucket} does not exist ({where}: {op})")
        if code in _DENIED_CODES or status == 403:
            return PermissionDenied(f"{where}: {op}: access denied ({detail})")
        if code == "InvalidRange" or status == 416:
            return ShortRead(f"{where}: {op}: range is past the end of the object ({detail})")
        if code in _TRANSIENT_CODES or status >= 500 or status in (408, 429):
            return TransientError(f"{where}: {op}: server said {detail} (HTTP {status})")
        return StoreError(f"{where}: {op}: {detail} (HTTP {status})")
    if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return PermissionDenied(f"{where}: {op}: no usable S3 credentials "
                                f"(set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or an AWS profile): {exc}")
    if isinstance(exc, bx.SSLError) and "certificate" in str(exc).lower():
        return StoreError(f"{where}: {op}: TLS certificate problem talking to {endpoint or 'S3'}: {exc}")
    if isinstance(exc, (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError,
                        bx.ChecksumError, bx.CredentialRetrievalError)):
        return TransientError(f"{where}: {op}: {_one_line(exc)}")
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return TransientError(f"{where}: {op}: {_one_line(exc)} (endpoint {endpoint or 'default'})")
    try:
        import urllib3.exceptions as ux
    except ImportError:  # pragma: no cover - botocore depends on urllib3
        ux = None
    if ux is not None and isinstance(exc, ux.HTTPError):
        return TransientError(f"{where}: {op}: {_one_line(exc)} (endpoint {endpoint or 'default'})")
    if isinstance(exc, bx.BotoCoreError):
        return StoreError(f"{where}: {op}: {_one_line(exc)}")
    return StoreError(f"{where}: {op}: {type(exc).__name__}: {_one_line(exc)}")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
