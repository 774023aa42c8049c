"""The entry point raises its soft open-files limit to the hard one (systemd starts units at 1024; issue 47)."""

from __future__ import annotations

import resource
import subprocess
import sys

HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
WANT = min(HARD, 1 << 20) if HARD != resource.RLIM_INFINITY else 1 << 20


def _run(code: str, soft: int) -> str:
    def limit() -> None:  # as systemd starts a unit: a low soft limit below the hard one
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, HARD))

    return subprocess.run([sys.executable, "-c", code], preexec_fn=limit, capture_output=True, text=True,
                          timeout=60).stdout.strip()


def test_a_unit_s_1024_is_raised_to_the_hard_limit():
    code = ("import resource\nfrom ogrefs.cli.entry import raise_open_files_limit\n"
            "print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    assert _run(code, 1024) == f"{WANT} {WANT}"
    assert _run(code, WANT) == f"{WANT} {WANT}"  # already there: kept


def test_the_ogrefs_entry_point_runs_with_the_raised_limit():
    """The real entry point (``ogrefs --version``): what it and every process it forks (the daemon) run with."""
    code = ("import atexit, resource\n"
            "atexit.register(lambda: print(resource.getrlimit(resource.RLIMIT_NOFILE)[0]))\n"
            "from ogrefs.cli.entry import main\nmain(['--version'])")
    assert _run(code, 1024).splitlines()[-1] == str(WANT)


def test_a_restore_keeps_open_a_quarter_of_what_the_limit_leaves(tmp_path):
    """``fds_to_keep`` counts the descriptors the process holds already: with 300 held and 400 left under the
    limit, a quarter of the 400 (a quarter of the whole 700 would leave the restore short by 75)."""
    code = ("import os, resource\nfrom ogrefs.restore import fds_to_keep\n"
            "held = [os.open('/dev/null', os.O_RDONLY) for _ in range(300)]\n"
            "n = len(os.listdir('/proc/self/fd')) - 1\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (n + 400, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
            "print(fds_to_keep())")
    assert _run(code, 4096) == "100"
