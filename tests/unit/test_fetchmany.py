"""repo/fetchmany.in_order: several fetches at once, results in order, errors per item, a bounded window."""

from __future__ import annotations

import threading

import pytest

from ogrefs.repo.fetchmany import in_order


def test_results_come_in_order_with_each_items_error():
    def fetch(n: int) -> int:
        if n == 3:
            raise KeyError(n)
        return n * n

    got = []
    for n, result in in_order(fetch, range(8), workers=4):
        try:
            got.append((n, result()))
        except KeyError as exc:
            got.append((n, f"error {exc}"))
    assert got == [(0, 0), (1, 1), (2, 4), (3, "error 3"), (4, 16), (5, 25), (6, 36), (7, 49)]


def test_fetches_overlap_but_never_run_more_than_the_window_ahead():
    lock = threading.Lock()
    state = {"running": 0, "most": 0, "started": 0}
    two = threading.Event()
    consumed = []

    def fetch(n: int) -> int:
        with lock:
            state["running"] += 1
            state["started"] += 1
            state["most"] = max(state["most"], state["running"])
            if state["running"] >= 2:
                two.set()
            started, done = state["started"], len(consumed)
        assert started - done <= 6 + 1, f"{started} started with {done} consumed"  # the window and the one in hand
        try:
            if not two.wait(10):
                raise TimeoutError("fetched alone: nothing ran beside it")
            return n
        finally:
            with lock:
                state["running"] -= 1

    for n, result in in_order(fetch, range(40), workers=3, ahead=6):
        consumed.append(result())
    assert consumed == list(range(40))
    assert 2 <= state["most"] <= 3


def test_a_consumer_that_stops_cancels_what_has_not_started():
    started = []
    gate = threading.Event()

    def fetch(n: int) -> int:
        started.append(n)
        gate.wait(10)
        return n

    gen = in_order(fetch, range(100), workers=2, ahead=4)
    n, result = next(gen)
    gate.set()
    assert (n, result()) == (0, 0)
    gen.close()  # the consumer stops: the pool shuts down, cancelling what waits in it
    assert len(started) <= 6


@pytest.mark.parametrize("items", [[], ["only"]])
def test_nothing_or_one_item_runs_in_the_callers_thread(items):
    caller = threading.get_ident()
    seen = []
    for item, result in in_order(lambda i: (seen.append(threading.get_ident()), i)[1], items):
        assert result() == item
    assert seen == [caller] * len(items)
