"""The mount registry and `status --wait` on real registration files (unit tier: nothing is mounted)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from ogrefs.mount.status import wait_background
from ogrefs.boxmounts import MountError, Registration


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    monkeypatch.setenv("OGREFS_RUNTIME_DIR", str(tmp_path / "run"))
    return tmp_path


def _register(target: Path, status: dict, **info) -> Registration:
    reg = Registration.for_mountpoint(target)
    reg.write({"pid": os.getpid(), "mountpoint": str(target), "writable": True, **info})
    reg.status.write_text(json.dumps({"pid": os.getpid(), "mountpoint": str(target), **status}))
    return reg


def test_status_wait_gives_up_on_a_daemon_that_stopped_answering(runtime):
    running = {"mode": "materialize", "state": "running", "complete": False}
    _register(Path("/m"), {"time": time.time() - 120, "materialize": running})
    with pytest.raises(MountError, match="has not answered for"):
        wait_background(Path("/m"), poll=0)


def test_status_wait_has_a_timeout(runtime):
    running = {"mode": "materialize", "state": "running", "complete": False}
    reg = _register(Path("/m"), {"time": time.time(), "materialize": running})
    seen = []

    def keep_fresh(st):  # the daemon rewrites its status: only the timeout can end this wait
        seen.append(st)
        reg.status.write_text(json.dumps({"pid": os.getpid(), "time": time.time(), "materialize": running}))

    with pytest.raises(MountError, match="not fully local after"):
        wait_background(Path("/m"), poll=0.01, timeout=0.2, progress=keep_fresh)
    assert len(seen) > 1


def test_status_wait_fails_when_materialization_was_refused(runtime):
    refused = {"mode": "cache", "state": "done", "complete": False,
               "reason": "not materializing: needs 3.0 GiB, 1.0 GiB free in /s"}
    _register(Path("/m"), {"time": time.time(), "materialize": refused})
    st, problem = wait_background(Path("/m"), poll=0)
    assert problem == "/m will not become fully local: not materializing: needs 3.0 GiB, 1.0 GiB free in /s"
