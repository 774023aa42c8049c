"""Retention policies: which snapshots ``ogrefs forget`` keeps, and why.

Snapshots are grouped by (host, paths) by default, as restic does
(``--group-by`` takes any of host, paths, tags, comma-separated, or nothing),
and always by box as well: machines of one host name (cloned images) are
different boxes, and retention never forgets one box's snapshots because
another box has newer ones. Each group is judged on its own. A snapshot is
kept if any rule keeps it:

* ``keep_last N``: the N newest;
* ``keep_hourly/daily/weekly/monthly/yearly N``: the newest snapshot of each
  of the N most recent hours/days/ISO weeks/months/years that have snapshots
  (in local time, as the user reads them);
* ``keep_within D``: every snapshot less than D (``1y2m3d4h``) older than the
  group's newest;
* ``keep_tags``: every snapshot carrying one of these tags.

With no rule at all nothing is removed (``forget`` without a policy is an
error at the CLI). Pure functions over manifests: easy to test, no store.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Callable

from ogrefs.errors import UsageError
from ogrefs.repo.repository import box_of

Manifest = dict[str, Any]


@dataclass
class Policy:
    keep_last: int = 0
    keep_hourly: int = 0
    keep_daily: int = 0
    keep_weekly: int = 0
    keep_monthly: int = 0
    keep_tags: list[str] = field(default_factory=list)
    keep_yearly: int = 0
    keep_within: str | None = None  # a duration, e.g. 2y5m7d3h

    def empty(self) -> bool:
        return not (self.keep_last or self.keep_hourly or self.keep_daily or self.keep_weekly
                    or self.keep_monthly or self.keep_yearly or self.keep_within or self.keep_tags)


_DURATION = re.compile(r"(\d+)([ymdh])")


def parse_duration(text: str) -> timedelta:
    """restic's durations: ``1y2m3d4h`` (a year is 365 days, a month 30)."""
    if not text or not re.fullmatch(r"(\d+[ymdh])+", text):
        raise UsageError(f"{text!r} is not a duration (examples: 7d, 2m, 1y6m, 36h)")
    days = {"y": 365, "m": 30, "d": 1, "h": 1 / 24}
    return timedelta(days=sum(int(n) * days[u] for n, u in _DURATION.findall(text)))


GROUP_FIELDS = ("host", "paths", "tags")


def parse_group_by(text: str) -> tuple[str, ...]:
    fields = tuple(f.strip() for f in text.split(",") if f.strip())
    bad = [f for f in fields if f not in GROUP_FIELDS]
    if bad:
        raise UsageError(f"--group-by {text!r}: {', '.join(bad)} is not one of host, paths, tags")
    return fields


_BUCKETS: dict[str, Callable[[datetime], tuple]] = {
    "hourly": lambda t: (t.year, t.month, t.day, t.hour),
    "daily": lambda t: (t.year, t.month, t.day),
    "weekly": lambda t: tuple(t.isocalendar()[:2]),
    "monthly": lambda t: (t.year, t.month),
    "yearly": lambda t: (t.year,),
}


def group_key(m: Manifest, by: tuple[str, ...] = ("host", "paths")) -> tuple:
    """The group ``m`` is judged in: its box, then the fields of ``by``."""
    values = {"host": m.get("host", ""), "paths": tuple(sorted(m.get("paths", []))),
              "tags": tuple(sorted(m.get("tags", [])))}
    return (box_of(m), *(values[f] for f in by))


def _local(m: Manifest) -> datetime:
    return datetime.fromisoformat(m["time"]).astimezone()


def apply_policy(manifests: list[Manifest], policy: Policy, group_by: tuple[str, ...] = ("host", "paths")
                 ) -> tuple[list[tuple[Manifest, list[str]]], list[Manifest]]:
    """Returns (kept with reasons, removed), each newest first."""
    if policy.empty():
        return [(m, ["no policy"]) for m in manifests], []
    within = parse_duration(policy.keep_within) if policy.keep_within else None
    groups: dict[tuple, list[Manifest]] = {}
    for m in manifests:
        groups.setdefault(group_key(m, group_by), []).append(m)
    kept: list[tuple[Manifest, list[str]]] = []
    removed: list[Manifest] = []
    for members in groups.values():
        members.sort(key=lambda m: m["time"], reverse=True)
        reasons: dict[str, list[str]] = {m["id"]: [] for m in members}
        for m in members[: policy.keep_last]:
            reasons[m["id"]].append("last")
        for name, fn in _BUCKETS.items():
            n = getattr(policy, f"keep_{name}")
            seen: list[tuple] = []
            for m in members:
                if len(seen) >= n:
                    break
                bucket = fn(_local(m))
                if bucket not in seen:
                    seen.append(bucket)
                    reasons[m["id"]].append(name)
        if within is not None:
            newest = _local(members[0])
            for m in members:
                if newest - _local(m) < within:
                    reasons[m["id"]].append(f"within {policy.keep_within}")
        for m in members:
            for tag in policy.keep_tags:
                if tag in m.get("tags", []):
                    reasons[m["id"]].append(f"tag {tag}")
        for m in members:
            (kept.append((m, reasons[m["id"]])) if reasons[m["id"]] else removed.append(m))
    kept.sort(key=lambda x: x[0]["time"], reverse=True)
    removed.sort(key=lambda m: m["time"], reverse=True)
    return kept, removed
