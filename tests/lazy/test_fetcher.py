"""The fetch path without a mount: single flight, coalescing, priorities, retries, the disk cache (tier 1-2)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import logging

import pytest
import trio

from ogrefs.repo import codec
from ogrefs.lazy.fetch.chunkcache import ChunkCache
from ogrefs.lazy.fetch.fetcher import ChunkCorrupt, ChunkMissing, FetchError, Fetcher, Keep, Priority, StoreUnavailable
from ogrefs.repo.chunkref import ChunkRef
from ogrefs.lazy.fetch.blobio import PackReads
from ogrefs.repo.pack import pack_key
from ogrefs.store import FaultyStore, MemoryStore, RetryingStore
from ogrefs.store.base import NotFound, RangeReader, ShortRead, TransientError

KiB = 1024


class FakePacks:
    """Packs in memory behind a ``read_range`` that records every call; thread-safe."""

    def __init__(self) -> None:
        self.packs: dict[str, bytearray] = {}
        self.calls: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()
        self.delay = 0.0
        self.gate: threading.Event | None = None  # when set, requests block until it is set
        self.fail_next: list[BaseException] = []

    def add(self, pack: str, chunks: list[bytes], compress: bool = True) -> list[ChunkRef]:
        body = self.packs.setdefault(pack, bytearray())
        refs = []
        for data in chunks:
            blob = codec.encode_blob(data, 3 if compress else 0)
            refs.append(ChunkRef(codec.chunk_id(data), pack, len(body), len(blob), len(data)))
            body += blob
        return refs

    def read_range(self, pack: str, offset: int, length: int) -> bytes:
        with self.lock:
            self.calls.append((pack, offset, length))
            failure = self.fail_next.pop(0) if self.fail_next else None
        if self.gate is not None:
            self.gate.wait(10)
        if self.delay:
            time.sleep(self.delay)
        if failure is not None:
            raise failure
        if pack not in self.packs:
            raise NotFound(pack)
        return bytes(self.packs[pack][offset:offset + length])


class StreamingPacks(FakePacks):
    """FakePacks with an ``open_range`` that hands out a range in pieces.

    ``hold_after``: the stream delivers that many bytes, then blocks until
    ``release`` is set.
    """

    def __init__(self) -> None:
        super().__init__()
        self.hold_after: int | None = None
        self.release = threading.Event()

    def open_range(self, pack: str, offset: int, length: int) -> RangeReader:
        data = self.read_range(pack, offset, length)
        packs = self

        class Reader(RangeReader):
            pos = 0

            def read(self, n: int) -> bytes:
                if packs.hold_after is not None and self.pos >= packs.hold_after:
                    packs.release.wait(10)
                n = min(n, 16 * KiB)
                out = data[self.pos:self.pos + n]
                self.pos += len(out)
                return out

        return Reader()


class SlowApp(FakePacks):
    """Requests for pack "app" (an application's read) take ``app_delay`` s, others ``other_delay`` s.

    The call is recorded when it starts, so a test sees what started while the reader waited.
    """

    def __init__(self, app_delay: float, other_delay: float) -> None:
        super().__init__()
        self.app_delay, self.other_delay = app_delay, other_delay

    def read_range(self, pack, offset, length):
        data = super().read_range(pack, offset, length)
        time.sleep(self.app_delay if pack == "app" else self.other_delay)
        return data


def run_with_fetcher(fetcher: Fetcher, body) -> None:
    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run)
            await body(nursery)
            nursery.cancel_scope.cancel()

    trio.run(main)


def payloads(n: int, size: int = 64 * KiB) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


def test_single_flight_many_readers_one_request():
    fake = FakePacks()
    data = payloads(1)
    (ref,) = fake.add("p1", data)
    fake.delay = 0.2
    f = Fetcher(fake.read_range)
    results = []

    async def body(nursery):
        async def reader():
            results.append(await f.get(ref))
        async with trio.open_nursery() as n:
            for _ in range(25):
                n.start_soon(reader)

    run_with_fetcher(f, body)
    assert results == [data[0]] * 25
    assert len(fake.calls) == 1
    assert f.stats.chunks_fetched == 1 and f.stats.hits_memory == 0


@pytest.mark.parametrize("max_gap,bridge", [(0, True), (64 * KiB + 100, False), (64 * KiB + 100, True)])
def test_neighbouring_chunks_share_one_ranged_get(max_gap, bridge):
    fake = FakePacks()
    data = payloads(6)
    refs = fake.add("p1", data)
    other = fake.add("p2", payloads(1))
    f = Fetcher(fake.read_range, max_gap=max_gap)

    async def body(nursery):
        # chunks 0-2 and 4-5 of p1 are adjacent runs; chunk 3 is not wanted; p2 is another pack
        f.request([refs[0], refs[1], refs[2], refs[4], refs[5], other[0]], Priority.TRACE, bridge=bridge)
        got = [await f.get(r) for r in (refs[0], refs[1], refs[2], refs[4], refs[5])]
        assert got == [data[i] for i in (0, 1, 2, 4, 5)]
        await f.get(other[0])
        assert not f.residency.is_cached(refs[3].chunk)  # read across, not kept

    run_with_fetcher(f, body)
    spans = sorted(fake.calls)
    if max_gap and bridge:  # the unwanted chunk 3 (64 KiB + a little) is bridged: one GET for p1
        p1 = [("p1", refs[0].offset, refs[5].offset + refs[5].stored_len - refs[0].offset)]
    else:
        p1 = [("p1", refs[0].offset, refs[2].offset + refs[2].stored_len - refs[0].offset),
              ("p1", refs[4].offset, refs[5].offset + refs[5].stored_len - refs[4].offset)]
    assert spans == sorted(p1 + [("p2", 0, other[0].stored_len)])
    assert f.stats.bytes_fetched == sum(c[2] for c in fake.calls)


def test_a_gap_wider_than_max_gap_is_not_bridged():
    fake = FakePacks()
    refs = fake.add("p1", payloads(3, 100 * KiB), compress=False)
    f = Fetcher(fake.read_range, max_gap=100 * KiB)

    async def body(nursery):
        f.request([refs[0], refs[2]], Priority.TRACE, bridge=True)
        await f.get(refs[0])
        await f.get(refs[2])

    run_with_fetcher(f, body)
    assert len(fake.calls) == 2


def test_max_range_splits_long_runs():
    fake = FakePacks()
    refs = fake.add("p1", payloads(8, 100 * KiB), compress=False)
    f = Fetcher(fake.read_range, max_range=350 * KiB)

    async def body(nursery):
        f.prefetch(refs, Priority.BACKGROUND)
        for r in refs:
            await f.get(r)

    run_with_fetcher(f, body)
    assert all(length <= 350 * KiB for _, _, length in fake.calls)
    assert len(fake.calls) == 3  # 8 chunks of ~100 KiB, at most 3 per request


def test_read_is_never_queued_behind_background():
    fake = FakePacks()
    # non-adjacent background chunks: every one needs its own request
    bg = [fake.add(f"bg{i}", payloads(1))[0] for i in range(10)]
    (urgent,) = fake.add("urgent", payloads(1))
    fake.gate = threading.Event()
    f = Fetcher(fake.read_range, max_requests=3, reserved_for_read=1)

    async def body(nursery):
        f.prefetch(bg, Priority.BACKGROUND)
        await trio.sleep(0.2)
        with fake.lock:
            assert len(fake.calls) == 2  # background may use 3 - 1 slots
        nursery.start_soon(f.get, urgent)
        await trio.sleep(0.2)
        with fake.lock:
            assert fake.calls[-1][0] == "urgent"  # started although 8 background chunks wait
        fake.gate.set()
        await f.get(urgent)
        for r in bg:
            await f.get(r)

    run_with_fetcher(f, body)
    assert len(fake.calls) == 11


def test_priority_raise_moves_a_queued_chunk_ahead():
    fake = FakePacks()
    bg = [fake.add(f"bg{i}", payloads(1))[0] for i in range(6)]
    fake.gate = threading.Event()
    f = Fetcher(fake.read_range, max_requests=2, reserved_for_read=1)

    async def body(nursery):
        f.prefetch(bg[:5], Priority.BACKGROUND)
        await trio.sleep(0.2)  # one of them holds the only background slot
        f.prefetch(bg[5:], Priority.BACKGROUND)
        await trio.sleep(0.1)
        nursery.start_soon(f.get, bg[5], Priority.READ)  # queued last as background, now wanted by a reader
        await trio.sleep(0.2)
        with fake.lock:
            started = [c[0] for c in fake.calls]
        assert len(started) == 2 and started[1] == "bg5", started
        fake.gate.set()
        for r in bg:
            await f.get(r)

    run_with_fetcher(f, body)


def test_a_long_range_hands_out_its_first_chunks_before_the_rest_arrives():
    fake = StreamingPacks()
    data = payloads(8, 256 * KiB)
    refs = fake.add("p1", data, compress=False)
    fake.hold_after = refs[2].offset + refs[2].stored_len  # the first three blobs, then the stream stalls
    f = Fetcher(fake.read_range, open_range=fake.open_range)

    async def body(nursery):
        f.prefetch(refs, Priority.TRACE)
        with trio.fail_after(5):
            assert await f.get(refs[0]) == data[0]
            assert await f.get(refs[2]) == data[2]
        assert not f.residency.is_cached(refs[5].chunk)  # still on its way: the stream is held
        fake.release.set()
        with trio.fail_after(5):
            assert [await f.get(r) for r in refs] == data

    run_with_fetcher(f, body)
    assert len(fake.calls) == 1  # one GET for all eight


def _store_packs(fake: FakePacks, retry_for: float = 10.0) -> tuple[PackReads, FaultyStore, list[float]]:
    """``fake``'s packs in a memory store behind FaultyStore and RetryingStore (a clock that moves only when
    the store waits), read through PackReads with ``retry_for`` seconds of budget per call."""
    faulty = FaultyStore(MemoryStore("fetcher"))
    for name, body in fake.packs.items():
        faulty.inner.put(pack_key(name), bytes(body))
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    store = RetryingStore(faulty, base_delay=0.5, max_delay=4.0, sleep=sleep, clock=lambda: now[0])
    return PackReads(store, retry_for), faulty, now


def test_a_stream_that_breaks_is_resumed_by_the_store_from_the_first_missing_byte():
    fake = FakePacks()
    data = payloads(6, 128 * KiB)
    refs = fake.add("p1", data, compress=False)
    packs, faulty, _ = _store_packs(fake)
    faulty.break_next_range(after=refs[3].offset + 10)  # three blobs arrive, the fourth is cut
    f = Fetcher(packs.read_range, open_range=packs.open_range, retries=lambda: packs.retries)

    async def body(nursery):
        f.prefetch(refs, Priority.READ)
        with trio.fail_after(5):
            assert [await f.get(r) for r in refs] == data

    run_with_fetcher(f, body)
    assert faulty.injected["range_break"] == 1 and faulty.calls["get_range"] == 2  # one GET, resumed once
    stats = f.snapshot_stats()
    assert stats["retries"] == 1 and stats["requests"] == 1 and stats["chunks_fetched"] == 6 and stats["errors"] == 0


def test_held_chunks_stay_in_memory_whatever_the_lru_does_until_taken():
    """A replay held for the materializer survives readers that churn the LRU; taking it releases it."""
    fake = FakePacks()
    data = payloads(5)
    refs = fake.add("p1", data)
    f = Fetcher(fake.read_range, memory_bytes=1)  # an LRU that keeps nothing
    f.residency.hold(len(data[0]) + len(data[1]))  # room for two

    async def body(nursery):
        tickets = f.request(refs[:3], Priority.TRACE, keep=Keep.MEMORY, hold=True)
        assert [await t.result() for t in tickets] == data[:3]
        assert [await f.get(r) for r in refs[3:]] == data[3:]
        assert f.residency.is_cached(refs[0].chunk) and f.residency.is_cached(refs[1].chunk)
        assert not f.residency.is_cached(refs[2].chunk)  # no room left: the (empty) LRU had it
        assert f.snapshot_stats()["held_bytes"] == len(data[0]) + len(data[1])
        calls = len(fake.calls)
        assert await f.get(refs[0]) == data[0] and len(fake.calls) == calls  # readers find it, it stays
        assert f.residency.is_cached(refs[0].chunk)
        (t,) = f.request(refs[:1], Priority.TRACE, keep=Keep.NONE, take=True)
        assert t.ready and await t.result() == data[0] and len(fake.calls) == calls
        assert not f.residency.is_cached(refs[0].chunk)  # taken: released
        assert f.snapshot_stats()["held_bytes"] == len(data[1])
        f.residency.hold(0)
        assert not f.residency.is_cached(refs[1].chunk) and f.snapshot_stats()["held_bytes"] == 0

    run_with_fetcher(f, body)


def test_a_held_request_finding_its_chunk_in_the_lru_holds_it():
    fake = FakePacks()
    data = payloads(2)
    refs = fake.add("p1", data)
    f = Fetcher(fake.read_range)
    f.residency.hold(1 << 20)

    async def body(nursery):
        assert await f.get(refs[0]) == data[0]  # in the LRU
        (t,) = f.request(refs[:1], Priority.TRACE, keep=Keep.MEMORY, hold=True)
        assert t.ready
        f.residency.set_memory_limit(1)  # the LRU drops it ...
        assert f.residency.is_cached(refs[0].chunk)  # ... the hold keeps it
        assert f.snapshot_stats()["held_bytes"] == len(data[0])

    run_with_fetcher(f, body)


def test_keep_memory_stays_out_of_the_disk_cache(tmp_path):
    fake = FakePacks()
    data = payloads(3)
    refs = fake.add("p1", data)
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    f = Fetcher(fake.read_range, cache)

    async def body(nursery):
        tickets = f.request(refs[:2], Priority.TRACE, keep=Keep.MEMORY)
        assert [await t.result() for t in tickets] == data[:2]
        assert await f.get(refs[2]) == data[2]
        await trio.sleep(0.2)
        assert f.residency.is_cached(refs[0].chunk) and f.residency.is_cached(refs[2].chunk)
        f.residency.set_memory_limit(1)  # shrinking evicts
        assert not f.residency.is_cached(refs[0].chunk)

    run_with_fetcher(f, body)
    assert not cache.contains(refs[0].chunk) and not cache.contains(refs[1].chunk)
    assert cache.contains(refs[2].chunk)


def test_keep_local_goes_to_the_local_tree_or_memory_never_to_the_disk_cache(tmp_path):
    """A streamed large file (issue 49): adopted by the materializer as before, but no disk-cache write;
    a chunk another caller wants kept whole is cached all the same."""
    fake = FakePacks()
    data = payloads(4)
    refs = fake.add("p1", data)
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    f = Fetcher(fake.read_range, cache)

    async def body(nursery):
        assert await f.get(refs[0], Priority.READ, Keep.LOCAL) == data[0]
        assert f.prefetch(refs[1:3], Priority.READ, Keep.LOCAL) == 2
        f.prefetch(refs[2:3], Priority.READ)  # (Keep.ALL) the same flight, kept whole after all
        assert [await f.get(r, Priority.READ, Keep.LOCAL) for r in refs[1:3]] == data[1:3]
        f.residency.open_adoption(limit=1 << 20)
        assert await f.get(refs[3], Priority.READ, Keep.LOCAL) == data[3]
        assert await f.residency.next_adoptions(1 << 20, 10) == [(refs[3], data[3])]
        await trio.sleep(0.2)
        assert all(f.residency.is_cached(r.chunk) for r in refs)

    run_with_fetcher(f, body)
    assert [cache.contains(r.chunk) for r in refs] == [False, False, True, False]


@pytest.mark.expect_log(r"fails BLAKE3 verification", level=logging.ERROR, logger="ogrefs.lazy")
@pytest.mark.expect_log(r"failed verification.*fetching it again", logger="ogrefs.lazy")
def test_corrupt_blob_is_refetched_once_then_fails_and_is_not_cached(tmp_path):
    fake = FakePacks()
    data = payloads(2)
    refs = fake.add("p1", data, compress=False)
    fake.packs["p1"][refs[0].offset + 100] ^= 0xFF
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    f = Fetcher(fake.read_range, cache)

    async def body(nursery):
        f.prefetch(refs, Priority.READ)
        with pytest.raises(ChunkCorrupt, match="BLAKE3"):
            await f.get(refs[0])
        assert await f.get(refs[1]) == data[1]  # its neighbour in the same GET is fine
        with pytest.raises(ChunkCorrupt):
            await f.get(refs[0])  # failures are not remembered: tried again, fails again
        await trio.sleep(0.1)

    run_with_fetcher(f, body)
    assert f.stats.corrupt >= 3 and f.stats.errors == 2
    assert cache.load(refs[0].chunk, refs[0].raw_len) is None
    assert cache.load(refs[1].chunk, refs[1].raw_len) == data[1]


@pytest.mark.expect_log(r"is missing from the repository", level=logging.ERROR, logger="ogrefs.lazy")
def test_missing_pack_fails_at_once():
    fake = FakePacks()
    (ref,) = fake.add("p1", payloads(1))
    packs, faulty, now = _store_packs(fake, retry_for=30)
    faulty.inner.delete(pack_key("p1"))
    f = Fetcher(packs.read_range, open_range=packs.open_range)

    async def body(nursery):
        with trio.fail_after(2):
            with pytest.raises(ChunkMissing, match="missing"):
                await f.get(ref)

    run_with_fetcher(f, body)
    assert faulty.calls["get_range"] == 1 and now[0] == 0  # not retried


@pytest.mark.expect_log(r"store unreachable", level=logging.ERROR, logger="ogrefs.lazy")
def test_the_fetcher_itself_never_retries_and_remembers_no_failure():
    """Without a retrying store a transient failure is the reader's at once: one call, StoreUnavailable."""
    fake = FakePacks()
    (ref,) = fake.add("p1", payloads(1))
    fake.fail_next = [TransientError("connection refused")]
    f = Fetcher(fake.read_range)

    async def body(nursery):
        with pytest.raises(StoreUnavailable, match="unreachable"):
            await f.get(ref)
        assert len(fake.calls) == 1
        assert await f.get(ref) is not None  # the next read tries again

    run_with_fetcher(f, body)
    assert len(fake.calls) == 2 and f.stats.retries == 0


