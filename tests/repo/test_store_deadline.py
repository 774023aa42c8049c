"""Every store request ends within its ``--retry-for`` budget, whatever the store does (tier 2: loopback sockets).

A loopback HTTP server speaks enough S3 to answer a GET, then trickles: one
byte of the body (or of the status line) every 0.2 s, for far longer than
any budget here.  botocore's ``read_timeout`` is per socket read, so before
store/deadline.py each of these calls was held for the whole trickle.  Each
call runs in a thread joined with a bound well above ``retry_for`` plus
``MIN_ATTEMPT_S`` and far below the trickle: a call still running then is
the bug.  Nothing is timed beyond that bound.
"""

from __future__ import annotations

import http.server
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ogrefs.store import NotFound, TransientError
from ogrefs.store.deadline import MIN_ATTEMPT_S
from ogrefs.store.file import FileStore
from ogrefs.store.retry import RetryingStore
from ogrefs.store.s3ranges import SWITCH

from tests.loopback_s3 import loopback_store

pytestmark = pytest.mark.timeout(180)
RETRY_FOR = 3.0
#: A call not over in this long is held by the store; the trickle lasts 20 minutes.
BOUND_S = RETRY_FOR + MIN_ATTEMPT_S + 12
#: A command's bound: its start (imports) and the same budget, on a busy machine.
CLI_BOUND_S = BOUND_S + 15
SIZE = 6000  # bytes: 20 minutes at one every 0.2 s
GAP_S = 0.2


class _Trickle(http.server.BaseHTTPRequestHandler):
    """GETs answered a byte at a time: the body (``head=False``) or the whole answer from its status line."""

    protocol_version = "HTTP/1.1"
    head = False
    stop = threading.Event()
    requests = 0

    def do_GET(self) -> None:
        type(self).requests += 1
        rng = self.headers.get("Range")
        first, last = (int(x) for x in rng.removeprefix("bytes=").split("-")) if rng else (0, SIZE - 1)
        status = b"206 Partial Content" if rng else b"200 OK"
        answer = (b"HTTP/1.1 " + status + b"\r\nContent-Length: %d\r\n" % (last - first + 1)
                  + (b"Content-Range: bytes %d-%d/%d\r\n" % (first, last, SIZE) if rng else b"") + b"\r\n")
        try:
            if not self.head:
                self.wfile.write(answer)
                self.wfile.flush()
                answer = b"x" * (last - first + 1)
            for i in range(len(answer)):
                if self.stop.wait(GAP_S):
                    return
                self.wfile.write(answer[i:i + 1])
                self.wfile.flush()
        except OSError:
            pass  # the client shut the connection: its deadline

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(params=["body", "status line"])
def trickling(request, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[RetryingStore, type[_Trickle]]]:
    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s" * 40)
    handler = type("Trickle", (_Trickle,), {"head": request.param == "status line", "stop": threading.Event(),
                                             "requests": 0})
    with loopback_store(handler) as store:
        try:
            yield RetryingStore(store, retry_for=RETRY_FOR), handler
        finally:
            handler.stop.set()


def _bounded(call: Callable[[], Any]) -> tuple[BaseException | None, float]:
    """What ``call`` raised (None: it returned) and the seconds it took; fails if it is not over in BOUND_S."""
    out: list = []

    def run() -> None:
        t0 = time.monotonic()
        try:
            call()
            out.append((None, time.monotonic() - t0))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append((exc, time.monotonic() - t0))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(BOUND_S)
    assert out, f"the store held the call for more than {BOUND_S} s (--retry-for {RETRY_FOR})"
    return out[0]


