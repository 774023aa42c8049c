"""Materialization yields to an active application: the pacer's pauses (trio's mock clock), then a real pass."""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from ogrefs.lazy.fetcher import Fetcher
from ogrefs.lazy.materialize.materializer import Materializer
from ogrefs.lazy.materialize.pacing import Pacer
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


def test_the_share_must_be_a_fraction():
    for bad in (0.0, -1.0, 1.5):
        with pytest.raises(ValueError):
            Pacer(lambda: 0.0, share=bad)


@pytest.fixture(scope="module")
def box(tmp_path_factory) -> Box:
    return make_box(tmp_path_factory.mktemp("box"))


@pytest.mark.parametrize("application", ["active", "idle"])
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
    fetcher = Fetcher(box.repo.read_pack_range)
    m = Materializer(box.catalog, fetcher, tmp_path / "state", window_bytes=MiB, group_bytes=256 * 1024,
                     batch_bytes=512 * 1024, make_writer=TimedWriter, idle_for=idle_for)
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
