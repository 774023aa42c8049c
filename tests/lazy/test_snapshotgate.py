"""A snapshot of the box goes first: the mount's background work waits while one runs (tier 1-2).

The fetcher starts no hint or background request while it yields, reads and
the trace go on; the gate follows a ``running`` check; the materializer's
pacer waits out a snapshot; a snapshot's mark counts only while its process lives.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import trio

from ogrefs.box.records import clear_snapshot_running, mark_snapshot_running, snapshot_running
from ogrefs.lazy.fetch.fetcher import Fetcher, Priority
from ogrefs.lazy.background.materialize.pacing import BuildGate, Pacer
from ogrefs.lazy.background.snapshotgate import SnapshotGate
from tests.lazy.test_fetcher import FakePacks, payloads, run_with_fetcher


def _started(fake: FakePacks) -> list[str]:
    with fake.lock:
        return [c[0] for c in fake.calls]


def test_while_yielding_only_reads_and_the_trace_start_requests():
    fake = FakePacks()
    hint = fake.add("hint", payloads(1))[0]
    background = fake.add("background", payloads(1))[0]
    trace = fake.add("trace", payloads(1))[0]
    read = fake.add("read", payloads(1))[0]
    f = Fetcher(fake.read_range, max_requests=4, reserved_for_read=1)

    async def body(nursery):
        f.yield_to_snapshot(True)
        assert f.yielding
        f.prefetch([hint], Priority.HINT)
        f.prefetch([background], Priority.BACKGROUND)
        await trio.sleep(0.2)
        assert _started(fake) == []  # both wait for the snapshot's end
        f.prefetch([trace], Priority.TRACE)
        assert await f.get(read) is not None
        await f.get(trace)
        assert sorted(_started(fake)) == ["read", "trace"]
        f.yield_to_snapshot(False)
        await f.get(hint, Priority.HINT)
        await f.get(background, Priority.BACKGROUND)

    run_with_fetcher(f, body)
    assert sorted(_started(fake)) == ["background", "hint", "read", "trace"]


def test_a_queued_hint_wanted_by_a_reader_is_not_held_back():
    fake = FakePacks()
    hint = fake.add("hint", payloads(1))[0]
    f = Fetcher(fake.read_range, max_requests=4, reserved_for_read=1)

    async def body(nursery):
        f.yield_to_snapshot(True)
        f.prefetch([hint], Priority.HINT)
        await trio.sleep(0.1)
        assert _started(fake) == []
        with trio.fail_after(5):
            await f.get(hint)  # the application reads it: READ, whatever it was queued as
        assert _started(fake) == ["hint"]

    run_with_fetcher(f, body)


def test_the_gate_follows_running_and_counts_what_it_yielded():
    fake = FakePacks()
    f = Fetcher(fake.read_range)
    state = {"running": False}
    gate = SnapshotGate(f, lambda: state["running"], poll=0.01)

    async def until(cond):
        with trio.fail_after(5):
            while not cond():
                await trio.sleep(0.01)

    async def body(nursery):
        cancel = trio.CancelScope()

        async def watch():
            with cancel:
                await gate.watch()

        nursery.start_soon(watch)
        await trio.sleep(0.05)
        assert not f.yielding and gate.stats() == {"yielding": False, "snapshots": 0, "yielded_s": 0.0}
        state["running"] = True
        await until(lambda: f.yielding)
        await trio.sleep(0.2)
        assert gate.stats()["yielding"] and gate.stats()["yielded_s"] >= 0.2
        state["running"] = False
        await until(lambda: not f.yielding)
        state["running"] = True
        await until(lambda: f.yielding)
        cancel.cancel()  # a gate whose watch ends never leaves the fetcher held back
        await until(lambda: not f.yielding)
        assert gate.snapshots == 2 and gate.yielded_s >= 0.2

    run_with_fetcher(f, body)


def test_the_pacer_and_the_build_gate_wait_out_a_snapshot():
    state = {"hold": True}
    pacer = Pacer(None, hold=lambda: state["hold"], poll=0.01)
    build = BuildGate(None, hold=lambda: state["hold"], poll=0.01, max_pause=0.2)
    waited: dict[str, float] = {}

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(build.watch)

            async def release():
                await trio.sleep(0.3)
                state["hold"] = False

            nursery.start_soon(release)
            start = trio.current_time()
            await pacer.after(0.001)  # a batch of 1 ms, no application: only the snapshot holds it
            waited["pacer"] = trio.current_time() - start
            state["hold"] = True
            await trio.sleep(0.05)
            waited["build"] = await trio.to_thread.run_sync(build.pause, 1.0)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert waited["pacer"] >= 0.29 and pacer.pauses == 1 and pacer.paused_s >= 0.29
    assert waited["build"] >= 0.19  # paused as for an active application (max_pause)


def test_a_mark_counts_only_while_its_process_lives(tmp_path):
    assert not snapshot_running(tmp_path)
    mark = mark_snapshot_running(tmp_path)
    assert mark.name == f"snapshot-running.{os.getpid()}" and snapshot_running(tmp_path)
    clear_snapshot_running(mark)
    assert not snapshot_running(tmp_path) and not mark.exists()
    # a snapshot that died (SIGKILL) leaves its mark: it must not hold the mount back
    code = ("import sys; from pathlib import Path; from ogrefs.box.records import mark_snapshot_running; "
            "print(mark_snapshot_running(Path(sys.argv[1])))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, capture_output=True, text=True,
                         timeout=60).stdout.strip()
    assert os.path.exists(out) and not snapshot_running(tmp_path)
    # this process's pid with another start time: a new process that reuses a dead snapshot's pid
    (tmp_path / f"snapshot-running.{os.getpid()}").write_text("1")
    assert not snapshot_running(tmp_path)
    (tmp_path / f"snapshot-running.{os.getpid()}").write_text("damaged")
    assert not snapshot_running(tmp_path)
    assert not snapshot_running(tmp_path / "missing")


def test_while_yielding_fetched_chunks_wait_to_be_written_to_the_disk_cache(tmp_path):
    from ogrefs.lazy.fetch.chunkcache import ChunkCache

    fake = FakePacks()
    read = fake.add("read", payloads(1))[0]
    cache = ChunkCache(tmp_path / "chunks", 64 << 20)
    f = Fetcher(fake.read_range, cache)

    async def body(nursery):
        f.yield_to_snapshot(True)
        assert await f.get(read) is not None  # the reader is served at once ...
        await trio.sleep(0.3)
        assert cache.load(read.chunk, read.raw_len) is None  # ... but the chunk is not written behind it
        f.yield_to_snapshot(False)
        with trio.fail_after(10):
            while cache.load(read.chunk, read.raw_len) is None:
                await trio.sleep(0.02)

    run_with_fetcher(f, body)


def test_while_yielding_a_hint_replay_asks_the_fetcher_nothing():
    from ogrefs.lazy.trace.replay import Replayer

    fake = FakePacks()
    refs = [fake.add(f"p{i}", payloads(1))[0] for i in range(8)]
    f = Fetcher(fake.read_range)
    asked: list[int] = []
    request = f.request

    def counting(group, *a, **kw):
        asked.append(len(group))
        return request(group, *a, **kw)

    f.request = counting  # type: ignore[method-assign]
    replay = Replayer.from_refs(None, f, refs, priority=Priority.HINT, group_bytes=64 * 1024, window_bytes=1 << 20)

    async def body(nursery):
        f.yield_to_snapshot(True)
        nursery.start_soon(replay.run)
        await trio.sleep(0.3)
        assert asked == [] and not replay.stats.finished
        f.yield_to_snapshot(False)
        with trio.fail_after(10):
            while not replay.stats.finished:
                await trio.sleep(0.02)

    run_with_fetcher(f, body)
    assert sum(asked) == len(refs) and replay.stats.bytes_done == sum(r.raw_len for r in refs)


def test_ogrefs_status_says_when_the_mount_steps_aside(capsys):
    from ogrefs.cli.mount import _report

    st = {"time": 10.0, "started": 0.0, "snapshot": "ab" * 32, "mountpoint": "/", "pid": 1, "bytes_read": 0,
          "reads": 0, "open_files": 0, "bytes_fetched": 0, "requests": 0, "chunks_fetched": 0, "cache_hits": 0,
          "cache_hits_memory": 0, "cache_hits_disk": 0, "cache_misses": 0, "chunks_in_flight": 0,
          "chunks_queued": 0, "errors": 0, "read_errors": 0, "corrupt": 0, "retries": 0,
          "snapshot_yield": {"yielding": True, "snapshots": 1, "yielded_s": 0.5}}
    _report(st, as_json=False)
    assert "a snapshot of the box is running: prefetch, cache writes and materialization wait" in capsys.readouterr().out
    _report(dict(st, snapshot_yield={"yielding": False, "snapshots": 2, "yielded_s": 3.31}), as_json=False)
    assert "stepped aside for 2 snapshot(s) of the box, 3.3 s in all" in capsys.readouterr().out
    _report(dict(st, snapshot_yield=None), as_json=False)
    assert "snapshot of the box" not in capsys.readouterr().out


@pytest.mark.timeout(30)  # without the release at the fetcher's end, the shielded write waits forever
def test_an_unmount_during_a_snapshot_still_writes_what_was_fetched_to_the_cache(tmp_path):
    from ogrefs.lazy.fetch.chunkcache import ChunkCache

    fake = FakePacks()
    read = fake.add("read", payloads(1))[0]
    cache = ChunkCache(tmp_path / "chunks", 64 << 20)
    f = Fetcher(fake.read_range, cache)

    async def body(nursery):
        f.yield_to_snapshot(True)
        await f.get(read)
        await trio.sleep(0.1)
        assert cache.load(read.chunk, read.raw_len) is None  # held back by the snapshot ...

    run_with_fetcher(f, body)  # ... and the fetcher's end (an unmount) writes it, without waiting for the snapshot
    assert cache.load(read.chunk, read.raw_len) is not None
