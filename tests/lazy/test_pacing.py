"""Materialization yields to an active application: the pacer's pauses (trio's mock clock), then a real pass;
the tree build's gate, alone and in a real build."""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from ogrefs.lazy.fetcher import Fetcher
from ogrefs.lazy.materialize.materializer import Materializer
from ogrefs.lazy.materialize import build
from ogrefs.lazy.materialize.pacing import BuildGate, Pacer
from ogrefs.lazy.materialize.writer import TreeWriter

from tests.resume_box import Box, make_box, run_trio
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


def test_the_build_gate_opens_when_the_application_goes_quiet():
    assert 0.15 <= gate_waits([0.0], 10.0, flip_after=0.2) < 0.5  # would be 2 s (max_pause) had it stayed active


@pytest.mark.parametrize("application", ["active", "idle"])
def test_the_tree_build_waits_at_the_gate_while_the_application_is_active(box, tmp_path, monkeypatch, application):
    monkeypatch.setattr(build, "_TICK", 1)  # a look at the gate after every entry of the small box
    monkeypatch.setattr(build, "_PIECE_S", 0.0)
    pauses: list[float] = []
    worked_s: list[float] = []
    real_pause = BuildGate.pause

    def pause(self, worked: float) -> float:
        waited = real_pause(self, worked)
        pauses.append(waited)
        worked_s.append(worked)
        return waited

    monkeypatch.setattr(BuildGate, "pause", pause)
    idle_for = (lambda: 0.0) if application == "active" else (lambda: 1e9)
    fetcher = Fetcher(box.repo.read_pack_range)
    m = Materializer(box.catalog, fetcher, tmp_path / "state", idle_for=idle_for)
    run_trio(fetcher, m.run)
    assert m.complete and compare_trees(box.src, box.tree_of(tmp_path / "state")) == []
    assert len(pauses) > 10  # the gate was asked between pieces of the build
    if application == "idle":
        assert sum(pauses) < 0.05 and m.stats()["yielded_s"] < 0.1
    else:
        # Every look at the gate waited (3x the piece's work: on a fast machine a few ms in all, so no floor
        # on the sum: it was 0.043 s once, and a floor of 0.05 s failed the suite), and the materializer
        # counts what its build yielded.
        assert all(p > 0 for p, w in zip(pauses, worked_s) if w > 0) and any(w > 0 for w in worked_s)
        assert m.stats()["yielded_s"] >= sum(pauses) - 0.051  # the stat is rounded to 0.1 s


def test_a_cancelled_materializer_stops_its_tree_build_at_once_and_the_next_run_builds_it_whole(
        box, tmp_path, monkeypatch):
    """A worker thread cannot be cancelled: the gate stops the build, so a daemon whose mount went away
    does not wait for the whole tree (it did: a remount of the same state was refused meanwhile)."""
    monkeypatch.setattr(build, "_TICK", 1)
    made: list[float] = []

    def slow_writer(catalog, tree, plan):
        real = tree.make_dir

        def make_dir(path):
            time.sleep(0.1)  # 0.1 s a directory: the whole build takes seconds
            made.append(time.monotonic())
            return real(path)

        tree.make_dir = make_dir
        return TreeWriter(catalog, tree, plan)

    dirs = sum(1 for _p, node in box.catalog.walk() if node.is_dir)
    assert dirs * 0.1 > 1.5  # the build alone would outlast the cancellation by far
    fetcher = Fetcher(box.repo.read_pack_range)
    m = Materializer(box.catalog, fetcher, tmp_path / "state", make_writer=slow_writer, idle_for=lambda: 1e9)
    ended: list[float] = []

    async def cancelled_run() -> None:
        with trio.move_on_after(0.4) as scope:
            await m.run()
        ended.append(time.monotonic())
        assert scope.cancelled_caught

    run_trio(fetcher, cancelled_run)
    assert 0 < len(made) < dirs and ended[0] - made[-1] < 0.5  # stopped at the next directory, not at the end
    assert not m.complete and not m.is_built()
    m2 = Materializer(box.catalog, Fetcher(box.repo.read_pack_range), tmp_path / "state")
    run_trio(m2.fetcher, m2.run)  # redone from scratch: everything, exactly
    assert m2.complete and compare_trees(box.src, box.tree_of(tmp_path / "state")) == []
