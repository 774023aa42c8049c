"""The residency: one loop-owned answer to "where is chunk X" (memory, in hand, the local tree, absent)."""

from __future__ import annotations

import trio

from ogrefs.lazy.fetch.fetcher import Fetcher
from ogrefs.repo.chunkref import ChunkRef
from ogrefs.lazy.fetch.residency import ABSENT, COMING, IN_MEMORY, IN_TREE, Residency


def ref(n: int, size: int = 10) -> ChunkRef:
    return ChunkRef(bytes([n]) * 32, "p" * 64, n * 100, size, size)


def test_a_chunk_moves_from_absent_to_memory_to_the_tree_only_through_the_mutators():
    res = Residency(memory_bytes=25)
    a, b, c = ref(1), ref(2), ref(3)
    assert res.where(a.chunk) == ABSENT and res.in_memory(a.chunk) is None
    res.mem_put(a.chunk, b"a" * 10)
    res.mem_put(b.chunk, b"b" * 10)
    assert res.where(a.chunk) == IN_MEMORY and res.in_memory(a.chunk) == b"a" * 10  # (a is the newest now)
    res.mem_put(c.chunk, b"c" * 10)  # over the bound: the least recently used goes
    assert res.where(b.chunk) == ABSENT and res.where(a.chunk) == res.where(c.chunk) == IN_MEMORY
    res.recorded([b.chunk], [7])
    assert res.where(b.chunk) == IN_TREE and res.is_complete(7) and res.files_complete == 1
    res.hold(15)
    assert res.hold_put(b.chunk, b"b" * 10) and not res.hold_put(ref(4).chunk, b"d" * 10)  # room for one
    assert res.where(b.chunk) == IN_MEMORY  # memory first: no disk read for what the loop has
    assert res.take_held(b.chunk) == b"b" * 10 and res.held_size == 0
    assert res.where(b.chunk) == IN_TREE


def test_adoption_only_while_a_pass_is_open_within_its_bound_and_once_per_chunk():
    res = Residency()
    a, b, c = ref(1), ref(2), ref(3)
    assert not res.adopt(a, b"a" * 10)  # no pass: the chunk cache keeps it
    res.open_adoption(limit=15)
    assert res.adopt(a, b"a" * 10)
    assert res.where(a.chunk) == IN_MEMORY and res.in_hand(a.chunk) == b"a" * 10 and res.is_claimed(a.chunk)
    assert res.adopt(a, b"a" * 10)  # claimed already: the tree will have it, queued once
    assert not res.adopt(b, b"b" * 10)  # the bound is reached
    res.claim(c.chunk)  # the feeder asked for it: adoption does not queue it a second time
    assert res.adopt(c, b"c" * 10)

    async def drain():
        batch = await res.next_adoptions(1 << 20, 100)
        assert [r.chunk for r, _ in batch] == [a.chunk]
        res.adoptions_written(10)
        res.recorded([a.chunk], [])
        res.close_adoption()
        assert await res.next_adoptions(1 << 20, 100) is None  # closed and nothing left

    trio.run(drain)
    assert res.where(a.chunk) == IN_TREE and res.in_hand(a.chunk) is None
    res.open_adoption(limit=15)
    assert res.adopt(b, b"b" * 10)  # the bound counts what waits, not what was written


def test_the_fetcher_serves_and_skips_what_its_residency_has_without_asking_the_store():
    calls: list[tuple] = []

    def read_range(pack, off, n):
        calls.append((pack, off, n))
        raise AssertionError("the store was asked")

    res = Residency()
    fetcher = Fetcher(read_range, residency=res)
    a, b = ref(1), ref(2)
    res.open_adoption(limit=100)
    res.adopt(a, b"a" * 10)  # in the materializer's hand
    res.recorded([b.chunk], [])  # in the local tree

    async def main():
        async with trio.open_nursery() as n:
            await n.start(fetcher.run)
            assert await fetcher.get(a) == b"a" * 10
            assert fetcher.prefetch([a, b], 0) == 0  # nothing to fetch for a reader
            n.cancel_scope.cancel()

    trio.run(main)
    assert calls == [] and fetcher.stats.hits_memory == 1


def test_a_chunk_on_its_way_is_coming_for_every_asker_and_fetched_once():
    import threading

    gate = threading.Event()
    calls: list[tuple] = []
    a = ref(1)

    def read_range(pack, off, n):
        calls.append((pack, off, n))
        gate.wait(20)
        return b"a" * n

    res = Residency()
    fetcher = Fetcher(read_range, residency=res, decode=lambda view, raw_len, chunk: bytes(view))

    async def main():
        async with trio.open_nursery() as n:
            await n.start(fetcher.run)
            assert fetcher.prefetch([a], 3) == 1 and res.where(a.chunk) == COMING and res.flights == 1
            assert fetcher.prefetch([a], 0) == 0  # joins the flight (and raises its priority), no second one
            assert res.flight(a.chunk).priority == 0
            gate.set()
            with trio.fail_after(10):
                assert await fetcher.get(a) == b"a" * 10
            assert res.where(a.chunk) == IN_MEMORY and res.flights == 0
            n.cancel_scope.cancel()

    trio.run(main)
    assert len(calls) == 1