CALLS = {
    "get": lambda s: s.get("snapshots/one"),
    "get_range": lambda s: s.get_range("packs/ab/pack", 100, 2000),
    "list": lambda s: list(s.list("packs/")),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_trickling_store_fails_the_call_within_retry_for(trickling, call):
    store, handler = trickling
    exc, took = _bounded(lambda: CALLS[call](store))
    assert isinstance(exc, TransientError), exc
    assert "deadline" in str(exc) and f"gave up after {RETRY_FOR:.0f} s" in str(exc)
    assert handler.requests >= 1


class _SlowLink(_Trickle):
    """A steady slow link, not a trickle: the whole answer at once, then the body at 1 MiB/s."""

    def do_GET(self) -> None:
        rng = self.headers.get("Range")
        first, last = (int(x) for x in rng.removeprefix("bytes=").split("-")) if rng else (0, BIG - 1)
        self.send_response(206 if rng else 200)
        if rng:
            self.send_header("Content-Range", f"bytes {first}-{last}/{BIG}")
        self.send_header("Content-Length", str(last - first + 1))
        self.end_headers()
        body = BIG_DATA[first:last + 1]
        try:
            for i in range(0, len(body), 64 * 1024):
                if self.stop.wait(1 / 16):
                    return
                self.wfile.write(body[i:i + 64 * 1024])
        except OSError:
            pass


BIG = 3 * 1024 * 1024
BIG_DATA = os.urandom(BIG)


@pytest.mark.parametrize("call", ["get", "get_range"])
def test_a_slow_steady_link_is_not_a_trickle(call, monkeypatch: pytest.MonkeyPatch):
    """3 MiB at 1 MiB/s (3 s) with no budget left (``retry_for=0``: one attempt of MIN_ATTEMPT_S, 2 s):
    the bytes moving at more than deadline.MIN_RATE keep the request alive, and it returns them all."""
    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s" * 40)
    handler = type("SlowLink", (_SlowLink,), {"stop": threading.Event()})
    with loopback_store(handler) as inner:
        store = RetryingStore(inner, retry_for=0)
        got: list[bytes] = []
        try:
            exc, _took = _bounded(lambda: got.append(store.get("catalogs/big") if call == "get"
                                                     else store.get_range("packs/ab/pack", 0, BIG)))
        finally:
            handler.stop.set()
    assert exc is None and got == [BIG_DATA], exc


def test_a_trickling_stream_fails_within_retry_for(monkeypatch: pytest.MonkeyPatch):
    """A range long enough to be streamed (store/s3.py STREAM_ABOVE): each read has the budget."""
    from ogrefs.store import s3

    monkeypatch.setattr(s3, "STREAM_ABOVE", 1000)
    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s" * 40)
    handler = type("Trickle", (_Trickle,), {"stop": threading.Event(), "requests": 0})
    with loopback_store(handler) as inner:
        store = RetryingStore(inner, retry_for=RETRY_FOR)
        try:
            reader = store.open_range("packs/ab/pack", 0, 4000)  # the head comes at once; the body trickles
            exc, took = _bounded(lambda: reader.read(4000))
            reader.close()
        finally:
            handler.stop.set()
    assert isinstance(exc, TransientError) and "deadline" in str(exc), exc


def test_a_fifo_in_a_file_store_is_not_an_object_and_never_blocks(tmp_path):
    """A FIFO planted where an object goes: open() of it without a writer blocked for ever."""
    store = FileStore(tmp_path)
    store.put("packs/ab/real", b"data")
    os.mkfifo(tmp_path / "packs" / "ab" / "planted")
    exc, _took = _bounded(lambda: store.get("packs/ab/planted"))
    assert isinstance(exc, NotFound) and "not a regular file" in str(exc)
    exc, _took = _bounded(lambda: store.get_range("packs/ab/planted", 0, 1))
    assert isinstance(exc, NotFound)


# -- the commands, through a proxy that trickles what a real S3 (SeaweedFS) answers -------------------------

class _TrickleProxy:
    """A TCP proxy to ``target``: requests pass as they are; answers pass a byte every ``gap_s`` once
    ``trickle`` is set (HTTP-agnostic: status line, headers and body alike), on every connection or, with
    ``only`` set, on those that have sent a request holding those bytes (``b"/packs/"``: the data)."""

    def __init__(self, target: tuple[str, int], gap_s: float = 0.5) -> None:
        import socket

        self.target, self.gap_s = target, gap_s
        self.only: bytes | None = None
        self.trickle, self.stop = threading.Event(), threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while not self.stop.is_set():
            try:
                client, _ = self.listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            client.settimeout(None)
            server = socket.create_connection(self.target, timeout=10)
            server.settimeout(None)
            marked = threading.Event()  # this connection asked for what is trickled
            threading.Thread(target=self._pump, args=(client, server, None, marked), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, marked, None), daemon=True).start()

    def _pump(self, src, dst, answers_if: threading.Event | None, mark: threading.Event | None) -> None:
        try:
            while not self.stop.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if mark is not None and (self.only is None or self.only in data):
                    mark.set()
                if answers_if is not None and answers_if.is_set() and self.trickle.is_set():
                    for i in range(len(data)):
                        if self.stop.wait(self.gap_s):
                            return
                        dst.sendall(data[i:i + 1])
                else:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


