"""Ranged GETs on presigned URLs (store/s3ranges.py): against SeaweedFS, and against a loopback HTTP
server that answers what SeaweedFS will not (a 503, a server that ignores Range).

Each test counts what went out: botocore's GetObject calls (its ``before-call`` event), URLs signed,
requests a server saw, connections opened.
"""

from __future__ import annotations

import http.server
import random
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from ogrefs.store import NotFound, ShortRead, TransientError, open_store
from ogrefs.store.s3 import S3Store
from ogrefs.store.s3ranges import SWITCH, URL_REUSE_S, PresignedRanges, scrub_signed

from tests.loopback_s3 import loopback_store

MiB = 1 << 20
DATA = random.Random(7).randbytes(3 * MiB)


class GetObjectCalls:
    """Counts the GetObject calls botocore makes for a store's client."""

    def __init__(self, store: S3Store) -> None:
        self.n = 0
        store._client.meta.events.register("before-call.s3.GetObject", self._count)

    def _count(self, **kwargs: Any) -> None:
        self.n += 1


@pytest.fixture
def s3(seaweed: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Store]:
    monkeypatch.delenv(SWITCH, raising=False)  # on, whatever the caller's environment says
    seaweed.ensure_running()
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    bucket = seaweed.new_bucket()
    store = S3Store(bucket, "repo", endpoint_url=seaweed.endpoint)
    store.put("packs/ab/pack", DATA)
    yield store
    store.close()
    seaweed.delete_bucket(bucket)


def pool_of(store: S3Store) -> Any:
    http = store._client._endpoint.http_session
    return http._get_connection_manager(store.endpoint_url, None).connection_from_url(store.endpoint_url)


def read_stream(store: S3Store, key: str, offset: int, length: int, piece: int = 64 * 1024) -> bytes:
    with store.open_range(key, offset, length) as body:
        parts = []
        while chunk := body.read(piece):
            parts.append(chunk)
    return b"".join(parts)


@pytest.mark.s3
def test_every_range_of_an_object_goes_out_on_one_url_and_one_connection(s3: S3Store) -> None:
    calls = GetObjectCalls(s3)
    assert s3._ranges is not None
    rng = random.Random(1)
    for _ in range(12):
        off, n = rng.randrange(len(DATA) - MiB), rng.randrange(1, MiB)
        assert s3.get_range("packs/ab/pack", off, n) == DATA[off:off + n]
        assert read_stream(s3, "packs/ab/pack", off, n) == DATA[off:off + n]
    assert calls.n == 0 and s3._ranges.signed == 1
    assert "X-Amz-Algorithm=AWS4-HMAC-SHA256" in next(iter(s3._ranges._urls.values()))[0]  # SigV4, not SigV2
    assert pool_of(s3).num_connections == 1  # every answer read to its end gave its connection back


@pytest.mark.s3
def test_a_stream_closed_early_does_not_hand_its_leftovers_to_the_next_get(s3: S3Store) -> None:
    with s3.open_range("packs/ab/pack", 0, 2 * MiB) as body:
        assert body.read(1000) == DATA[:1000]
    assert s3.get_range("packs/ab/pack", 5, 100) == DATA[5:105]
    assert read_stream(s3, "packs/ab/pack", MiB, MiB) == DATA[MiB:2 * MiB]


@pytest.mark.s3
def test_a_refused_url_is_dropped_and_the_range_asked_through_botocore(s3: S3Store) -> None:
    calls = GetObjectCalls(s3)
    assert s3.get_range("packs/ab/pack", 0, 10) == DATA[:10]
    ranges = s3._ranges
    assert ranges is not None
    full = "repo/packs/ab/pack"
    url, when = ranges._urls[full]
    forged = url.replace("X-Amz-Signature=", "X-Amz-Signature=0")
    ranges._urls[full] = (forged, when)
    assert s3.get_range("packs/ab/pack", 100, 50_000) == DATA[100:50_100]
    assert calls.n == 1 and full not in ranges._urls
    assert s3.get_range("packs/ab/pack", 200, 10) == DATA[200:210]
    assert calls.n == 1 and ranges.signed == 2


@pytest.mark.s3
@pytest.mark.parametrize("presigned", [True, False], ids=["presigned", "botocore"])
def test_errors_read_the_same_either_way(s3: S3Store, presigned: bool) -> None:
    if not presigned:
        s3._ranges = None
    with pytest.raises(NotFound, match=r"packs/ab/none: no such object"):
        s3.get_range("packs/ab/none", 0, 10)
    with pytest.raises(NotFound):
        s3.open_range("packs/ab/none", 0, MiB)
    with pytest.raises(ShortRead, match="past the end"):
        s3.get_range("packs/ab/pack", len(DATA) + 10, 10)
    with pytest.raises(ShortRead, match="past the end"):
        s3.get_range("packs/ab/pack", len(DATA) - 10, 20)


