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
