"""A benchmark killed with SIGTERM tears its shaped store down (scripts/netlab.py), tier 1: no namespace needed."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_unwinds_the_with_block_and_the_old_handler_comes_back(tmp_path):
    marker = tmp_path / "torn-down"
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(ROOT / "scripts")!r})
        from netlab import ExitOnSignals
        before = signal.getsignal(signal.SIGTERM)
        with ExitOnSignals():
            pass
        assert signal.getsignal(signal.SIGTERM) is before
        try:
            with ExitOnSignals():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)  # never reached: the signal raises SystemExit
        finally:
            open({str(marker)!r}, "w").write("done")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert res.returncode == 128 + signal.SIGTERM, res.stderr
    assert marker.read_text() == "done"
