"""``copy`` when the destination already holds something under the snapshot's id (issue 46).

A bucket writer plants an object there, or the destination's copy lost its
catalog or a pack: copy checks what is there before it skips, copies again
over anything the destination cannot restore, and says so.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ogrefs.maint.copy import copy_snapshots
from ogrefs.repo import Repository
from ogrefs.repo.catalog import Catalog
from ogrefs.restore import Restorer
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot

pytestmark = pytest.mark.timeout(120)


def _tree(src: Path) -> dict[str, bytes]:
    src.mkdir()
    files = {f"f{i}": os.urandom(300_000 + i) for i in range(4)}
    for name, data in files.items():
        (src / name).write_bytes(data)
    return files


def _restores(repo: Repository, snap_id: str, src: Path, files: dict[str, bytes], out: Path) -> None:
    r = Restorer(Catalog(repo.catalog_path(snap_id)), repo.read_pack_range, os.fsencode(out))
    r.run()
    assert r.problems == 0
    assert {p.name: p.read_bytes() for p in (out / str(src).lstrip("/")).iterdir()} == files


def _planted_manifest(dst: Repository, m: dict) -> None:
    dst.put_manifest(m)  # a well-formed manifest under the id, nothing behind it


def _other_manifest(dst: Repository, m: dict) -> None:
    dst.put_manifest({**m, "paths": ["/somewhere/else"]})  # well-formed, not the source's
    assert dst.load_manifest(m["id"])["paths"] == ["/somewhere/else"]  # (and cached on this box)


def _junk(dst: Repository, m: dict) -> None:
    dst.store.put(f"snapshots/{m['id']}", b"not a manifest")


def _lost_catalog(dst: Repository, m: dict) -> None:
    copy_snapshots(SRC[0], dst, [m])
    dst.store.delete(f"catalogs/{m['id']}")


def _lost_pack(dst: Repository, m: dict) -> None:
    copy_snapshots(SRC[0], dst, [m])
    dst.store.delete(next(iter(dst.store.list("packs/"))))


SRC: list[Repository] = []  # the source of the case at hand (the damage functions copy from it first)


@pytest.mark.parametrize("damage", [_planted_manifest, _other_manifest, _junk, _lost_catalog, _lost_pack],
                         ids=["planted manifest", "other manifest", "junk", "lost catalog", "lost pack"])
def test_copy_repairs_what_the_destination_cannot_restore(tmp_path, damage):
    """Before the fix: skipped as "already in the destination", and the destination could not restore it."""
    src_dir = tmp_path / "src"
    files = _tree(src_dir)
    src = Repository.init(f"file://{tmp_path}/source", cache_root=tmp_path / "cache")
    m = take_snapshot(src, SnapshotOptions(paths=[os.fsencode(src_dir)], no_parent=True))
    dst = Repository.init(f"file://{tmp_path}/dest", cache_root=tmp_path / "cache")
    SRC[:] = [src]
    damage(dst, m)
    report = copy_snapshots(src, dst, [m])
    assert report.copied == [m["id"]] and list(report.repaired) == [m["id"]] and report.skipped == []
    dst = Repository.open(f"file://{tmp_path}/dest", cache_root=tmp_path / "cache")
    assert dst.load_manifest(m["id"]) == m
    _restores(dst, m["id"], src_dir, files, tmp_path / "out")
    again = copy_snapshots(src, dst, [m])
    assert (again.skipped, again.copied, again.repaired) == ([m["id"]], [], {})