@pytest.mark.s3
def test_switched_off_every_range_goes_through_botocore(seaweed: Any, monkeypatch: pytest.MonkeyPatch,
                                                        s3: S3Store) -> None:
    monkeypatch.setenv(SWITCH, "0")
    store = open_store(f"{s3.url}", s3_endpoint=seaweed.endpoint, retry=False)
    assert isinstance(store, S3Store) and store._ranges is None
    calls = GetObjectCalls(store)
    assert store.get_range("packs/ab/pack", 3, 7) == DATA[3:10]
    assert calls.n == 1


def test_a_store_that_cannot_be_reached_says_where_without_the_signature(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDSECRETIDENTITY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s" * 40)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    store = S3Store("bkt", "p", endpoint_url=f"http://127.0.0.1:{port}")
    assert store._ranges is not None
    for read in (lambda: store.get_range("k", 0, 10), lambda: store.open_range("k", 0, MiB)):
        with pytest.raises(TransientError) as info:
            read()
        text = str(info.value)
        assert f"127.0.0.1:{port}" in text and "s3://bkt/p/k" in text
        assert "AKIDSECRETIDENTITY" not in text and "Signature" not in text and "X-Amz-" not in text and "AWSAccessKeyId" not in text
        assert info.value.__cause__ is None and info.value.__suppress_context__


# -- a loopback server that answers as told ---------------------------------------------------------

class _Answers(http.server.BaseHTTPRequestHandler):
    status = 206
    ignore_range = False
    seen: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).seen.append(self.path)
        if self.status >= 400:
            body = b"<Error><Code>SlowDown</Code><Message>Please reduce your rate</Message></Error>"
            self.send_response(self.status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        first, last = (int(x) for x in self.headers["Range"].removeprefix("bytes=").split("-"))
        if self.ignore_range:
            body = DATA
            self.send_response(200)
        else:
            body = DATA[first:last + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {first}-{last}/{len(DATA)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def answering(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[S3Store, type[_Answers]]]:
    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s" * 40)
    handler = type("Answers", (_Answers,), {"seen": []})
    with loopback_store(handler) as store:
        yield store, handler


def test_a_server_error_is_transient_at_once_not_asked_twice(answering: tuple[S3Store, type[_Answers]]) -> None:
    store, handler = answering
    handler.status = 503
    with pytest.raises(TransientError, match=r"s3://bkt/p/k: get_range: server said SlowDown \(HTTP 503\)"):
        store.get_range("k", 0, 10)
    assert len(handler.seen) == 1 and "X-Amz-Signature=" in handler.seen[0]


def test_a_server_that_ignores_the_range_is_asked_through_botocore(
        answering: tuple[S3Store, type[_Answers]]) -> None:
    store, handler = answering
    handler.ignore_range = True
    assert store.get_range("k", 1000, 500) == DATA[1000:1500]
    assert len(handler.seen) == 2
    assert "X-Amz-Signature=" in handler.seen[0] and "X-Amz-Signature=" not in handler.seen[1]
    assert not store._ranges._urls  # signed again next time (a redirect's region learnt meanwhile)


# -- the URL cache ------------------------------------------------------------------------------------

class _Signer:
    def __init__(self) -> None:
        self.n = 0

    def generate_presigned_url(self, op: str, Params: dict[str, str], ExpiresIn: int) -> str:  # noqa: N803
        self.n += 1
        return f"https://s3.example/{Params['Bucket']}/{Params['Key']}?X-Amz-Signature={self.n}"


def test_a_url_is_reused_until_its_reuse_time_then_signed_again() -> None:
    now = [1000.0]
    signer = _Signer()
    ranges = PresignedRanges(signer, http=None, bucket="b", clock=lambda: now[0])
    first = ranges._url("k")
    now[0] += URL_REUSE_S - 1
    assert ranges._url("k") == first and signer.n == 1
    now[0] += 2
    assert ranges._url("k") != first and signer.n == 2
    ranges._url("other")
    assert signer.n == 3


def test_scrub_signed_cuts_the_query_of_presigned_urls_only() -> None:
    text = ('Could not connect to the endpoint URL: "http://h:1/b/k?X-Amz-Algorithm=AWS4&X-Amz-Credential=AKID%2F'
            '&X-Amz-Signature=abc" (s3://b/k?versionId=3)')
    assert scrub_signed(text) == 'Could not connect to the endpoint URL: "http://h:1/b/k" (s3://b/k?versionId=3)'
    legacy = 'endpoint URL: "http://h:1/b/k?AWSAccessKeyId=AKID&Signature=x%3D&Expires=1"'
    assert scrub_signed(legacy) == 'endpoint URL: "http://h:1/b/k"'
