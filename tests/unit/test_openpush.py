"""The open-time push on its own: the file's bytes from memory, and the push's bounds (lazy/fs/openpush.py)."""

from __future__ import annotations

import threading

import pytest
import trio

from ogrefs.lazy.fs.openpush import OPEN_PUSH_MAX, OpenPush, whole_in_memory
from ogrefs.repo.catalog import Extent


def ext(offset: int, length: int, chunk: bytes) -> Extent:
    return Extent(offset=offset, length=length, chunk=chunk, pack="p", pack_offset=0, stored_len=length)


def test_the_whole_file_from_memory_with_its_holes_as_zeros():
    mem = {b"a": b"A" * 10, b"b": b"B" * 5}
    extents = [ext(0, 10, b"a"), ext(14, 5, b"b")]  # a hole of 4 bytes, and 3 more at the end
    assert whole_in_memory(22, extents, mem.get) == b"A" * 10 + bytes(4) + b"B" * 5 + bytes(3)
    assert whole_in_memory(10, [ext(0, 10, b"a")], mem.get) == b"A" * 10
    assert whole_in_memory(7, [], mem.get) == bytes(7)  # all hole


def test_a_chunk_not_in_memory_or_of_the_wrong_length_gives_nothing():
    mem = {b"a": b"A" * 10, b"short": b"S" * 3}
    assert whole_in_memory(20, [ext(0, 10, b"a"), ext(10, 10, b"gone")], mem.get) is None
    assert whole_in_memory(13, [ext(0, 10, b"a"), ext(10, 3, b"short")], mem.get) is not None
    assert whole_in_memory(14, [ext(0, 10, b"a"), ext(10, 4, b"short")], mem.get) is None
    # extents that overlap or run past the file's size are not the catalog's: the reads come as usual
    assert whole_in_memory(20, [ext(0, 10, b"a"), ext(5, 10, b"a")], mem.get) is None
    assert whole_in_memory(8, [ext(0, 10, b"a")], mem.get) is None


def run_with(push: OpenPush, body) -> None:
    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(push.run)
            await trio.sleep(0.01)
            await body()
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_a_push_happens_once_while_the_kernel_holds_the_file():
    stored: list[tuple[int, bytes]] = []
    kernel_pages: set[int] = set()  # the vfs's
    push = OpenPush(lambda ino, data: stored.append((ino, data)), kernel_pages)
    seen: dict[str, object] = {}

    async def body():
        assert not push.wanted(7, 0) and not push.wanted(7, OPEN_PUSH_MAX + 1) and push.wanted(7, 100)
        seen["first"] = await push.push(7, b"x" * 100)
        seen["again"] = push.wanted(7, 100)  # the kernel has its pages
        kernel_pages.discard(7)  # the kernel forgot the inode
        seen["after_forget"] = push.wanted(7, 100)
        kernel_pages.add(8)  # read through the mount: the kernel has its pages too
        seen["served"] = push.wanted(8, 100)

    run_with(push, body)
    assert stored == [(7, b"x" * 100)] and seen == {"first": True, "again": False, "after_forget": True,
                                                    "served": False}
    assert push.stats() == {"files": 1, "bytes": 100, "late": 0, "failed": 0}


@pytest.mark.parametrize("inline", [False, True])
def test_a_push_the_kernel_refuses_costs_only_the_read_and_is_tried_again(inline):
    def refuse(ino: int, data: bytes) -> None:
        raise FileNotFoundError(2, "the kernel does not know the inode")

    push = OpenPush(refuse, set())
    seen: dict[str, object] = {}

    async def body():
        seen["pushed"] = await push.push(7, b"x", inline=inline)
        seen["again"] = push.wanted(7, 1)

    run_with(push, body)
    assert seen == {"pushed": False, "again": True} and push.stats()["failed"] == 1


def test_an_open_waits_for_its_push_at_most_wait_s_and_the_push_goes_on():
    """A store stuck on a page lock (a READ of another process waiting for the loop) never holds the open."""
    release = threading.Event()
    stored: list[int] = []

    def stuck(ino: int, data: bytes) -> None:
        assert release.wait(10)
        stored.append(ino)

    push = OpenPush(stuck, set(), wait_s=0.2)
    seen: dict[str, object] = {}

    async def body():
        t0 = trio.current_time()
        seen["pushed"] = await push.push(7, b"x")
        seen["waited"] = trio.current_time() - t0
        seen["stored_meanwhile"] = list(stored)
        release.set()
        with trio.fail_after(10):
            while not stored:
                await trio.sleep(0.01)

    run_with(push, body)
    assert seen["pushed"] is False and seen["stored_meanwhile"] == [] and 0.2 <= seen["waited"] < 5
    assert stored == [7] and push.stats() == {"files": 1, "bytes": 1, "late": 1, "failed": 0}


def test_without_its_task_running_nothing_is_pushed():
    push = OpenPush(lambda ino, data: None, set())
    assert not push.wanted(7, 100)
    assert trio.run(push.push, 7, b"x") is False


def test_an_inline_push_is_stored_on_the_loop_before_push_returns():
    """For a file no other handle has open (the vfs decides): no thread hop, no wait."""
    loop_thread = threading.get_ident()
    stored: list[bool] = []
    push = OpenPush(lambda ino, data: stored.append(threading.get_ident() == loop_thread), set())
    seen: dict[str, object] = {}

    async def body():
        seen["pushed"] = await push.push(7, b"x", inline=True)
        seen["stored"] = list(stored)

    run_with(push, body)
    assert seen == {"pushed": True, "stored": [True]} and push.stats()["files"] == 1