@pytest.mark.expect_log(r"store unreachable", level=logging.ERROR, logger="ogrefs.lazy")
def test_a_retry_budget_that_runs_out_gives_the_reader_store_unavailable_in_bounded_time():
    """The store retries within the mount's budget (a fake clock: no waiting), then the reader gets EIO."""
    fake = FakePacks()
    data = payloads(2)
    refs = [fake.add(f"p{i}", [d])[0] for i, d in enumerate(data)]
    packs, faulty, now = _store_packs(fake, retry_for=30)
    f = Fetcher(packs.read_range, open_range=packs.open_range, retries=lambda: packs.retries)

    async def body(nursery):
        faulty.fail_next(3)
        assert await f.get(refs[0]) == data[0]  # ridden out
        assert f.snapshot_stats()["retries"] == 3
        faulty.down = True
        now[0] = 0.0
        calls = faulty.calls["get_range"]
        with pytest.raises(StoreUnavailable, match="gave up after 30 s"):
            await f.get(refs[1])
        assert now[0] == pytest.approx(30.0)  # the budget, spent exactly: not a multiple of it
        assert 30 / 4 < faulty.calls["get_range"] - calls <= 30 / 0.25 + 1  # one call per wait, and one more

    run_with_fetcher(f, body)


@pytest.mark.expect_log(r"store unreachable .*gave up", level=logging.ERROR, logger="ogrefs.lazy", required=False)
def test_cancelling_the_fetcher_ends_a_retry_wait_at_once():
    """An unmount during an outage: the store's wait in a worker thread ends, the nursery does not hang."""
    import threading

    fake = FakePacks()
    (ref,) = fake.add("p1", payloads(1))
    faulty = FaultyStore(MemoryStore("fetcher-stop"))
    faulty.down = True
    stop = threading.Event()
    packs = PackReads(RetryingStore(faulty), retry_for=10_000, stop=stop)  # real waits, a huge budget
    f = Fetcher(packs.read_range, open_range=packs.open_range, stop=stop)

    async def main():
        with trio.fail_after(20):  # a hang fails the test
            async with trio.open_nursery() as nursery:
                await nursery.start(f.run)
                f.prefetch([ref], Priority.READ)
                while faulty.calls["get_range"] == 0:
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()

    trio.run(main)
    assert stop.is_set() and faulty.calls["get_range"] <= 2


