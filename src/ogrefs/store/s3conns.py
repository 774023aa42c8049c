"""Which connection an S3 request is on, so that its deadline can shut it down (store/deadline.py).

botocore sends every request (its own calls and the presigned ranged GETs of
store/s3ranges.py) through one ``URLLib3Session`` whose pools hand out
connections.  The pools here are botocore's own, with one addition: a
connection taken from a pool is reported to the current request's guard
(:func:`ogrefs.store.deadline.track`).  :func:`track_connections` puts them
in place of botocore's before the first request; the session's pool
managers (the direct one and any proxy's) read the classes from the one dict
it changes.  A body read later (a stream) names its connection itself
(:func:`connection_of`).

Locking: none of its own; the pools are urllib3's (thread-safe), and
``track`` touches only the calling thread's guard.
"""

from __future__ import annotations

from typing import Any

from botocore.awsrequest import AWSHTTPConnectionPool, AWSHTTPSConnectionPool

from ogrefs.store import deadline

__all__ = ["connection_of", "track_connections"]


class _Tracked:
    """A pool whose every connection handed out is reported to the request's guard."""

    def _get_conn(self, timeout: float | None = None) -> Any:
        conn = super()._get_conn(timeout)  # type: ignore[misc]
        deadline.track(conn)
        return conn


class _TrackedHTTPPool(_Tracked, AWSHTTPConnectionPool):
    pass


class _TrackedHTTPSPool(_Tracked, AWSHTTPSConnectionPool):
    pass


def track_connections(client: Any) -> bool:
    """Make ``client``'s pools report their connections; False when it is not a botocore client as expected
    (a test's fake): its requests then have socket timeouts only."""
    http = getattr(getattr(client, "_endpoint", None), "http_session", None)
    classes = getattr(http, "_pool_classes_by_scheme", None)
    if not isinstance(classes, dict) or getattr(http, "_manager", None) is None:
        return False
    if getattr(http._manager, "pool_classes_by_scheme", None) is not classes:
        return False  # a botocore that no longer shares the dict: leave it alone
    classes["http"], classes["https"] = _TrackedHTTPPool, _TrackedHTTPSPool
    return True


def connection_of(body: Any) -> Any | None:
    """The connection a response body (urllib3's, or botocore's StreamingBody around one) is read from."""
    raw = getattr(body, "_raw_stream", body)
    return getattr(raw, "connection", None)
