"""Preemption notices from the cloud's instance metadata service: AWS, GCP, Azure.

Each provider is a :class:`NoticeSource` with a blocking :meth:`~NoticeSource.poll`
(short HTTP timeouts) that returns a :class:`Notice` while the instance is
being reclaimed, else None:

* AWS EC2 spot: IMDSv2 — ``PUT /latest/api/token`` with
  ``X-aws-ec2-metadata-token-ttl-seconds``, then
  ``GET /latest/meta-data/spot/instance-action`` with ``X-aws-ec2-metadata-token``;
  404 means no notice, 200 gives ``{"action": ..., "time": ISO}`` (the deadline,
  about two minutes ahead).
* GCP: ``GET /computeMetadata/v1/instance/preempted`` with
  ``Metadata-Flavor: Google``; ``TRUE`` means preempted (30 s of grace, from the
  moment it was first seen).  Once the server has given an ``ETag``, each
  request is a hanging GET (``?wait_for_change=true&last_etag=…&timeout_sec=…``,
  GCP's documented way to wait for a metadata value): the server answers the
  moment the value changes, so a notice is seen at once instead of up to one
  poll interval late, out of a 30 s grace.  A server that answers such a
  request at once with the value unchanged does not honour it; the agent then
  polls as for the others.
* Azure: ``GET /metadata/scheduledevents?api-version=2020-07-01`` with
  ``Metadata: true``; an event with ``EventType`` ``Preempt`` (its
  ``NotBefore`` is the deadline).

The endpoint of each is configurable (``--metadata-endpoint``).  The default is
the provider's link-local address; nothing here contacts it unless the agent is
told to watch that provider.  Tests use fake servers on 127.0.0.1.

What an answer can be, and what the agent makes of it:

* no answer at all (the address cannot be reached: not on this cloud, or the
  service is down) -- :meth:`~NoticeSource.poll` raises OSError; the agent
  logs it and polls on;
* one of the protocol's answers -- no notice (None), or a :class:`Notice`;
* anything else once the server has taken the connection -- a garbage status
  line, a body that does not parse or has the wrong shape, a server error, an
  answer cut off, or one that does not arrive whole in time -- is a *maybe*
  notice (``Notice.doubt`` says why): the metadata service is the box's only
  word that it is being reclaimed, and an odd answer costs one snapshot while a
  missed notice costs the work since the last one.  Its deadline is the
  provider's shortest grace from the moment it was seen (:data:`GRACE_S`).

Every request has an overall deadline, not only a timeout per socket read
(:class:`_DeadlineSocket`): a server that trickles its answer a byte at a
time is cut off at the deadline.  A GCP hanging GET may wait up to its
``timeout_sec`` for the first byte; once the answer starts, the rest must
come within :data:`HTTP_TIMEOUT_S`, so a trickled notice is still acted on
well inside GCP's 30 s.

No state shared between threads: a source belongs to the agent's notice thread.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime

DEFAULT_ENDPOINTS = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
GCP_GRACE_S = 30.0
#: The shortest time a provider gives between its notice and the end: a maybe notice's deadline.
GRACE_S = {"aws": 120.0, "gcp": GCP_GRACE_S, "azure": 30.0}
#: Connecting, and the whole of an answer once it has started (or of a plain request).
HTTP_TIMEOUT_S = 2.0
#: At most this much of an answer is read; a longer one is odd.
MAX_ANSWER = 1 << 20
#: How long one of GCP's hanging GETs may wait for a change (the server answers the current value then).
GCP_WAIT_S = 60


@dataclass(frozen=True)
class Notice:
    provider: str
    action: str
    seen: float  # wall clock, when the agent first saw it
    deadline: float | None  # wall clock, when the instance goes; None if not given
    doubt: str | None = None  # a maybe notice: why the answer was not one of the protocol's

    def as_dict(self) -> dict:
        out = {"provider": self.provider, "action": self.action, "seen": self.seen, "deadline": self.deadline}
        if self.doubt is not None:
            out["doubt"] = self.doubt
        return out


class OddAnswer(Exception):
    """The metadata service answered, but not as its protocol does (see the module docstring)."""


class _DeadlineSocket(socket.socket):
    """A connected socket whose reads end at a wall-clock deadline, however the bytes trickle in.

    ``first_by``: monotonic time by which the answer's first byte must come;
    once it has, the rest must come within ``rest_s`` of it.  http.client reads
    through ``recv_into``.
    """

    first_by = 0.0
    rest_s = HTTP_TIMEOUT_S
    _by: float | None = None

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:  # noqa: ANN001 - socket's signature
        by = self.first_by if self._by is None else self._by
        left = by - time.monotonic()
        if left <= 0:
            raise TimeoutError("no whole answer in time")
        self.settimeout(left)
        got = super().recv_into(buffer, nbytes, flags)
        if self._by is None:
            self._by = time.monotonic() + self.rest_s
        return got


class _Connection(http.client.HTTPConnection):
    def __init__(self, host: str, port: int | None, first_by: float) -> None:
        super().__init__(host, port, timeout=HTTP_TIMEOUT_S)
        self._first_by = first_by

    def connect(self) -> None:
        super().connect()
        plain = self.sock
        self.sock = _DeadlineSocket(plain.family, plain.type, plain.proto, fileno=plain.detach())
        self.sock.first_by = self._first_by


def _request(url: str, headers: dict[str, str], method: str = "GET",
             hold: float = 0.0) -> tuple[int, bytes, dict[str, str]]:
    """Status, body and headers (names in lower case) of one request to the metadata service.

    ``hold``: seconds the server may hold the request before it answers (beyond
    :data:`HTTP_TIMEOUT_S`).  OSError: the service
    cannot be reached; :class:`OddAnswer`: it answered, but not with a whole HTTP
    answer in time.  No proxy: the service is the box's own link-local address.
    """
    parts = urllib.parse.urlsplit(url)
    conn = _Connection(parts.hostname or "", parts.port, time.monotonic() + HTTP_TIMEOUT_S + hold)
    try:
        conn.connect()  # a failure here: nothing answers (OSError)
        try:
            conn.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), headers=headers)
            resp = conn.getresponse()
            body = resp.read(MAX_ANSWER + 1)
        except TimeoutError:
            raise OddAnswer(f"{method} {parts.path}: no whole answer in time (a slow or trickling server)") from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise OddAnswer(f"{method} {parts.path}: {type(exc).__name__}: {exc}"[:300]) from None
        if len(body) > MAX_ANSWER:
            raise OddAnswer(f"{method} {parts.path}: an answer of more than {MAX_ANSWER} bytes")
        return resp.status, body, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


class NoticeSource:
    provider = ""

    def __init__(self, endpoint: str | None = None) -> None:
        self.endpoint = (endpoint or DEFAULT_ENDPOINTS[self.provider]).rstrip("/")

    def poll(self) -> Notice | None:
        """The current notice, a maybe notice (an odd answer), or None; OSError when nothing answers."""
        try:
            return self._ask()
        except OSError:
            self._forget()
            raise
        except Exception as exc:  # noqa: BLE001 - any answer we cannot read is a maybe notice, never the end
            self._forget()
            doubt = str(exc) if isinstance(exc, OddAnswer) else f"{type(exc).__name__}: {exc}"[:300]
            now = time.time()
            return Notice(self.provider, "maybe", now, now + GRACE_S[self.provider], doubt)

    def _ask(self) -> Notice | None:
        """One question to the service: a Notice, None, OSError (no answer) or any other error (an odd answer)."""
        raise NotImplementedError

    def _forget(self) -> None:
        """Drop what the last answer taught (an odd or missing answer teaches nothing)."""

    def next_wait(self, poll_s: float) -> float:
        """Seconds to wait before the next :meth:`poll` (0: the next poll itself waits for a change)."""
        return poll_s


def _answered(code: int, what: str, *expected: int) -> None:
    """A refusal (4xx) is an error like no answer; a status the protocol does not give is odd."""
    if code in expected:
        return
    if 400 <= code < 500:
        raise OSError(f"{what} answered {code}")
    raise OddAnswer(f"{what} answered {code}")


class AwsSpot(NoticeSource):
    provider = "aws"

    def _ask(self) -> Notice | None:
        code, token, _ = _request(f"{self.endpoint}/latest/api/token",
                                  {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, method="PUT")
        _answered(code, "IMDSv2 token request", 200)
        code, body, _ = _request(f"{self.endpoint}/latest/meta-data/spot/instance-action",
                                 {"X-aws-ec2-metadata-token": token.decode("ascii", "replace")})
        if code == 404:
            return None
        _answered(code, "spot/instance-action", 200)
        try:
            doc = json.loads(body)
            deadline = datetime.fromisoformat(str(doc["time"]).replace("Z", "+00:00")).timestamp()
            action = str(doc.get("action", "terminate"))
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
            raise OddAnswer(f"spot/instance-action answered 200 with {type(exc).__name__}: {exc}"[:300]) from None
        return Notice(self.provider, action, time.time(), deadline)


class GcpPreempted(NoticeSource):
    provider = "gcp"

    def __init__(self, endpoint: str | None = None) -> None:
        super().__init__(endpoint)
        self._etag: str | None = None  # the value's ETag as last answered; None: ask plainly
        self._at_once = False  # the next poll may follow at once: its request waits for a change

    def _forget(self) -> None:
        self._etag, self._at_once = None, False

    def _ask(self) -> Notice | None:
        url, hold = f"{self.endpoint}/computeMetadata/v1/instance/preempted", 0.0
        asked_etag = self._etag
        if asked_etag is not None:
            url += "?" + urllib.parse.urlencode({"wait_for_change": "true", "last_etag": asked_etag,
                                                 "timeout_sec": GCP_WAIT_S})
            hold = GCP_WAIT_S
        t0 = time.monotonic()
        code, body, headers = _request(url, {"Metadata-Flavor": "Google"}, hold=hold)
        _answered(code, "instance/preempted", 200)
        value = body.strip().upper()
        if value not in (b"TRUE", b"FALSE"):
            raise OddAnswer(f"instance/preempted answered {body[:40]!r}")
        etag = headers.get("etag") or None
        # After a plain GET, an ETag means the next request can wait; after a hanging one, only if the
        # server honoured it (it waited, or the value changed) -- else it answers at once and we poll.
        self._at_once = etag is not None and (asked_etag is None or etag != asked_etag
                                              or time.monotonic() - t0 >= 1.0)
        self._etag = etag
        if value != b"TRUE":
            return None
        now = time.time()
        return Notice(self.provider, "preempted", now, now + GCP_GRACE_S)

    def next_wait(self, poll_s: float) -> float:
        return 0.0 if self._at_once else poll_s


class AzureScheduledEvents(NoticeSource):
    provider = "azure"

    def _ask(self) -> Notice | None:
        code, body, _ = _request(f"{self.endpoint}/metadata/scheduledevents?api-version=2020-07-01",
                                 {"Metadata": "true"})
        _answered(code, "scheduledevents", 200)
        try:
            doc = json.loads(body)
        except ValueError:
            raise OddAnswer("scheduledevents answered something that is not JSON") from None
        events = doc.get("Events") if isinstance(doc, dict) else None
        if not isinstance(events, list):
            raise OddAnswer(f"scheduledevents answered Events of type {type(events).__name__}, not a list")
        for ev in events:
            if isinstance(ev, dict) and ev.get("EventType") == "Preempt":
                deadline = None
                try:
                    deadline = parsedate_to_datetime(str(ev.get("NotBefore"))).astimezone(timezone.utc).timestamp()
                except (TypeError, ValueError, OverflowError):
                    pass
                return Notice(self.provider, "preempt", time.time(), deadline)
        return None


SOURCES = {"aws": AwsSpot, "gcp": GcpPreempted, "azure": AzureScheduledEvents}
