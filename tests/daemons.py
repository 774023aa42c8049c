"""Teardown for tests that start mount daemons: kill whatever a failed test left running."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path


def kill_registered_daemons(runtime_dir: Path) -> None:
    """SIGKILL every daemon registered under ``runtime_dir/mounts`` (a passing test has none left)."""
    mounts = runtime_dir / "mounts"
    for reg in mounts.glob("*.json") if mounts.exists() else []:
        try:
            pid = json.loads(reg.read_text()).get("pid")
            if pid:
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, AttributeError):
            pass
