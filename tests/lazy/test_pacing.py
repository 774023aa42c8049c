"""Materialization yields to an active application: the pacer's pauses (trio's mock clock), then a real pass;
the tree build's gate, alone and in a real build."""

from __future__ import annotations

import os
import sys
import time

import pytest
import trio
import trio.testing

from ogrefs.lazy.fetch.fetcher import Fetcher
from ogrefs.lazy.background.materialize.materializer import Materializer
from ogrefs.lazy.background.materialize.build import prepare
from ogrefs.lazy.background.materialize.pacing import BuildGate, Pacer
from ogrefs.lazy.background.materialize.writer import TreeWriter

from tests.resume_box import Box, build_child, make_box, run_trio, spinning_build_child
from tests.treegen import compare_trees

MiB = 1024 * 1024


def paused(pacer: Pacer, took: float) -> float:
    """Seconds of (mock) time ``pacer.after(took)`` waited."""
    out: list[float] = []

    async def main() -> None:
        t0 = trio.current_time()
        await pacer.after(took)
        out.append(trio.current_time() - t0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return out[0]


def test_an_active_application_gets_three_quarters_of_the_time():
    pacer = Pacer(lambda: 0.0, share=0.25, max_pause=2.0, poll=0.05)
    assert 1.5 <= paused(pacer, 0.5) < 1.5 + 0.05 + 1e-9  # a batch of 0.5 s: 1.5 s for the application
    assert pacer.pauses == 1 and pacer.paused_s == pytest.approx(1.5, abs=0.06)


def test_no_pause_for_an_idle_application_or_without_one():
    assert paused(Pacer(lambda: 10.0), 1.0) == 0.0
    assert paused(Pacer(None), 1.0) == 0.0  # no vfs (tests, tools): never paced
    assert paused(Pacer(lambda: 0.0), 0.0) == 0.0


def test_a_pause_is_bounded_and_ends_when_the_application_goes_quiet():
    assert paused(Pacer(lambda: 0.0, max_pause=2.0), 100.0) == pytest.approx(2.0, abs=0.06)

    last_request: list[float] = []

    def idle_for() -> float:  # the application's last request came just before the batch ended
        now = trio.current_time()
        if not last_request:
            last_request.append(now)
        return now - last_request[0]

    waited = paused(Pacer(idle_for, active_s=0.5, max_pause=2.0, poll=0.05), 10.0)
    assert 0.5 <= waited < 0.5 + 0.05 + 1e-9


def test_an_application_that_computes_on_every_core_without_requests_is_active_too():
    """A training step with its data in memory asks the mount nothing; the box's CPU says it is there."""
    computing = Pacer(lambda: 10.0, share=0.25, max_pause=2.0, poll=0.05, busy=lambda: True)
    assert 1.5 <= paused(computing, 0.5) < 1.5 + 0.05 + 1e-9
    assert paused(Pacer(lambda: 10.0, busy=lambda: False), 1.0) == 0.0
    assert paused(Pacer(None, busy=lambda: True), 0.5) >= 1.5  # (no vfs, still the box's CPU)


def test_the_share_must_be_a_fraction():
    for bad in (0.0, -1.0, 1.5):
        with pytest.raises(ValueError):
            Pacer(lambda: 0.0, share=bad)


@pytest.fixture(scope="module")
def box(tmp_path_factory) -> Box:
    return make_box(tmp_path_factory.mktemp("box"))


@pytest.mark.parametrize("application", ["active", "computing", "idle"])
def test_a_pass_pauses_after_each_batch_while_the_application_is_active(box, tmp_path, application):
    spans: list[tuple[float, float]] = []  # (start, end) of each batch written, on the loop's clock source

    class TimedWriter(TreeWriter):
        def write_batch(self, batch):
            t0 = time.perf_counter()
            time.sleep(0.02)  # a batch that takes measurable time
            try:
                return super().write_batch(batch)
            finally:
                spans.append((t0, time.perf_counter()))

    idle_for = (lambda: 0.0) if application == "active" else (lambda: 1e9)
    # "computing": no request to the mount, but the box's other processes leave this one no core
    cpu_busy = (lambda: (lambda: True)) if application == "computing" else (lambda: (lambda: False))
    fetcher = Fetcher(box.repo.read_pack_range)
    m = Materializer(box.catalog, fetcher, tmp_path / "state", window_bytes=MiB, group_bytes=256 * 1024,
                     batch_bytes=512 * 1024, make_writer=TimedWriter, idle_for=idle_for, cpu_busy=cpu_busy)
    run_trio(fetcher, m.run)
    assert m.complete and compare_trees(box.src, box.tree_of(tmp_path / "state")) == []
    assert len(spans) >= 4
    if application == "idle":
        assert m.pacer.pauses == 0 and m.stats()["yielded_s"] == 0.0
        return
    # after each batch, at least three times its own duration passes before the next one starts
    for (s0, e0), (s1, _e1) in zip(spans, spans[1:]):
        assert s1 - e0 >= 3 * (e0 - s0) * 0.999, (s0, e0, s1)
    assert m.pacer.pauses >= len(spans) - 1 and m.stats()["yielded_s"] > 0


def gate_waits(idle: list[float], worked: float, flip_after: float | None = None, **kw) -> float:
    """Seconds a worker thread's ``gate.pause(worked)`` waited, with the gate watched on a real loop;
    ``idle[0]`` is the application's idle time, set to 1e9 (quiet) ``flip_after`` seconds into the pause."""
    gate = BuildGate(lambda: idle[0], poll=0.005, **kw)
    out: list[float] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gate.watch)
            await trio.sleep(0.02)  # the watcher has looked once
            if flip_after is not None:
                async def quiet_later() -> None:
                    await trio.sleep(flip_after)
                    idle[0] = 1e9
                nursery.start_soon(quiet_later)
            out.append(await trio.to_thread.run_sync(gate.pause, worked))
            nursery.cancel_scope.cancel()

    trio.run(main)
    return out[0]


