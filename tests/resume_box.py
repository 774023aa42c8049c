"""A small training box for the prefetch, trace and materialization tests.

``make_box`` builds the fidelity tree plus a "venv" (many small files, a
python hint), a "checkpoint" (a checkpoint hint) and data shards (no hint),
and snapshots it into a file repository (readable by a subprocess too) with
hints recorded in the catalog.  ``CallLog`` is a ``read_range`` that records
every store request and can hold the first one back.
"""

from __future__ import annotations

import os
import sys
import textwrap
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import trio

from ogrefs.repo.catalog import Catalog
from ogrefs.lazy.fetch.fetcher import Fetcher
from ogrefs.repo.chunkref import ChunkRef
from ogrefs.repo import Repository
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot

from tests.treegen import make_fidelity_tree

MiB = 1024 * 1024


class HintObserver:
    """Stands in for the environment probe: reports fixed hints."""

    def __init__(self, hints: dict[str, list[str]]) -> None:
        self.hints = hints

    def observe_dir(self, path, names) -> None:
        pass

    def finish(self) -> dict:
        return {"hints": self.hints}


def make_tree(src: Path, seed: int = 0) -> None:
    make_fidelity_tree(src)
    site = src / "venv" / "lib" / "site-packages"
    for p in range(6):
        pkg = site / f"pkg{p}"
        pkg.mkdir(parents=True)
        for m in range(8):
            (pkg / f"mod{m}.py").write_bytes(os.urandom(3000 + 500 * m))
    (site / "torch_like.so").write_bytes(os.urandom(3 * MiB))
    ckpt = src / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.bin").write_bytes(os.urandom(4 * MiB + 5))
    data = src / "data"
    data.mkdir()
    for i in range(4):  # shard0 is larger than the largest chunk: at least two chunks
        (data / f"shard{i}.bin").write_bytes(os.urandom((5 if i == 0 else 3) * MiB + i))


@dataclass
class Box:
    src: Path
    repo_url: str
    cache_root: Path
    repo: Repository
    manifest: dict
    catalog: Catalog

    @property
    def snap_id(self) -> str:
        return self.manifest["id"]

    def tree_of(self, state: Path) -> Path:
        """Where the source tree lies inside a materialized tree."""
        return state / "tree" / str(self.src).lstrip("/")

    def path(self, rel: str) -> bytes:
        return os.fsencode(self.src / rel)

    def refs_of(self, rel: str) -> list[ChunkRef]:
        node = self.catalog.resolve(self.path(rel))
        assert node is not None, rel
        return [ChunkRef.from_extent(e) for e in self.catalog.extents(node.ino)]


def snapshot_box(src: Path, repo: Repository, repo_url: str, cache_root: Path, *, hints: bool = True) -> Box:
    observers = []
    if hints:
        observers = [HintObserver({"python": [str(src / "venv" / "lib" / "site-packages")],
                                   "checkpoint": [str(src / "ckpt" / "model.bin")]})]
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], observers=observers))
    return Box(src, repo_url, cache_root, repo, m, Catalog(repo.catalog_path(m["id"])))


def make_box(base: Path, **kw) -> Box:
    src = base / "src"
    make_tree(src)
    url = f"file://{base}/repo"
    cache_root = base / "cache"
    repo = Repository.init(url, cache_root=cache_root, pack_target_size=2 * MiB)
    return snapshot_box(src, repo, url, cache_root, **kw)


class CallLog:
    """A ``read_range`` that records (pack, offset, length) of every call; thread-safe.

    ``hold_first``: the first call waits until :meth:`release` (a reader holding the only slot);
    ``fail``: a function (pack, offset, length) -> exception or None.
    """

    def __init__(self, read_range: Callable[[str, int, int], bytes], *, hold_first: bool = False,
                 fail: Callable[[str, int, int], BaseException | None] | None = None,
                 on_call: Callable[[int], None] | None = None) -> None:
        self.inner = read_range
        self.calls: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()
        self.gate = threading.Event()
        if not hold_first:
            self.gate.set()
        self.fail = fail
        self.on_call = on_call

    def release(self) -> None:
        self.gate.set()

    def __call__(self, pack: str, offset: int, length: int) -> bytes:
        with self.lock:
            first = not self.calls
            self.calls.append((pack, offset, length))
            n = len(self.calls)
        if first:
            self.gate.wait(30)
        if self.on_call is not None:
            self.on_call(n)
        if self.fail is not None:
            exc = self.fail(pack, offset, length)
            if exc is not None:
                raise exc
        return self.inner(pack, offset, length)

    def chunks_fetched(self, refs: list[ChunkRef]) -> list[ChunkRef]:
        """Which of ``refs`` lie inside some call's range."""
        with self.lock:
            calls = list(self.calls)
        return [r for r in refs if any(p == r.pack and o <= r.offset and r.offset + r.stored_len <= o + n
                                       for p, o, n in calls)]


def run_trio(fetcher: Fetcher, body) -> None:
    """Run ``body()`` with ``fetcher`` serving, then stop."""

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run)
            await body()
            nursery.cancel_scope.cancel()

    trio.run(main)


def build_child(prelude: str) -> tuple[str, ...]:
    """The argv of a tree-build child (buildchild.main) that runs ``prelude`` first: a real process a test
    slows down, spies on or breaks (the Materializer's ``build_command``)."""
    return (sys.executable, "-c", textwrap.dedent(prelude) + "\nfrom ogrefs.lazy.background.materialize.buildchild import main\n"
            "raise SystemExit(main())")


def spinning_build_child(cpu_s: float) -> tuple[str, ...]:
    """A build child that first spins ``cpu_s`` seconds of its own CPU (a stopped or starved child does not
    advance)."""
    return build_child(f"import time\nt = time.thread_time()\nwhile time.thread_time() - t < {cpu_s}:\n    pass")
