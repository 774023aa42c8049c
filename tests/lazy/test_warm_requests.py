"""Requests the kernel sends again for data it already caches cost the daemon no query and no file.

A program started a second time (the next training step) finds every page
in the kernel's page cache, yet each of its ~1,700 ``open()`` calls is an
OPEN and a RELEASE for the daemon and each listing an OPENDIR, READDIRPLUS
and RELEASEDIR (pyfuse3 hands reads over by file handle only, so the
kernel's no-open mode is out of reach).  Each asked SQLite for the same
answers and opened the local copy it never read: ~0.25 ms per open of the
daemon's CPU beside the step (issue 17: the warm step through the mount at
1.20-1.24x local disk).  These tests count what a warm request asks of the
catalog and the local copy, and what it opens: nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ogrefs.lazy.fetch.fetcher import Fetcher
from ogrefs.lazy.background.materialize.materializer import Materializer
from ogrefs.lazy.fs.vfs import SnapshotFS

from tests.resume_box import Box, make_box, run_trio


@pytest.fixture(scope="module")
def box(tmp_path_factory) -> Box:
    return make_box(tmp_path_factory.mktemp("box"))


class Counting:
    """Delegates to ``inner`` and counts every method called on it (by name)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def counted(*args, **kw):
            self.calls.append(name)
            return attr(*args, **kw)
        return counted


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def small_file(box: Box) -> tuple[int, int]:
    """(inode, parent inode) of a small non-empty regular file of the box."""
    for path, node in box.catalog.walk():
        if node.is_reg and 0 < node.size <= 64 * 1024 and path.startswith(os.fsencode(box.src)):
            parent = box.catalog.resolve(os.path.dirname(path))
            assert parent is not None
            return node.ino, parent.ino
    raise AssertionError("the box has no small file")


def materialized(box: Box, state: Path) -> Materializer:
    fetcher = Fetcher(box.repo.read_pack_range)
    m = Materializer(box.catalog, fetcher, state)

    async def body():
        await m.run(None)

    run_trio(fetcher, body)
    assert m.complete
    return m


async def list_dir(fs: SnapshotFS, ino: int) -> list[bytes]:
    names: list[bytes] = []
    dh = await fs.opendir(ino)
    await fs.readdir(dh, 0, lambda name, attr, nxt: names.append(name) or True)
    fs.releasedir(dh)
    return names


def test_a_warm_open_and_listing_ask_the_catalog_and_the_local_copy_nothing(box, tmp_path):
    m = materialized(box, tmp_path / "state")
    catalog, local = Counting(box.catalog), Counting(m)
    fetcher = Fetcher(box.repo.read_pack_range)
    # a store into the page cache that keeps nothing: the pusher is there, as in a mount
    fs = SnapshotFS(catalog, fetcher, local=local, page_cache=lambda ino, data: None)
    ino, parent = small_file(box)
    want = Path(os.fsdecode(box.catalog.path_of(ino))).read_bytes()
    seen: dict[str, object] = {}

    async def body():
        first = await list_dir(fs, parent)
        fh = await fs.open(ino, os.O_RDONLY)
        assert await fs.read(fh, 0, 1 << 20) == want  # the first use reads (from the local copy)
        fs.release(fh)
        catalog.calls.clear()
        local.calls.clear()
        # the second use: the kernel has the pages, so it only opens and lists
        fds = open_fds()
        fh = await fs.open(ino, os.O_RDONLY)
        seen["fds_while_open"] = open_fds() - fds
        fs.release(fh)
        seen["second_listing"] = await list_dir(fs, parent)
        seen["first_listing"] = first
        seen["catalog"], seen["local"] = list(catalog.calls), list(local.calls)
        # and a read that does come is still served, from the local copy, right
        fh = await fs.open(ino, os.O_RDONLY)
        seen["read_later"] = await fs.read(fh, 0, 1 << 20)
        fs.release(fh)

    run_trio(fetcher, body)
    assert seen["catalog"] == [] and seen["local"] == [], (seen["catalog"], seen["local"])
    assert seen["fds_while_open"] == 0  # the local copy is opened at the first read, not at open
    assert seen["second_listing"] == seen["first_listing"] and seen["first_listing"]
    assert seen["read_later"] == want
    assert fetcher.stats.requests == 0 and fs.stats.local_opens == fs.stats.opens == 3
    assert fs.open_files == 0


@pytest.mark.expect_log(r"local copy ", logger="ogrefs.lazy")
def test_a_local_copy_damaged_after_open_is_read_from_the_store(box, tmp_path):
    """Opened at the first read, the copy is still checked then: the wrong size sends the read to the store."""
    state = tmp_path / "state"
    m = materialized(box, state)
    ino, _ = small_file(box)
    want = Path(os.fsdecode(box.catalog.path_of(ino))).read_bytes()
    local_copy = state / "tree" / os.fsdecode(box.catalog.path_of(ino)).lstrip("/")
    fetcher = Fetcher(box.repo.read_pack_range)
    fs = SnapshotFS(box.catalog, fetcher, local=m)
    got: list[bytes] = []

    async def body():
        fh = await fs.open(ino, os.O_RDONLY)
        os.truncate(local_copy, 1)  # between the open and the first read
        got.append(await fs.read(fh, 0, 1 << 20))
        fs.release(fh)

    run_trio(fetcher, body)
    assert got == [want]
    assert fetcher.stats.requests > 0 and fs.stats.local_opens == 0 and fs.stats.opens == 1


def test_a_warm_open_of_a_lazy_file_asks_the_catalog_nothing_and_its_first_read_gets_the_extents(box):
    """Without a local copy: the extents are looked up at a handle's first read, not at open (the next step's
    ~1,700 opens of pages the kernel caches asked SQLite for them: the warm step at 1.40x local disk, 1.27x
    without; docs/benchmarks.md)."""
    catalog = Counting(box.catalog)
    fetcher = Fetcher(box.repo.read_pack_range)
    fs = SnapshotFS(catalog, fetcher)
    ino, _ = small_file(box)
    want = Path(os.fsdecode(box.catalog.path_of(ino))).read_bytes()
    seen: dict[str, object] = {}

    async def body():
        fh = await fs.open(ino, os.O_RDONLY)  # the first use
        assert await fs.read(fh, 0, 1 << 20) == want
        fs.release(fh)
        catalog.calls.clear()
        fh = await fs.open(ino, os.O_RDONLY)  # the second: only an open and a release
        fs.release(fh)
        seen["warm_open"] = list(catalog.calls)
        fh = await fs.open(ino, os.O_RDONLY)  # a read that does come gets the extents and the right bytes
        seen["read"] = await fs.read(fh, 0, 1 << 20)
        fs.release(fh)
        seen["read_calls"] = list(catalog.calls)

    run_trio(fetcher, body)
    assert seen["warm_open"] == [], seen["warm_open"]
    assert seen["read"] == want and "extents" in seen["read_calls"], seen["read_calls"]
    assert fs.stats.opens == 3 and fs.open_files == 0
