"""The box's CPU as the materializer's pacing reads it: the cores other processes take, not this one's.

Unit tests on fake ``/proc`` files (the arithmetic, the threshold, the
rate limit, a box without ``/proc``), then the real ``/proc`` with processes
that compute on every core.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ogrefs.lazy.background.boxcpu import OthersCpu


class FakeProc:
    """``/proc/stat``'s first line and ``/proc/self/stat``, written on demand; a clock the test moves."""

    def __init__(self, tmp_path: Path) -> None:
        self.stat, self.own = tmp_path / "stat", tmp_path / "self-stat"
        self.user = self.idle = self.steal = self.mine = 0
        self.now = 100.0
        self.write()

    def write(self) -> None:  # cpu  user nice system idle iowait irq softirq steal guest guest_nice
        self.stat.write_text(f"cpu  {self.user} 0 0 {self.idle} 0 0 0 {self.steal} 0 0\ncpu0 0 0 0 0 0\n")
        # pid (comm) state ... field 14 utime, 15 stime (1-based); a comm with a space and a parenthesis
        self.own.write_text(f"42 (od d) x) S {' '.join(['0'] * 10)} {self.mine} 0 0 0\n")

    def spend(self, seconds: float, cores: int, others: float, mine: float, steal: float = 0.0) -> None:
        """``seconds`` of a box of ``cores``: ``others`` cores busy elsewhere, ``mine`` here, the rest idle."""
        tick = lambda cores_: round(cores_ * seconds * 100)  # noqa: E731  (100 ticks a second per CPU)
        self.user += tick(others + mine)
        self.mine += tick(mine)
        self.steal += tick(steal)
        self.idle += tick(cores - others - mine - steal)
        self.now += seconds
        self.write()

    def reader(self, cores: int, **kw) -> OthersCpu:
        return OthersCpu(stat=str(self.stat), own=str(self.own), cores=cores, clock=lambda: self.now, **kw)


def test_the_cores_other_processes_took_leave_out_this_process_and_steal(tmp_path):
    proc = FakeProc(tmp_path)
    cpu = proc.reader(cores=4)
    proc.spend(1.0, cores=4, others=2.5, mine=1.0, steal=0.25)
    assert cpu.others_cores() == pytest.approx(2.5)
    proc.spend(0.5, cores=4, others=0.0, mine=1.0)
    assert cpu.others_cores() == pytest.approx(0.0)
    assert cpu.others_cores() == 0.0  # no time passed since the last look


def test_busy_while_the_others_leave_less_than_a_core(tmp_path):
    proc = FakeProc(tmp_path)
    cpu = proc.reader(cores=2)
    assert cpu.spare == 1.0
    proc.spend(0.2, cores=2, others=1.8, mine=0.2)  # a step computing on both cores
    assert cpu.busy() is True
    proc.spend(0.2, cores=2, others=0.9, mine=1.0)  # an import on one core, this process on the other
    assert cpu.busy() is False
    proc.spend(0.2, cores=2, others=0.0, mine=2.0)  # this process alone, however busy: never its own brake
    assert cpu.busy() is False


def test_a_box_of_one_core_is_busy_once_the_others_take_half_of_it(tmp_path):
    proc = FakeProc(tmp_path)
    cpu = proc.reader(cores=1)
    assert cpu.spare == 0.5
    proc.spend(0.2, cores=1, others=0.3, mine=0.5)
    assert cpu.busy() is False
    proc.spend(0.2, cores=1, others=0.7, mine=0.3)
    assert cpu.busy() is True


def test_asked_more_often_than_every_it_answers_its_last_reading(tmp_path):
    proc = FakeProc(tmp_path)
    cpu = proc.reader(cores=2, every=0.1)
    proc.spend(0.2, cores=2, others=2.0, mine=0.0)
    assert cpu.busy() is True
    proc.spend(0.05, cores=2, others=0.0, mine=0.0)  # 50 ms later: 10 jiffies are no reading
    assert cpu.busy() is True
    proc.spend(0.1, cores=2, others=0.0, mine=0.0)  # now a new look, over both quiet spells
    assert cpu.busy() is False


def test_without_proc_nothing_is_busy(tmp_path):
    cpu = OthersCpu(stat=str(tmp_path / "none"), own=str(tmp_path / "none-either"), clock=lambda: 1e9)
    assert cpu.others_cores() is None and cpu.busy() is False


def test_processes_computing_on_every_core_make_the_real_box_busy():
    cores = os.cpu_count() or 1
    cpu = OthersCpu(every=0.0)
    spin = "import time\nend = time.monotonic() + 0.6\nwhile time.monotonic() < end: pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(cores)]
    try:
        time.sleep(0.15)  # (their start-up)
        cpu.others_cores()
        time.sleep(0.3)
        others = cpu.others_cores()
    finally:
        for p in procs:
            p.wait(timeout=30)
    assert others is not None and others > cores - cpu.spare, others