class _Surprise(Exception):
    """Not a store error, not a ValueError: something no one expected."""


@pytest.mark.expect_log(r"failed unexpectedly|unexpected _Surprise", level=logging.ERROR, logger="ogrefs.lazy")
def test_an_unexpected_exception_fails_that_read_only_and_is_logged(caplog):
    fake = FakePacks()
    data = payloads(3)
    bad = fake.add("bad", data[:1])[0]
    good = fake.add("good", data[1:])

    def read_range(pack, offset, length):
        if pack == "bad":
            raise _Surprise("the backend did something odd")
        return fake.read_range(pack, offset, length)

    f = Fetcher(read_range)

    async def body(nursery):
        with pytest.raises(FetchError, match="unexpected _Surprise"):
            await f.get(bad)
        assert [await f.get(r) for r in good] == data[1:]  # the dispatcher and the nursery live on
        with pytest.raises(FetchError):
            await f.get(bad)

    with caplog.at_level("ERROR"):
        run_with_fetcher(f, body)
    assert any(r.exc_info and r.exc_info[0] is _Surprise for r in caplog.records)
    assert f.stats.errors == 2


@pytest.mark.parametrize("field, value", [("offset", "x"), ("stored_len", -1), ("pack", 7), ("chunk", "c")])
def test_a_malformed_chunk_location_is_refused_where_it_is_made(field, value):
    fields = dict(chunk=b"c" * 32, pack="p1", offset=0, stored_len=10, raw_len=10)
    ChunkRef(**fields)
    with pytest.raises(ValueError, match="malformed"):
        ChunkRef(**{**fields, field: value})


