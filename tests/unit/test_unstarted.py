"""A program systemd has forked but not started yet, found before ``mount /`` covers the tree it will exec from.

A fake /proc: each process a directory with ``status``, ``comm``, ``cgroup`` and
an ``exe`` link (os.readlink needs no target), so the cases that a booted box
shows only under load (a child not yet renamed "(agetty)") are exact here.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from ogrefs.box import holders

SYSTEMD = "/usr/lib/systemd/systemd"


def proc_entry(proc: Path, pid: int, comm: str, exe: str, ppid: int = 1, cgroup: str = "0::/system.slice/x.service"):
    d = proc / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "status").write_text(f"Name:\t{comm}\nState:\tS (sleeping)\nPid:\t{pid}\nPPid:\t{ppid}\n")
    (d / "comm").write_text(comm + "\n")
    (d / "cgroup").write_text(cgroup + "\n")
    if os.path.lexists(d / "exe"):
        os.unlink(d / "exe")
    os.symlink(exe, d / "exe")


def box(tmp_path: Path, init: str = "systemd", init_exe: str = SYSTEMD) -> Path:
    proc = tmp_path / "proc"
    proc_entry(proc, 1, init, init_exe, ppid=0, cgroup="0::/init.scope")
    return proc


def test_a_child_of_systemd_not_yet_renamed_nor_exec_d_is_unstarted(tmp_path):
    """Its name is still systemd's: a check of names ("(agetty)"), as the unit made before, let the mount go ahead."""
    proc = box(tmp_path)
    proc_entry(proc, 37, "systemd", SYSTEMD, cgroup="0::/init.scope")
    proc_entry(proc, 38, "(agetty)", SYSTEMD, cgroup="0::/system.slice/console-getty.service")
    proc_entry(proc, 40, "sshd", "/usr/sbin/sshd")
    found = holders.unstarted(proc)
    assert sorted((h.pid, h.comm) for h in found) == [(37, "systemd"), (38, "(agetty)")]


def test_systemd_s_executor_counts_as_not_started(tmp_path):
    """From systemd 255 on (Debian 13) the child execs systemd-executor, which holds the idle wait."""
    proc = box(tmp_path)
    proc_entry(proc, 51, "(agetty)", "/usr/lib/systemd/systemd-executor")
    assert [h.pid for h in holders.unstarted(proc)] == [51]


def test_programs_started_user_managers_and_grandchildren_are_not_counted(tmp_path):
    proc = box(tmp_path)
    proc_entry(proc, 60, "agetty", "/sbin/agetty")  # started
    proc_entry(proc, 61, "systemd", SYSTEMD, cgroup="0::/user.slice/user-0.slice/user@0.service/init.scope")
    proc_entry(proc, 62, "(sd-pam)", SYSTEMD, ppid=61)  # a user manager's helper, not PID 1's child
    proc_entry(proc, 63, "bash", "/usr/bin/bash", ppid=60)
    assert holders.unstarted(proc) == []


def test_nothing_is_unstarted_where_pid_1_is_not_systemd(tmp_path):
    """A container whose PID 1 is tini or a shell: its forked children share its executable, and none waits."""
    proc = box(tmp_path, init="bash", init_exe="/usr/bin/bash")
    proc_entry(proc, 7, "bash", "/usr/bin/bash")
    assert holders.unstarted(proc) == []


def test_the_wait_ends_when_the_program_starts(tmp_path):
    proc = box(tmp_path)
    proc_entry(proc, 37, "(agetty)", SYSTEMD)

    def execs():
        time.sleep(0.3)
        proc_entry(proc, 37, "agetty", "/sbin/agetty")

    t = threading.Thread(target=execs)
    t.start()
    waited, left = holders.wait_started(timeout=30, poll=0.01, proc=proc)
    t.join()
    assert [h.pid for h in waited] == [37] and left == []
    assert [h.pid for h in holders.unstarted(proc)] == []


def test_the_wait_gives_up_at_its_bound_and_names_what_is_left(tmp_path):
    proc = box(tmp_path)
    proc_entry(proc, 37, "(agetty)", SYSTEMD)
    waited, left = holders.wait_started(timeout=0.2, poll=0.01, proc=proc)
    assert [h.pid for h in waited] == [37] == [h.pid for h in left]
