"""Which snapshot a selector means: boxes, latest, latest-checkpoint (tier 1: manifests only)."""

from __future__ import annotations

import pytest

from ogrefs.errors import SnapshotNotFound
from ogrefs.snapshot.selection import box_of, checkpoint_of, resolve_snapshot, split_selector


class _Repo:
    class store:
        url = "mem://"

    def __init__(self, manifests):
        self.manifests = manifests

    def list_snapshots(self):
        return sorted(self.manifests, key=lambda m: m["time"])

    def resolve(self, name):
        return next(m for m in self.manifests if m["id"].startswith(name))

    def load_manifest(self, sid):
        raise SnapshotNotFound(sid)


def _m(i, box, step=None, coherent=True, run="/w/run", host="h"):
    m = {"id": f"{i:02d}" + "a" * 62, "time": f"2026-12-01T10:{i:02d}:00", "host": host, "paths": ["/"]}
    if box is not None:
        m["box"] = box
    if step is not None:
        m["environment"] = {"checkpoints": {"latest_coherent": {
            "run": run, "step": step, "epoch": None, "coherent": coherent, "path": f"{run}/checkpoint-{step}"}}}
    return m


def test_latest_is_this_boxs_never_anothers(monkeypatch):
    repo = _Repo([_m(1, "a"), _m(2, "b"), _m(3, None, host="oldhost")])
    monkeypatch.setenv("OGREFS_BOX", "a")
    assert resolve_snapshot(repo, "latest")["id"].startswith("01")
    assert resolve_snapshot(repo, "b:latest")["id"].startswith("02")
    assert resolve_snapshot(repo, "oldhost:latest")["id"].startswith("03")  # before boxes: the host
    monkeypatch.setenv("OGREFS_BOX", "c")
    with pytest.raises(SnapshotNotFound, match="no snapshot of box 'c'.*a, b, oldhost"):
        resolve_snapshot(repo, "latest")
    assert box_of(_m(3, None, host="x")) == "x" and split_selector("my:box:latest") == ("my:box", "latest")


def test_latest_checkpoint_is_progress_not_the_newest_copy(monkeypatch):
    monkeypatch.setenv("OGREFS_BOX", "a")
    # 04 is newer but holds an older checkpoint; 05 holds a torn one (its latest coherent is none)
    repo = _Repo([_m(1, "a", 100), _m(2, "a", 300), _m(3, "b", 900), _m(4, "a", 200), _m(5, "a", 400, coherent=False)])
    assert checkpoint_of(repo.manifests[4]) is None
    assert resolve_snapshot(repo, "latest-checkpoint")["id"].startswith("02")
    assert resolve_snapshot(repo, "b:latest-checkpoint")["id"].startswith("03")
    assert resolve_snapshot(repo, "latest")["id"].startswith("05")
    with pytest.raises(SnapshotNotFound, match="coherent"):
        resolve_snapshot(_Repo([_m(1, "a")]), "latest-checkpoint")


def test_bare_latest_is_the_newest_whole_box_snapshot_never_a_later_partial_one(monkeypatch):
    from ogrefs.snapshot.selection import Filters, select_snapshot

    monkeypatch.setenv("OGREFS_BOX", "a")
    ms = [_m(1, "a"), _m(2, "a"), _m(3, "a"), _m(4, "a"), _m(5, "a")]
    ms[2]["paths"], ms[3]["paths"], ms[4]["paths"] = ["/srv/proj"], ["/data", "/srv"], ["/other"]
    repo = _Repo(ms[:4])
    m, passed = select_snapshot(repo, "a:latest")
    assert m["id"].startswith("02") and [p["id"][:2] for p in passed] == ["03", "04"]
    assert resolve_snapshot(repo, "latest", filters=Filters.of(["/srv/proj"]))["id"].startswith("03")
    # without a whole-box snapshot, unrelated path sets compete as restic's latest does
    repo = _Repo(ms[2:])
    assert resolve_snapshot(repo, "latest")["id"].startswith("05")
    assert select_snapshot(_Repo(ms[2:4]), "latest")[0]["id"].startswith("04")  # /srv covers /srv/proj


def test_latest_checkpoint_follows_a_restarted_run(monkeypatch):
    monkeypatch.setenv("OGREFS_BOX", "a")
    # 02 holds step 400; the run restarted in the same directory and 03 holds its step 200, written later:
    # that is what the framework resumes from.  04 holds step 100 written before 02's: a deleted newer one.
    old, restart, stale = _m(2, "a", 400), _m(3, "a", 200), _m(4, "a", 100)
    for m, t in ((old, 1000.0), (restart, 2000.0)):
        m["environment"]["checkpoints"]["latest_coherent"]["mtime"] = t
    assert resolve_snapshot(_Repo([_m(1, "a", 100), old, restart]), "latest-checkpoint")["id"].startswith("03")
    stale["environment"]["checkpoints"]["latest_coherent"]["mtime"] = 500.0
    assert resolve_snapshot(_Repo([old, stale]), "latest-checkpoint")["id"].startswith("02")
