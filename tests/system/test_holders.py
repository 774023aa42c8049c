"""Who keeps an overlay busy (box/holders.py), in a private mount namespace with a real overlay."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                 reason="needs root and unshare (overlayfs)")]

SCRIPT = textwrap.dedent('''
    import json, os, shutil, subprocess, sys, time
    from ogrefs.box import holders, mountsys
    t = sys.argv[1]
    for d in ("low", "up", "wk", "m", "own"):
        os.makedirs(f"{t}/{d}", exist_ok=True)
    open(f"{t}/low/f", "w").write("x")
    shutil.copy("/bin/sleep", f"{t}/own/sleep-below")  # a program of the box's own, below the overlay
    before = subprocess.Popen([f"{t}/own/sleep-below", "30"], cwd=f"{t}/own")
    mountsys.overlay(f"{t}/own", f"lowerdir={t}/low:{t}/own,upperdir={t}/up,workdir={t}/wk")
    shutil.copy("/bin/sleep", f"{t}/own/sleep-above")
    procs = [subprocess.Popen(["sleep", "30"], cwd=f"{t}/own"),
             subprocess.Popen(["sh", "-c", f"exec 3<{t}/own/f; exec sleep 30"], cwd="/"),
             subprocess.Popen([f"{t}/own/sleep-above", "30"], cwd="/")]
    time.sleep(0.3)  # let sh reach its exec (the assertion below retries, no timing in it)
    for _ in range(50):
        found = holders.in_use([f"{t}/own"])
        if len(found.others) == 3:
            break
        time.sleep(0.1)
    mine = open(f"{t}/own/f")
    callers = holders.in_use([f"{t}/own"]).callers
    print(json.dumps({"others": {h.pid: h.what for h in found.others}, "callers": [h.pid for h in callers],
                      "pids": [p.pid for p in procs], "before": before.pid, "me": os.getpid(),
                      "refusal": found.refusal("unmount /")}))
    for p in procs + [before]:
        p.kill()
''')


def _in_namespace(script: str, tmp_path) -> dict:
    """Run ``script`` in a private mount namespace; the JSON object it printed."""
    import json

    out = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", script,
                          str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_holders_by_cwd_file_and_program_and_the_callers_own(tmp_path):
    got = _in_namespace(SCRIPT, tmp_path)
    cwd, fileholder, program = got["pids"]
    t = str(tmp_path)
    assert got["others"] == {str(cwd): f"cwd {t}/own", str(fileholder): f"file {t}/own/f",
                             str(program): f"program {t}/own/sleep-above"}
    assert str(got["before"]) not in got["others"]  # runs the box's own file below the overlay: no hold
    assert got["callers"] == [got["me"]]
    assert len(got["refusal"].splitlines()) == 1 and "--lazy" in got["refusal"]


WRITERS = textwrap.dedent('''
    import json, os, subprocess, sys, time
    from ogrefs.box import holders, mountsys
    t = sys.argv[1]
    for d in ("low", "up", "wk", "var/log"):
        os.makedirs(f"{t}/{d}", exist_ok=True)
    # journald's journal: opened for writing on this box's own disk before the overlay went up
    journal = subprocess.Popen(["sh", "-c", f"exec 3>>{t}/var/log/system.journal; exec sleep 30"])
    time.sleep(0.2)
    mountsys.overlay(f"{t}/var", f"lowerdir={t}/low:{t}/var,upperdir={t}/up,workdir={t}/wk")
    through = subprocess.Popen(["sh", "-c", f"exec 3>{t}/var/log/app.log; exec sleep 30"])  # through the overlay
    reader = subprocess.Popen(["sh", "-c", f"exec 3<{t}/var/log/system.journal; exec sleep 30"])
    for _ in range(50):  # until sh reached its exec with the file open (no timing in the assertion)
        found = holders.writers([f"{t}/var"])
        if found:
            break
        time.sleep(0.1)
    print(json.dumps({"writers": found, "through": through.pid, "journal": journal.pid}))
    for p in (journal, through, reader):
        p.kill()
''')


def test_a_writer_is_judged_by_the_mount_its_file_is_on_not_by_its_path(tmp_path):
    """finalize's check (issue 47): journald writing the journal on this box's own /var is no writer."""
    got = _in_namespace(WRITERS, tmp_path)
    assert got["writers"] == [f"{got['through']} sleep: {tmp_path}/var/log/app.log"]