@pytest.mark.expect_log(r"is damaged .*dropping it", logger="ogrefs.lazy.fetch.chunkcache")
def test_disk_cache_serves_a_new_fetcher_and_drops_damaged_files(tmp_path):
    fake = FakePacks()
    data = payloads(3)
    refs = fake.add("p1", data)
    root = tmp_path / "cache"

    async def fill(nursery):
        for r in refs:
            await f1.get(r)
        await trio.sleep(0.2)  # cache writes run in the background

    f1 = Fetcher(fake.read_range, ChunkCache(root, 1 << 30))
    run_with_fetcher(f1, fill)
    calls = len(fake.calls)
    assert not list((root / "tmp").iterdir())  # atomic writes leave no temporary files
    # damage one cached chunk: it must be detected, dropped, and fetched again
    path = ChunkCache(root, 1 << 30).path(refs[1].chunk)
    raw = bytearray(path.read_bytes())
    raw[5] ^= 1
    path.write_bytes(raw)

    f2 = Fetcher(fake.read_range, ChunkCache(root, 1 << 30))

    async def read_all(nursery):
        assert [await f2.get(r) for r in refs] == data

    run_with_fetcher(f2, read_all)
    assert f2.stats.hits_disk == 2 and f2.stats.chunks_fetched == 1
    assert fake.calls[calls:] == [("p1", refs[1].offset, refs[1].stored_len)]


