"""A copy's process gives the GIL shorter turns (restore.COPY_SWITCH_INTERVAL): ``ogrefs restore`` and the no-FUSE
mount's daemon, whose threads let the GIL go for every file system call and then wait for it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from ogrefs import restore
from tests.cli_run import env, run  # noqa: F401 - env is a fixture

#: Runs the real entry point with the copy's start reporting the switch interval into $SWITCH_FILE (a daemon's
#: output goes to its log: a file says it from any process).
PROBE = textwrap.dedent("""\
    import os, sys
    from ogrefs import restore
    from ogrefs.inplace.engine import InPlace

    def report(run):
        def wrapped(self, *a, **kw):
            with open(os.environ["SWITCH_FILE"], "a") as fh:
                fh.write(f"{sys.getswitchinterval()}\\n")
            return run(self, *a, **kw)
        return wrapped

    restore.Restorer.run = report(restore.Restorer.run)
    InPlace.run = report(InPlace.run)
    from ogrefs.cli.entry import main
    main(sys.argv[1:])
    """)


def test_short_gil_turns_lowers_the_interval_and_never_raises_it():
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        restore.short_gil_turns()
        assert sys.getswitchinterval() == restore.COPY_SWITCH_INTERVAL < 0.005
        sys.setswitchinterval(restore.COPY_SWITCH_INTERVAL / 5)
        shorter = sys.getswitchinterval()
        restore.short_gil_turns()
        restore.short_gil_turns()
        assert sys.getswitchinterval() == shorter < restore.COPY_SWITCH_INTERVAL
    finally:
        sys.setswitchinterval(before)


def test_restore_and_the_no_fuse_daemon_copy_with_short_turns(tmp_path, env):  # noqa: F811
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(os.urandom(5000))
    run(["init"], env)
    run(["-q", "snapshot", str(src)], env)
    env = dict(env, SWITCH_FILE=str(tmp_path / "switch"), OGREFS_RUNTIME_DIR=str(tmp_path / "run"),
               OGREFS_STATE_DIR=str(tmp_path / "state"))

    def probe(*args: str) -> None:
        proc = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr

    probe("-q", "restore", "latest", str(tmp_path / "restored"))
    (tmp_path / "written").mkdir()
    probe("-q", "mount", "latest", str(tmp_path / "written"), "--no-fuse")
    probe("-q", "status", str(tmp_path / "written"), "--wait", "--timeout", "60")
    seen = [float(x) for x in (tmp_path / "switch").read_text().split()]
    assert seen == [restore.COPY_SWITCH_INTERVAL] * 2  # the restore's, then the daemon's copy
    assert (tmp_path / "restored" / str(src).lstrip("/") / "f").read_bytes() == (src / "f").read_bytes()
    assert (tmp_path / "written" / str(src).lstrip("/") / "f").read_bytes() == (src / "f").read_bytes()
