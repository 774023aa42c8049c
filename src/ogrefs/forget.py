"""Retention policies: which snapshots ``ogrefs forget`` keeps, and why.

Snapshots are grouped by (host, paths), as restic does, and each group is
judged on its own. A snapshot is kept if any rule keeps it:

* ``keep_last N``: the N newest;
* ``keep_hourly/daily/weekly/monthly N``: the newest snapshot of each of the
  N most recent hours/days/ISO weeks/months that have snapshots;
* ``keep_tags``: every snapshot carrying one of these tags.

With no rule at all nothing is removed (``forget`` without a policy is an
error at the CLI). Pure functions over manifests: easy to test, no store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable

Manifest = dict[str, Any]


@dataclass
class Policy:
    keep_last: int = 0
    keep_hourly: int = 0
    keep_daily: int = 0
    keep_weekly: int = 0
    keep_monthly: int = 0
    keep_tags: list[str] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.keep_last or self.keep_hourly or self.keep_daily or self.keep_weekly
                    or self.keep_monthly or self.keep_tags)


_BUCKETS: dict[str, Callable[[datetime], tuple]] = {
    "hourly": lambda t: (t.year, t.month, t.day, t.hour),
    "daily": lambda t: (t.year, t.month, t.day),
    "weekly": lambda t: tuple(t.isocalendar()[:2]),
    "monthly": lambda t: (t.year, t.month),
}


def group_key(m: Manifest) -> tuple[str, tuple[str, ...]]:
    return m.get("host", ""), tuple(sorted(m.get("paths", [])))


def apply_policy(manifests: list[Manifest], policy: Policy) -> tuple[list[tuple[Manifest, list[str]]], list[Manifest]]:
    """Returns (kept with reasons, removed), each newest first."""
    if policy.empty():
        return [(m, ["no policy"]) for m in manifests], []
    groups: dict[tuple, list[Manifest]] = {}
    for m in manifests:
        groups.setdefault(group_key(m), []).append(m)
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
                bucket = fn(datetime.fromisoformat(m["time"]))
                if bucket not in seen:
                    seen.append(bucket)
                    reasons[m["id"]].append(name)
        for m in members:
            for tag in policy.keep_tags:
                if tag in m.get("tags", []):
                    reasons[m["id"]].append(f"tag {tag}")
        for m in members:
            (kept.append((m, reasons[m["id"]])) if reasons[m["id"]] else removed.append(m))
    kept.sort(key=lambda x: x[0]["time"], reverse=True)
    removed.sort(key=lambda m: m["time"], reverse=True)
    return kept, removed
