"""FUSE requests as the kernel saw them: ``perf script`` output of the fuse tracepoints, paired and summed.

The kernel (5.19 and later) has two tracepoints, ``fuse:fuse_request_send``
(a request queued for the daemon: its connection, its unique id, its opcode,
the task that caused it) and ``fuse:fuse_request_end`` (the daemon's answer
arrived).  Paired by (connection, unique id) they give each request's
latency as the application waits for it, whatever the daemon does inside:
what a step through the mount pays per request, which pyfuse3's own
counters cannot tell (they start when the daemon has already taken the
request).  scripts/fuse_requests records a command with them; this module
parses and summarizes, and has no I/O of its own (tests feed it text).

Asynchronous requests (RELEASE, RELEASEDIR, FORGET, the kernel's own
read-ahead READs) are counted too: nothing waits for them directly, but they
occupy the daemon between the ones something waits for.  Summed latency is
therefore an upper bound of what the requesting tasks waited (parallel
readers of one process overlap).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Iterable

#: ``perf script -F comm,pid,tid,time,event,trace`` lines of the two tracepoints
_LINE = re.compile(r"\s*(?P<comm>.+?)\s+(?P<pid>\d+)/(?P<tid>\d+)\s+(?P<time>\d+\.\d+):"
                   r"\s+fuse:(?P<event>fuse_request_\w+):\s+connection (?P<conn>\d+) req (?P<req>\d+)"
                   r"(?: opcode \d+ \((?P<op>\w+)\))? len (?P<len>\d+)")


#: struct fuse_out_header: len, error, unique
REPLY_HEADER = 16


@dataclass(frozen=True)
class Request:
    """One answered request: when it was sent (seconds, perf's clock), by which task, how long it took."""

    sent: float
    latency: float
    opcode: str  # without the FUSE_ prefix: READ, LOOKUP, OPEN ...
    comm: str
    pid: int
    connection: int
    reply_bytes: int = 0  # the answer's length less its 16-byte header: a READ's data


@dataclass
class Parsed:
    requests: list[Request] = field(default_factory=list)
    unanswered: int = 0  # sent and not answered while recording (still in flight at its end, or interrupted)
    unmatched_ends: int = 0  # answered, sent before recording began


def parse(lines: Iterable[str]) -> Parsed:
    """Pair sends and ends by (connection, unique id); lines of other events are ignored."""
    out = Parsed()
    pending: dict[tuple[int, int], tuple[float, str, str, int]] = {}
    for line in lines:
        m = _LINE.match(line)
        if m is None:
            continue
        key = (int(m["conn"]), int(m["req"]))
        t = float(m["time"])
        if m["event"] == "fuse_request_send":
            op = (m["op"] or "?").removeprefix("FUSE_")
            pending[key] = (t, op, m["comm"].strip(), int(m["pid"]))
        elif m["event"] == "fuse_request_end":
            sent = pending.pop(key, None)
            if sent is None:
                out.unmatched_ends += 1
                continue
            t0, op, comm, pid = sent
            out.requests.append(Request(t0, t - t0, op, comm, pid, key[0], max(0, int(m["len"]) - REPLY_HEADER)))
    out.unanswered = len(pending)
    out.requests.sort(key=lambda r: r.sent)
    return out


@dataclass(frozen=True)
class OpSummary:
    opcode: str
    count: int
    total_s: float
    median_us: float
    p90_us: float
    max_ms: float
    reply_bytes: int  # summed: for READ, the data it returned


def by_opcode(requests: Iterable[Request]) -> list[OpSummary]:
    """Per opcode, the largest summed latency first."""
    groups: dict[str, list[float]] = {}
    replied: dict[str, int] = {}
    for r in requests:
        groups.setdefault(r.opcode, []).append(r.latency)
        replied[r.opcode] = replied.get(r.opcode, 0) + r.reply_bytes
    rows = []
    for op, lat in groups.items():
        lat.sort()
        rows.append(OpSummary(op, len(lat), sum(lat), statistics.median(lat) * 1e6,
                              lat[min(len(lat) - 1, int(len(lat) * 0.9))] * 1e6, lat[-1] * 1e3, replied[op]))
    rows.sort(key=lambda s: (-s.total_s, s.opcode))
    return rows


def buckets(requests: list[Request], width: float) -> list[tuple[float, int, float, int, float]]:
    """Per ``width`` seconds from the first request: (start, READ count, READ latency s, others' count, their
    latency s)."""
    if not requests:
        return []
    t0 = requests[0].sent
    rows: dict[int, list[float]] = {}
    for r in requests:
        row = rows.setdefault(int((r.sent - t0) // width), [0, 0.0, 0, 0.0])
        i = 0 if r.opcode == "READ" else 2
        row[i] += 1
        row[i + 1] += r.latency
    return [(k * width, int(v[0]), v[1], int(v[2]), v[3]) for k, v in sorted(rows.items())]
