"""The ``ogrefs`` command never depends on what it serves (box/owncli.py, contrib/ogrefs-command; issue 47).

In a private mount namespace: the way around is prepared from this test's
interpreter (its base Python, the venv, this checkout's ``src``), then every
one of those directories is covered by an empty tmpfs, as a snapshot of
another Python covers them after ``ogrefs mount SNAP /``. The installed
command must still run this box's ogrefs; with the way removed it runs what
the paths show now (and fails). And the rescue's bind of ``/usr`` must stay
this box's on a box whose ``/`` is shared (systemd's default), where an
overlay mounted on ``/usr`` would otherwise propagate onto it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ogrefs.box import owncli

pytestmark = [pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                 reason="needs root and unshare (bind mounts)")]

REPO = Path(__file__).resolve().parents[2]

COVERED = textwrap.dedent('''
    import json, os, subprocess, sys
    from pathlib import Path
    from ogrefs.box import mountsys, owncli
    t = Path(sys.argv[1])
    rt = owncli.current()
    tops = sorted({"/" + p.strip("/").split("/")[0] + "/" + p.strip("/").split("/")[1]
                   for p in (rt.executable, *rt.paths) if p.count("/") >= 2 and not p.startswith("/usr/")})
    way = owncli.prepare(t / "run/rescue/k", tops, rt)
    assert way == str(t / "run/rescue/k/ogrefs.sh"), way
    for top in tops:  # the snapshot's view: none of what this interpreter runs from is there
        mountsys.mount("tmpfs", top, "tmpfs")
    assert not os.path.exists(rt.executable) and not os.path.exists(owncli.__file__)
    env = {"PATH": "/usr/bin:/bin", "OGREFS_RUNTIME_DIR": str(t / "run"), "OGREFS_STATE_DIR": str(t / "state")}
    cmd = ["/bin/sh", str(t / "ogrefs"), "mounts", "--json"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    print(json.dumps([res.returncode, res.stdout, res.stderr]))
    owncli.remove(t / "run/rescue/k")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    print(json.dumps([res.returncode, res.stdout, res.stderr, os.listdir(t / "run/rescue/k")]))
''')


def _launcher(tmp_path: Path) -> None:
    text = (REPO / "contrib/ogrefs-command").read_text().replace("@OGREFS@", str(tmp_path / "covered/ogrefs"))
    (tmp_path / "ogrefs").write_text(text)


def test_the_command_runs_this_box_ogrefs_when_its_interpreter_and_venv_are_covered(tmp_path):
    import json

    _launcher(tmp_path)
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", COVERED,
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    around, without = (json.loads(line) for line in out.stdout.splitlines())
    assert around[0] == 0, around[2]
    assert json.loads(around[1]) == []  # this box's ogrefs answered: no mount registered here
    assert "Traceback" not in around[2]
    assert without[0] == 127 and without[3] == []  # no way around any more: the covered path, and nothing left


def test_the_script_runs_the_interpreter_through_its_own_loader_from_the_bind():
    rt = owncli.Runtime("/usr/bin/python3.11", "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
                        ("/usr/lib/x86_64-linux-gnu",), ("/usr/lib/python3.11", "/opt/o'grefs/src"))
    text = owncli.script(rt, "/run/ogrefs/rescue/k/root")
    assert "exec 9</run/ogrefs/rescue/k/root\n" in text
    command = text[text.index("    exec /proc"):text.index(' "$@"')]
    args = shlex.split(command)[1:]
    assert args[:6] == ["/proc/self/fd/9/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", "--inhibit-cache",
                        "--library-path", "/proc/self/fd/9/usr/lib/x86_64-linux-gnu",
                        "/proc/self/fd/9/usr/bin/python3.11", "-I"]
    assert "\"/opt/o'grefs/src\"" in args[-1] and "from ogrefs.cli.entry import main" in args[-1]


def test_nothing_is_prepared_when_no_overlay_covers_the_command(tmp_path):
    assert owncli.prepare(tmp_path / "k", ["/nonexistent-target"]) is None
    assert not (tmp_path / "k").exists()


SHARED = textwrap.dedent('''
    import os, subprocess, sys
    from pathlib import Path
    from ogrefs.box import mountsys, rescue
    t = Path(sys.argv[1])
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["mount", "--make-rshared", "/"], check=True)  # as systemd leaves every box
    r = rescue.prepare(t / "rescue/k")
    assert r is not None
    mountsys.mount("tmpfs", "/usr", "tmpfs")  # what the /usr overlay does
    print(sorted(os.listdir("/usr")) == [], os.path.exists(r.umount), os.path.exists(r.loader))
''')


def test_the_rescue_bind_of_usr_stays_this_box_when_root_is_shared(tmp_path):
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", SHARED,
                          str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True"]
