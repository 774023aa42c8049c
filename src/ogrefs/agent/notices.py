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
  moment it was first seen).
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


@dataclass(frozen=True)
class Notice:
    provider: str
    action: str
    seen: float  # wall clock, when the agent first saw it
    deadline: float | None  # wall clock, when the instance goes; None if not given

    def as_dict(self) -> dict:
        return {"provider": self.provider, "action": self.action, "seen": self.seen, "deadline": self.deadline}


def _request(url: str, headers: dict[str, str], method: str = "GET") -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:  # noqa: S310 - configured endpoint
            return resp.status, resp.read(1 << 20)
    except urllib.error.HTTPError as exc:
        return exc.code, b""


class NoticeSource:
    provider = ""

    def __init__(self, endpoint: str | None = None) -> None:
        self.endpoint = (endpoint or DEFAULT_ENDPOINTS[self.provider]).rstrip("/")

    def poll(self) -> Notice | None:
        """The current notice, or None; OSError when the metadata service cannot be reached."""
        raise NotImplementedError


class AwsSpot(NoticeSource):
    provider = "aws"

    def poll(self) -> Notice | None:
        code, token = _request(f"{self.endpoint}/latest/api/token",
                               {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, method="PUT")
        if code != 200:
            raise OSError(f"IMDSv2 token request answered {code}")
        code, body = _request(f"{self.endpoint}/latest/meta-data/spot/instance-action",
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

    def poll(self) -> Notice | None:
        code, body = _request(f"{self.endpoint}/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
        if code != 200:
            raise OSError(f"instance/preempted answered {code}")
        if body.strip().upper() != b"TRUE":
            return None
        now = time.time()
        return Notice(self.provider, "preempted", now, now + GCP_GRACE_S)


class AzureScheduledEvents(NoticeSource):
    provider = "azure"

    def poll(self) -> Notice | None:
        code, body = _request(f"{self.endpoint}/metadata/scheduledevents?api-version=2020-07-01", {"Metadata": "true"})
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
