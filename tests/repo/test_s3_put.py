"""S3Store.put against a loopback server that records each request's headers: who waits for ``100 Continue``.

A small put (a lock, a manifest, a trace) sends its body at once, in the
request's first round trip; only a body above CONTINUE_ABOVE (a pack) asks
the server first (``Expect: 100-continue``), as botocore does for every put.
"""

from __future__ import annotations

import http.server
from typing import Any, Iterator

import pytest

from ogrefs.store.s3 import CONTINUE_ABOVE, S3Store

from tests.loopback_s3 import loopback_store


class _Recorder(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # http.server answers ``Expect: 100-continue`` only under HTTP/1.1
    seen: list[tuple[str, dict[str, str], bytes]] = []

    def do_PUT(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append((self.path, dict(self.headers), body))
        self.send_response(200)
        self.send_header("ETag", '"0"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[S3Store, type[_Recorder]]]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s" * 40)
    handler = type("Recorder", (_Recorder,), {"seen": []})
    with loopback_store(handler) as store:
        yield store, handler


def _expects_continue(headers: dict[str, str]) -> bool:
    return any(k.lower() == "expect" and v.lower() == "100-continue" for k, v in headers.items())


def test_small_put_sends_its_body_without_waiting_for_continue(recording):
    store, server = recording
    store.put("locks/abc", b"a lock's few bytes")
    store.put("edge", b"e" * CONTINUE_ABOVE)
    assert [(path, body) for path, _, body in server.seen] == [("/bkt/p/locks/abc", b"a lock's few bytes"),
                                                              ("/bkt/p/edge", b"e" * CONTINUE_ABOVE)]
    assert not any(_expects_continue(headers) for _, headers, _ in server.seen)


def test_large_put_still_asks_the_server_first(recording):
    store, server = recording
    data = bytes(range(256)) * ((CONTINUE_ABOVE // 256) + 1)
    store.put("packs/00/big", data)
    [(path, headers, body)] = server.seen
    assert path == "/bkt/p/packs/00/big" and body == data
    assert _expects_continue(headers)