def test_memory_lru_is_bounded():
    fake = FakePacks()
    refs = fake.add("p1", payloads(10, 100 * KiB), compress=False)
    f = Fetcher(fake.read_range, memory_bytes=350 * KiB)

    async def body(nursery):
        for r in refs:
            await f.get(r)
        assert f.snapshot_stats()["memory_bytes"] <= 350 * KiB
        assert f.residency.is_cached(refs[-1].chunk) and not f.residency.is_cached(refs[0].chunk)

    run_with_fetcher(f, body)


def test_chunk_cache_evicts_least_recently_used(tmp_path):
    cache = ChunkCache(tmp_path / "c", max_bytes=10 * KiB)
    chunks = payloads(8, KiB)
    ids = [codec.chunk_id(c) for c in chunks]
    for cid, c in zip(ids[:6], chunks[:6]):
        cache.store(cid, c)
    assert cache.load(ids[0], KiB) == chunks[0]  # recently used
    cache.flush()
    time.sleep(0.01)
    for cid, c in zip(ids[6:], chunks[6:]):
        cache.store(cid, c)
    cache.evict(target=5 * KiB)
    assert cache.usage() <= 5 * KiB
    assert cache.load(ids[0], KiB) == chunks[0]
    assert cache.load(ids[1], KiB) is None
    assert sum(1 for p in Path(cache.data_dir).rglob("*") if p.is_file()) == 5