def test_the_build_gate_holds_a_piece_three_times_its_work_while_the_application_is_active():
    assert 0.27 <= gate_waits([0.0], 0.1) < 0.6  # 0.1 s of work, a quarter of the time: 0.3 s
    assert 0.45 <= gate_waits([0.0], 10.0, max_pause=0.5) < 0.9  # never longer than max_pause


def test_the_build_gate_never_holds_an_idle_application_or_a_gate_nobody_watches():
    assert gate_waits([1e9], 0.1) < 0.05
    assert BuildGate(lambda: 0.0).pause(10.0) == 0.0  # no watcher: never waits (a build without a loop)
    assert BuildGate(None).pause(10.0) == 0.0


def test_the_build_gate_holds_a_piece_while_the_box_computes_without_requests():
    """(A gate with ``busy``; the materializer's build gate has none: its child runs at idle priority.)"""
    gate = BuildGate(lambda: 1e9, poll=0.005, busy=lambda: True)
    out: list[float] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gate.watch)
            await trio.sleep(0.02)
            out.append(await trio.to_thread.run_sync(gate.pause, 0.1))
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert 0.27 <= out[0] < 0.6


#: a child whose build takes at least 0.8 s of its own running time
SLOW_CHILD = spinning_build_child(0.8)


@pytest.mark.parametrize("application", ["active", "computing", "idle"])
def test_the_tree_build_child_is_held_at_the_gate_while_the_application_is_active(box, tmp_path, application):
    """Active: the child is stopped three quarters of the time; a box computing on every core without asking
    the mount anything does not hold it (the kernel gives an idle-priority child no core anybody wants)."""
    idle_for = (lambda: 0.0) if application == "active" else (lambda: 1e9)
    cpu_busy = (lambda: (lambda: True)) if application == "computing" else None
    fetcher = Fetcher(box.repo.read_pack_range)
    started: list[float] = []
    m = Materializer(box.catalog, fetcher, tmp_path / "state", idle_for=idle_for, cpu_busy=cpu_busy,
                     build_command=SLOW_CHILD,
                     preparer=lambda *args: (started.append(time.monotonic()), prepare(*args))[1])
    prepared_at: list[float] = []

    async def body() -> None:
        await m.run(on_prepared=lambda: prepared_at.append(time.monotonic()))

    run_trio(fetcher, body)
    assert m.complete and compare_trees(box.src, box.tree_of(tmp_path / "state")) == []
    took, yielded = prepared_at[0] - started[0], m._build_yielded_s
    if application == "active":
        # 0.8 s of the child's work at a quarter of the time: about 2.4 s held
        assert yielded >= 1.5 and took >= 0.8 + yielded * 0.99, (took, yielded)
    else:
        assert yielded == 0.0, (took, yielded)


def test_a_cancelled_materializer_kills_its_tree_build_at_once_and_the_next_run_builds_it_whole(box, tmp_path):
    """The daemon of a mount that went away exits at once (a remount of the same state is refused while
    it lives): the build's child is killed, and what it left is not taken for a built tree."""
    pid_file = tmp_path / "child.pid"
    slow = build_child(
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "from ogrefs.localtree import LocalTree\nreal = LocalTree.make_dir\n"
        "def make_dir(self, path):\n    time.sleep(0.1)\n    return real(self, path)\n"
        "LocalTree.make_dir = make_dir")
    dirs = sum(1 for _p, node in box.catalog.walk() if node.is_dir)
    assert dirs * 0.1 > 1.5  # the build alone would outlast the cancellation by far
    fetcher = Fetcher(box.repo.read_pack_range)
    m = Materializer(box.catalog, fetcher, tmp_path / "state", idle_for=lambda: 1e9, build_command=slow)
    tree = tmp_path / "state" / "tree"
    times: dict[str, float] = {}

    async def cancelled_run() -> None:
        # cancelled once the child has begun (its first directory), however long an idle-priority child
        # took to get there on a loaded machine (at a fixed 0.8 s it had sometimes made none yet)
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(m.run)
                with trio.fail_after(60):
                    while not tree.is_dir() or not any(tree.iterdir()):
                        await trio.sleep(0.02)
                times["cancelled"] = time.monotonic()
                scope.cancel()
        times["ended"] = time.monotonic()

    run_trio(fetcher, cancelled_run)
    assert times["ended"] - times["cancelled"] < 0.5  # not the whole build's seconds
    pid = int(pid_file.read_text())
    assert not os.path.exists(f"/proc/{pid}")  # killed and reaped
    made = sum(1 for _ in (tmp_path / "state" / "tree").rglob("*"))
    assert 0 < made < dirs  # it had begun
    assert not m.complete and not m.is_built()
    m2 = Materializer(box.catalog, Fetcher(box.repo.read_pack_range), tmp_path / "state")
    run_trio(m2.fetcher, m2.run)  # redone from scratch: everything, exactly
    assert m2.complete and compare_trees(box.src, box.tree_of(tmp_path / "state")) == []