@pytest.mark.s3
def test_restore_snapshot_and_mount_against_a_trickling_s3_end_within_retry_for(tmp_path, seaweed):
    """What the adversarial pass saw hold 170-200 s despite --retry-for 10: a restore, a snapshot and a
    mount's start, each against an S3 whose every answer trickles a byte every 0.5 s, and a restore whose
    pack reads alone trickle.  Each now ends within the bound, the first three with a one-line error, the
    last with its file reported not restored (before: each was still running at the bound)."""
    import json
    import subprocess
    import sys
    import urllib.parse

    seaweed.ensure_running()
    env = dict(os.environ, **seaweed.env(), OGREFS_REPO=f"s3://{seaweed.new_bucket()}/repo",
               OGREFS_CACHE_DIR=str(tmp_path / "cache"), OGREFS_STATE_DIR=str(tmp_path / "state"),
               OGREFS_RUNTIME_DIR=str(tmp_path / "run"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.bin").write_bytes(os.urandom(100_000))

    def cli(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ogrefs", *args], env=env, capture_output=True, text=True,
                              timeout=timeout)

    assert cli(["-q", "init"], env).returncode == 0
    sid = json.loads(cli(["-q", "snapshot", "--json", str(src)], env).stdout)["id"]
    end = urllib.parse.urlsplit(seaweed.endpoint)
    proxy = _TrickleProxy((end.hostname, end.port))
    try:
        slow = dict(env, OGREFS_S3_ENDPOINT=proxy.url, OGREFS_CACHE_DIR=str(tmp_path / "cold-cache"))
        proxy.trickle.set()
        (tmp_path / "mnt").mkdir()
        for args in (["restore", "--retry-for", "3", sid, str(tmp_path / "out")],
                     ["snapshot", "--retry-for", "3", str(src)],
                     ["mount", "--retry-for", "3", "--read-only", sid, str(tmp_path / "mnt")]):
            try:  # the bound: a command still running then is held by the store (TimeoutExpired kills it)
                done = cli(args, slow, timeout=CLI_BOUND_S)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"`ogrefs {args[0]} --retry-for 3` was still held after {CLI_BOUND_S} s") from None
            lines = done.stderr.strip().splitlines()
            assert done.returncode != 0 and len(lines) == 1 and "deadline" in lines[0], (args[0], done.stderr)
        # the repository opens at full speed; only the data trickles: the restore's pack reads
        proxy.only = b"/packs/"
        slow["OGREFS_CACHE_DIR"] = str(tmp_path / "cold-cache-2")
        try:
            done = cli(["restore", "--retry-for", "3", sid, str(tmp_path / "out2")], slow, timeout=CLI_BOUND_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a restore whose pack reads trickle was still held after {CLI_BOUND_S} s") from None
        assert done.returncode != 0 and "deadline" in done.stderr and "Traceback" not in done.stderr, done.stderr
    finally:
        proxy.close()