def test_chunk_cache_is_shared_between_instances(tmp_path):
    a = ChunkCache(tmp_path / "c", 1 << 20)
    b = ChunkCache(tmp_path / "c", 1 << 20)
    data = os.urandom(3000)
    a.store(codec.chunk_id(data), data)
    assert b.load(codec.chunk_id(data), len(data)) == data
    assert b.usage() == 3000


def test_hints_and_background_yield_the_link_to_readers_but_traces_do_not():
    """While an application waits on the store, HINT/BACKGROUND start nothing new; TRACE does."""
    fake = SlowApp(app_delay=0.4, other_delay=0.02)
    background = [fake.add(f"bg{i}", payloads(1))[0] for i in range(40)]  # one pack each: no coalescing
    trace = [fake.add(f"tr{i}", payloads(1))[0] for i in range(10)]
    (wanted,) = fake.add("app", payloads(1))
    f = Fetcher(fake.read_range, max_requests=4, reserved_for_read=1)
    started_during_read: list[str] = []

    async def body(nursery):
        f.prefetch(background, Priority.BACKGROUND)
        await trio.sleep(0.05)  # background is flowing
        n0 = len(fake.calls)
        f.prefetch(trace, Priority.TRACE)
        await f.get(wanted, Priority.READ)
        started_during_read.extend(p for p, _, _ in fake.calls[n0:])
        await trio.sleep(1.5)  # the reader went quiet: background resumes and finishes

    run_with_fetcher(f, body)
    assert "app" in started_during_read
    after = started_during_read[started_during_read.index("app"):]
    assert sum(p.startswith("bg") for p in after) <= 0.4 / 0.02 + 2  # one at a time, not three
    assert sum(p.startswith("tr") for p in started_during_read) == 10  # the trace went on next to the reader
    assert len({p for p, _, _ in fake.calls if p.startswith("bg")}) == 40  # and it all arrived afterwards


