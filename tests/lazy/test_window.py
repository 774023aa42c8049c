"""The windowed request engine (lazy/trace/window.py) that the trace replay and the materializer's feeder share."""

from __future__ import annotations

import trio

from ogrefs.lazy.trace.window import RequestWindow, groups


def test_groups_are_runs_of_neighbours_within_the_size_and_of_one_kind():
    items = [("a", 4), ("a", 4), ("a", 4), ("b", 1), ("b", 20), ("a", 1)]
    out = list(groups(items, 10, size=lambda i: i[1], key=lambda i: i[0]))
    # 4+4 fits, a third 4 does not; a new kind starts a group; an item larger than a group goes alone
    assert out == [[("a", 4), ("a", 4)], [("a", 4)], [("b", 1)], [("b", 20)], [("a", 1)]]
    assert list(groups([], 10, size=len)) == []
    assert list(groups([b"xx", b"yy", b"zz"], 4, size=len)) == [[b"xx", b"yy"], [b"zz"]]


def test_the_window_waits_while_full_widens_by_what_came_from_memory_and_always_admits_one_request():
    w = RequestWindow(10)
    assert w.fits(50)  # an empty window takes any request: a group larger than the window still goes
    w.take(8)
    assert w.fits(2) and not w.fits(3)
    w.settle(charged=4, ready=4, acquired=8)  # half of it was in memory: it costs the link nothing
    assert w.used == 4 and w.ready == 4 and w.fits(10) and not w.fits(11)
    order: list[str] = []

    async def main() -> None:
        with trio.fail_after(10):
            await both()

    async def both() -> None:
        async with trio.open_nursery() as n:
            async def requester() -> None:
                await w.acquire(10)
                order.append("acquired")

            n.start_soon(requester)
            await trio.sleep(0.01)
            order.append("finishing")
            w.finished(4, 0)  # the consumer is done with some from the link: still full for 10 more ...
            await trio.sleep(0.01)
            order.append("finishing the rest")
            w.finished(6, 4)  # ... and with the rest: empty again

    w.take(6)  # fill it first, so that the requester must wait
    trio.run(main)
    assert order == ["finishing", "finishing the rest", "acquired"] and w.used == 10 and w.ready == 0
    w.release(10)
    assert w.used == 0
