"""Background jobs run niced in their worker thread and give the thread its priority back (tier 1)."""

from __future__ import annotations

import os
import threading

import pytest

from ogrefs.lazy.fetch import threadnice


def own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def in_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(10)
    assert out, "the thread did not finish"
    return out[0]


@pytest.mark.skipif(not threadnice.may_renice(), reason="this process may not raise a thread's priority back")
def test_a_job_runs_niced_and_its_thread_gets_its_priority_back_even_when_it_fails():
    def job():
        return own_nice()

    def failing():
        raise ValueError("boom")

    def body():
        before = own_nice()
        during = threadnice.run_niced(job)
        after = own_nice()
        with pytest.raises(ValueError):
            threadnice.run_niced(failing)
        return before, during, after, own_nice()

    before, during, after, after_failure = in_thread(body)
    assert during == min(19, before + threadnice.BACKGROUND_NICE)
    assert after == before and after_failure == before
    assert own_nice() == before  # the calling thread was never touched


def test_without_the_right_to_raise_it_back_a_job_runs_at_the_normal_priority(monkeypatch):
    monkeypatch.setattr(threadnice, "_may", False)
    assert in_thread(lambda: (own_nice(), threadnice.run_niced(own_nice))) == (own_nice(), own_nice())