@pytest.mark.parametrize("priority", [Priority.HINT, Priority.TRACE])
@pytest.mark.parametrize("read_size", [64 * KiB, 6 * 1024 * KiB], ids=["small-read", "big-read"])
def test_prefetch_pauses_while_a_reader_has_enough_on_its_way(read_size, priority):
    """Small reads leave one request to prefetch (the link would idle); a big read gets the whole link."""
    fake = SlowApp(app_delay=0.5, other_delay=0.02)
    hints = [fake.add(f"h{i}", payloads(1))[0] for i in range(40)]
    wanted = fake.add("app", payloads(read_size // (64 * KiB)))
    f = Fetcher(fake.read_range, max_requests=4, reserved_for_read=1)
    during: list[str] = []

    async def body(nursery):
        f.prefetch(wanted, Priority.READ)
        await trio.sleep(0.1)  # the reader's request is on its way
        n0 = len(fake.calls)
        f.prefetch(hints, priority)
        await trio.sleep(0.3)
        during.extend(p for p, _, _ in fake.calls[n0:])
        for r in wanted:
            await f.get(r)

    run_with_fetcher(f, body)
    if read_size > 4 * 1024 * KiB:
        assert during == []  # the reader fills the link: nothing else starts, not even the trace
    elif priority == Priority.HINT:
        assert 3 <= len(during) <= 0.3 / 0.02 + 2  # one at a time
    else:
        assert len(during) > 0.3 / 0.02 + 2  # the trace goes on next to a small reader, several at a time


def test_blob_reader_cuts_exact_blobs_from_pieces_of_any_size():
    import random

    from ogrefs.lazy.fetch.blobio import BlobReader

    data = os.urandom(3 * 1024 * KiB)
    rng = random.Random(5)

    class Body(RangeReader):
        pos = 0

        def read(self, n):
            n = min(n, rng.choice([1, 100, 4 * KiB, 300 * KiB, 2 * 1024 * KiB]))
            out = data[self.pos:self.pos + n]
            self.pos += len(out)
            return out

    reader = BlobReader(Body())
    sizes = [1, 7, 4 * KiB, 100, 1024 * KiB, 33, 300 * KiB]
    pos = 0
    for n in sizes:
        assert reader.read_exact(n) == data[pos:pos + n]
        pos += n
    rest = len(data) - pos
    assert reader.read_exact(rest) == data[pos:]
    with pytest.raises(ShortRead, match="ended 1 bytes early"):
        reader.read_exact(1)


@pytest.mark.parametrize("reader", [False, True])
def test_prefetch_requests_stay_short_while_an_application_reads(reader):
    """A trace request that starts next to a reader covers at most 4 MiB, so it gives the link back soon."""
    fake = SlowApp(app_delay=0.6, other_delay=0.01)
    trace = fake.add("tr", payloads(12, 1024 * KiB), compress=False)
    (wanted,) = fake.add("app", payloads(1))
    f = Fetcher(fake.read_range, max_requests=4, reserved_for_read=1)

    async def body(nursery):
        if reader:
            f.prefetch([wanted], Priority.READ)
            await trio.sleep(0.05)
        for t in f.request(trace, Priority.TRACE):
            await t.result()

    run_with_fetcher(f, body)
    spans = [n for p, _o, n in fake.calls if p == "tr"]
    assert sum(spans) >= 12 * 1024 * KiB
    if reader:
        assert max(spans) <= 4 * 1024 * KiB + 64 and len(spans) >= 3
    else:
        assert len(spans) == 1  # nobody reading: one 12 MiB GET
