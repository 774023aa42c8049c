"""Listing snapshots on a box that has cached none of their manifests (a fresh box at boot or at a notice)."""

from __future__ import annotations

import os
import threading

import pytest

from ogrefs.errors import CorruptObject
from ogrefs.repo import Repository
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot
from ogrefs.store import open_store
from ogrefs.store.base import NotFound, StoreError

from tests.storegets import GetsUnder


def ManifestGets(inner, before=lambda key: None) -> GetsUnder:
    return GetsUnder(inner, "snapshots/", before)


@pytest.fixture
def six(tmp_path) -> tuple[str, list[str]]:
    """A file repository with six snapshots of one directory; their ids, oldest first."""
    url = str(tmp_path / "repo")
    repo = Repository.init(url, cache_root=tmp_path / "cache-0")
    src = tmp_path / "src"
    src.mkdir()
    ids = []
    for n in range(6):
        (src / "f").write_text(f"version {n}")
        ids.append(take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)]))["id"])
    return url, ids


def test_a_fresh_box_fetches_the_manifests_several_at_a_time(tmp_path, six):
    """One round trip each, one after the other, is seconds at a notice for a bucket of hundreds: every
    manifest GET here waits until another is in flight beside it, which a one-at-a-time listing never sees."""
    url, ids = six
    two = threading.Event()

    def wait_for_company(key: str) -> None:
        if store.in_flight >= 2:
            two.set()
        if not two.wait(10):
            raise StoreError(f"{key}: fetched alone for 10 s: the manifests are fetched one at a time")

    store = ManifestGets(open_store(url), wait_for_company)
    fresh = Repository.open(url, cache_root=tmp_path / "cache-1", store=store)
    assert [m["id"] for m in fresh.list_snapshots()] == ids
    assert store.gets == 6 and store.most_in_flight >= 2
    again = ManifestGets(open_store(url))  # now cached: nothing is fetched again
    assert [m["id"] for m in Repository.open(url, cache_root=tmp_path / "cache-1", store=again).list_snapshots()] == ids
    assert again.gets == 0


def test_a_damaged_or_vanished_manifest_among_fetched_ones(tmp_path, six):
    url, ids = six
    damaged, vanished = ids[2], ids[4]

    def faults(key: str) -> None:
        if key == f"snapshots/{vanished}":
            raise NotFound(key)  # forgotten between the listing and the read

    store = ManifestGets(open_store(url), faults)
    store.put(f"snapshots/{damaged}", b"not an envelope")
    reported: list[str] = []
    fresh = Repository.open(url, cache_root=tmp_path / "cache-2", store=store)
    listed = fresh.list_snapshots(on_error=lambda i, exc: reported.append(i))
    assert [m["id"] for m in listed] == [i for i in ids if i not in (damaged, vanished)]
    assert reported == [damaged]
    with pytest.raises(CorruptObject):  # retention decides on no partial list (strict: the damage alone)
        Repository.open(url, cache_root=tmp_path / "cache-3", store=ManifestGets(open_store(url))).list_snapshots(
            strict=True)
