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

No state shared between threads: a source belongs to the agent's notice thread.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime

DEFAULT_ENDPOINTS = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
GCP_GRACE_S = 30.0
HTTP_TIMEOUT_S = 2.0
#: How long one of GCP's hanging GETs may wait for a change (the server answers the current value then).
GCP_WAIT_S = 60


@dataclass(frozen=True)
class Notice:
    provider: str
    action: str
    seen: float  # wall clock, when the agent first saw it
    deadline: float | None  # wall clock, when the instance goes; None if not given

    def as_dict(self) -> dict:
        return {"provider": self.provider, "action": self.action, "seen": self.seen, "deadline": self.deadline}


def _request(url: str, headers: dict[str, str], method: str = "GET",
             timeout: float = HTTP_TIMEOUT_S) -> tuple[int, bytes, dict[str, str]]:
    """Status, body and headers (names in lower case) of one request to the metadata service."""
    req = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - configured endpoint
            return resp.status, resp.read(1 << 20), {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as exc:
        return exc.code, b"", {}


class NoticeSource:
    provider = ""

    def __init__(self, endpoint: str | None = None) -> None:
        self.endpoint = (endpoint or DEFAULT_ENDPOINTS[self.provider]).rstrip("/")

    def poll(self) -> Notice | None:
        """The current notice, or None; OSError when the metadata service cannot be reached."""
        raise NotImplementedError

    def next_wait(self, poll_s: float) -> float:
        """Seconds to wait before the next :meth:`poll` (0: the next poll itself waits for a change)."""
        return poll_s


class AwsSpot(NoticeSource):
    provider = "aws"

    def poll(self) -> Notice | None:
        code, token, _ = _request(f"{self.endpoint}/latest/api/token",
                               {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, method="PUT")
        if code != 200:
            raise OSError(f"IMDSv2 token request answered {code}")
        code, body, _ = _request(f"{self.endpoint}/latest/meta-data/spot/instance-action",
                              {"X-aws-ec2-metadata-token": token.decode("ascii", "replace")})
        if code == 404:
            return None
        if code != 200:
            raise OSError(f"spot/instance-action answered {code}")
        try:
            doc = json.loads(body)
            deadline = datetime.fromisoformat(str(doc["time"]).replace("Z", "+00:00")).timestamp()
            action = str(doc.get("action", "terminate"))
        except (ValueError, KeyError, TypeError):
            return Notice(self.provider, "unknown", time.time(), None)
        return Notice(self.provider, action, time.time(), deadline)


class GcpPreempted(NoticeSource):
    provider = "gcp"

    def __init__(self, endpoint: str | None = None) -> None:
        super().__init__(endpoint)
        self._etag: str | None = None  # the value's ETag as last answered; None: ask plainly
        self._at_once = False  # the next poll may follow at once: its request waits for a change

    def poll(self) -> Notice | None:
        url, timeout = f"{self.endpoint}/computeMetadata/v1/instance/preempted", HTTP_TIMEOUT_S
        asked_etag = self._etag
        if asked_etag is not None:
            url += "?" + urllib.parse.urlencode({"wait_for_change": "true", "last_etag": asked_etag,
                                                 "timeout_sec": GCP_WAIT_S})
            timeout = GCP_WAIT_S + HTTP_TIMEOUT_S
        t0 = time.monotonic()
        try:
            code, body, headers = _request(url, {"Metadata-Flavor": "Google"}, timeout=timeout)
        except OSError:
            self._etag, self._at_once = None, False
            raise
        if code != 200:
            self._etag, self._at_once = None, False
            raise OSError(f"instance/preempted answered {code}")
        etag = headers.get("etag") or None
        # After a plain GET, an ETag means the next request can wait; after a hanging one, only if the
        # server honoured it (it waited, or the value changed) -- else it answers at once and we poll.
        self._at_once = etag is not None and (asked_etag is None or etag != asked_etag
                                              or time.monotonic() - t0 >= 1.0)
        self._etag = etag
        if body.strip().upper() != b"TRUE":
            return None
        now = time.time()
        return Notice(self.provider, "preempted", now, now + GCP_GRACE_S)

    def next_wait(self, poll_s: float) -> float:
        return 0.0 if self._at_once else poll_s


class AzureScheduledEvents(NoticeSource):
    provider = "azure"

    def poll(self) -> Notice | None:
        code, body, _ = _request(f"{self.endpoint}/metadata/scheduledevents?api-version=2020-07-01",
                                 {"Metadata": "true"})
        if code != 200:
            raise OSError(f"scheduledevents answered {code}")
        try:
            events = json.loads(body).get("Events") or []
        except (ValueError, AttributeError):
            raise OSError("scheduledevents answered something that is not JSON") from None
        for ev in events:
            if isinstance(ev, dict) and ev.get("EventType") == "Preempt":
                deadline = None
                try:
                    deadline = parsedate_to_datetime(str(ev.get("NotBefore"))).astimezone(timezone.utc).timestamp()
                except (TypeError, ValueError):
                    pass
                return Notice(self.provider, "preempt", time.time(), deadline)
        return None


SOURCES = {"aws": AwsSpot, "gcp": GcpPreempted, "azure": AzureScheduledEvents}
