"""Ranged GETs of an S3 object on a presigned URL, sent on botocore's own HTTP session.

Why: a lazy mount reads packs in hundreds of ranged GETs, and botocore spends
about 1.1 ms of CPU on each beyond the bytes (building the request through
its event system, signing it, parsing the answer into a dict), as much as
reading the bodies (docs/benchmarks.md, "Where the workers' CPU goes").  On a
box whose cores the resume itself needs, that is CPU taken from the step.
A SigV4 presigned URL signs the method, the key and the host, not the
``Range`` header, so one URL per object serves every range of it: the work of
signing is paid once per pack instead of once per GET.

What it keeps from botocore, by construction rather than by copying:

* the URL is botocore's (``generate_presigned_url`` of the store's own
  client): endpoint, addressing style, region and credentials resolve as for
  every other call, refreshable credentials included;
* the request goes out on the client's own HTTP session
  (``URLLib3Session``): the same connection pool, TLS verification and CA
  bundle, proxies and timeouts.

What stays with botocore: every answer that is not the range asked for.
The URL is dropped and the caller asks botocore, which says what went wrong
in its own words: a ``403`` (an expired URL or credentials; botocore
refreshes them), ``404``, ``416``, a redirect (botocore learns the bucket's
region, which the next URL is signed for) and a server that ignored the
range.  A ``5xx``/``429``/``408`` is a TransientError at once (asking again
would double the load on a server that is shedding it).  A failure to
connect or a broken body is the caller's to translate, with the URL's query
(the signature and the access key's id) cut from its message
(:func:`scrub_signed`).

``OGREFS_S3_PRESIGNED_READS=0`` switches it off (every GET through
botocore), for a proxy or gateway that treats presigned URLs differently.

Locking: ``_urls`` (key -> URL, its time) is guarded by ``_lock``, held only
to look up, store or drop an entry, never while signing or sending.  The
HTTP session is botocore's and is thread-safe.  Everything else is set in
``__init__`` and only read afterwards.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any

from botocore.awsrequest import AWSRequest

from ogrefs.store.base import TransientError

__all__ = ["CONTENT_RANGE_RE", "PresignedRanges", "SWITCH", "scrub_signed"]

#: Environment variable; ``0`` sends every GET through botocore.
SWITCH = "OGREFS_S3_PRESIGNED_READS"

#: A URL is signed for this long ...
URL_LIFETIME_S = 900
#: ... and reused for this long, so a URL in use has minutes left (botocore
#: refreshes temporary credentials 10-15 minutes before they expire).
URL_REUSE_S = 600
#: URLs kept at most (oldest dropped first); a few hundred bytes each.
MAX_URLS = 4096

_RETRY_LATER = frozenset({408, 429})
_CODE_RE = re.compile(rb"<Code>([^<]{1,64})</Code>")
CONTENT_RANGE_RE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_SIGNED_QUERY_RE = re.compile(r"\?[^\s\"'<>]*(?:X-Amz-|Signature=|AWSAccessKeyId=)[^\s\"'<>]*")


class PresignedRanges:
    """Ranged GETs of ``bucket``'s objects through ``client``'s presigned URLs (see the module docstring)."""

    def __init__(self, client: Any, http: Any, bucket: str, clock: Any = time.monotonic) -> None:
        self._client = client
        self._http = http
        self._bucket = bucket
        self._clock = clock
        self._lock = threading.Lock()
        self._urls: dict[str, tuple[str, float]] = {}
        self.signed = 0  #: URLs signed (a statistic; written under _lock)

    @classmethod
    def for_client(cls, client: Any, bucket: str) -> PresignedRanges | None:
        """Ranges for a real botocore client; None when switched off or the client is not one (a test's fake)."""
        if os.environ.get(SWITCH, "1").strip() == "0":
            return None
        http = getattr(getattr(client, "_endpoint", None), "http_session", None)
        if http is None or not callable(getattr(http, "send", None)) \
                or not callable(getattr(client, "generate_presigned_url", None)):
            return None
        return cls(client, http, bucket)

    # -- URLs ---------------------------------------------------------------

    def _url(self, full_key: str) -> str:
        now = self._clock()
        with self._lock:
            known = self._urls.get(full_key)
        if known is not None and now - known[1] < URL_REUSE_S:
            return known[0]
        url: str = self._client.generate_presigned_url(
            "get_object", Params={"Bucket": self._bucket, "Key": full_key}, ExpiresIn=URL_LIFETIME_S)
        with self._lock:
            self.signed += 1
            self._urls.pop(full_key, None)
            self._urls[full_key] = (url, now)
            while len(self._urls) > MAX_URLS:
                del self._urls[next(iter(self._urls))]
        return url

    def forget(self, full_key: str) -> None:
        with self._lock:
            self._urls.pop(full_key, None)

    # -- GETs ---------------------------------------------------------------

    def open(self, full_key: str, offset: int, length: int) -> Any | None:
        """The body (a urllib3 response, not yet read) of bytes ``offset``..``offset+length-1``: read to its
        end it gives its connection back to the pool by itself; closed early, it closes the connection.

        None: ask botocore instead (the answer was not that range: refused,
        missing, past the end, redirected, or the whole object).  Raises
        TransientError on a server error, and whatever botocore's session
        raises on a failure to connect (whose message holds the URL: the
        caller translates it and cuts the query with :func:`scrub_signed`).
        """
        url = self._url(full_key)
        request = AWSRequest(method="GET", url=url, headers={"Range": f"bytes={offset}-{offset + length - 1}"},
                             stream_output=True)
        answer = self._http.send(request.prepare())
        raw = answer.raw
        status = answer.status_code
        if status == 206 and _is_range(answer.headers, offset, length):
            return raw
        detail = _error_code(raw) if status >= 400 else ""
        _discard(raw)
        if status >= 500 or status in _RETRY_LATER:
            raise TransientError(f"server said {detail or status} (HTTP {status})")
        # Signed again next time: after botocore has refreshed credentials or learnt the bucket's region.
        self.forget(full_key)
        return None


def _is_range(headers: Any, offset: int, length: int) -> bool:
    m = CONTENT_RANGE_RE.fullmatch((headers.get("Content-Range") or "").strip())
    if m is None or int(m.group(1)) != offset or int(m.group(2)) != offset + length - 1:
        return False
    declared = headers.get("Content-Length")
    return declared is None or declared.strip() == str(length)


def _error_code(raw: Any) -> str:
    """The ``<Code>`` of an S3 error body (read at most 4 KiB of it), or ''."""
    try:
        m = _CODE_RE.search(raw.read(4096) or b"")
    except Exception:  # noqa: BLE001 - the code only decorates a message
        return ""
    return m.group(1).decode("ascii", "replace") if m else ""


def _discard(raw: Any) -> None:
    try:
        raw.close()
    except Exception:  # noqa: BLE001 - closing a connection we give up on may fail again
        pass


def scrub_signed(text: str) -> str:
    """``text`` with the query of any presigned URL in it cut off (no signature, no access key id)."""
    return _SIGNED_QUERY_RE.sub("", text)

