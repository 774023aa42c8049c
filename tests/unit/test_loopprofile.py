"""The loop profile: task steps charged to the FUSE operation they served, wake-up lateness, run-queue waits (tier 1)."""

from __future__ import annotations

import os
import time

import trio

from ogrefs.mount import loopprofile
from ogrefs.mount.loopprofile import LoopProfile


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_step_is_charged_to_its_operation_with_its_wall_and_cpu_time():
    """A step that computes shows CPU near its wall time; one that blocks (the loop off its core, or waiting
    for the GIL) shows wall time without CPU: the difference the profile is for."""
    profile = LoopProfile()

    async def lookup():
        profile.serving("lookup")
        spin(0.03)

    async def read():
        profile.serving("read")
        time.sleep(0.03)

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lookup)
            nursery.start_soon(read)

    trio.run(main, instruments=[profile])
    r = profile.report()["steps"]
    assert r["lookup"]["count"] == 1 and r["read"]["count"] == 1 and r["other"]["count"] >= 1
    assert r["lookup"]["cpu_s"] >= 0.025 and r["lookup"]["wall_s"] >= r["lookup"]["cpu_s"] - 0.005
    assert r["read"]["wall_s"] >= 0.025 and r["read"]["cpu_s"] < 0.015
    assert r["read"]["longest_ms"] >= 25


def test_the_step_that_adds_the_profile_is_not_counted_from_the_epoch():
    """The daemon adds the instrument from inside a running task: that step's end comes without its
    beginning, and must not count as a step as long as the machine's uptime."""
    profile = LoopProfile()
    began = time.perf_counter()

    async def main():
        trio.lowlevel.add_instrument(profile)
        await trio.sleep(0)
        spin(0.01)
        await trio.sleep(0)

    trio.run(main)
    took = time.perf_counter() - began
    r = profile.report()["steps"]
    assert r["other"]["count"] >= 2
    assert r["other"]["wall_s"] <= took and r["other"]["longest_ms"] <= took * 1e3


def test_a_blocked_loop_shows_as_late_wake_ups():
    profile = LoopProfile()

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(profile.sample_wakeups)
            await trio.sleep(0.1)
            time.sleep(0.06)  # the loop blocked: the sampler wakes ~60 ms late once
            await trio.sleep(0.1)
            nursery.cancel_scope.cancel()

    trio.run(main)
    late = profile.report()["wakeup_late_ms"]
    assert late["samples"] >= 20
    assert late["worst"] >= 50
    assert late["median"] <= 20  # the other wake-ups were on time, give or take a busy CI box


def test_thread_times_sum_the_loop_and_the_workers_and_skip_what_cannot_be_read(tmp_path):
    proc = tmp_path / "task"
    for tid, stat in ((os.getpid(), "2000000000 500000000 10"), (1, "1000000000 3000000000 5"),
                      (2, "500000000 250000000 2"), (3, "garbage")):
        (proc / str(tid)).mkdir(parents=True)
        (proc / str(tid) / "schedstat").write_text(stat + "\n")
    (proc / "4").mkdir()  # a thread that ended between the listing and the read
    t = loopprofile.thread_times(proc)
    assert t == {"loop": {"threads": 1, "cpu_s": 2.0, "waiting_for_a_core_s": 0.5},
                 "workers": {"threads": 2, "cpu_s": 1.5, "waiting_for_a_core_s": 3.25}}
    assert loopprofile.thread_times(tmp_path / "absent") == {}


def test_switched_on_by_the_environment_only():
    assert not loopprofile.enabled({})
    assert not loopprofile.enabled({"OGREFS_PROFILE_LOOP": "0"})
    assert loopprofile.enabled({"OGREFS_PROFILE_LOOP": "1"})
