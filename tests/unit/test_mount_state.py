"""The mount registry and `status --wait` on real registration files (unit tier: nothing is mounted)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from ogrefs.mount.status import StatusNotReady, read_status, wait_background
from ogrefs.box.records import MountError, Registration


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


def test_a_status_an_earlier_mounts_daemon_wrote_is_not_shown_and_the_wait_takes_the_new_daemons(runtime):
    """A daemon that outlived its unmount (another namespace held its FUSE mount) rewrote the status of the
    new mount at the same mountpoint: `ogrefs status` named the old daemon's pid (seen by bench_fastlink)."""
    done = {"mode": "materialize", "state": "done", "complete": True}
    reg = _register(Path("/m"), {"time": time.time(), "materialize": done})
    reg.status.write_text(json.dumps({"pid": 1, "time": time.time(), "materialize": done}))  # the old daemon's
    with pytest.raises(StatusNotReady, match=f"not its daemon's \\(pid {os.getpid()}\\) yet but pid 1's"):
        read_status(Path("/m"))
    shown = []  # (progress: called with each status read; none while the old daemon's is there)

    def write_later():
        time.sleep(0.2)
        reg.status.write_text(json.dumps({"pid": os.getpid(), "time": time.time(), "materialize": done}))

    writer = threading.Thread(target=write_later)
    writer.start()
    try:
        st, problem = wait_background(Path("/m"), poll=0.01, progress=shown.append)
    finally:
        writer.join()
    assert st["pid"] == os.getpid() and problem is None
    assert shown == [st]


def test_a_wait_on_a_status_that_never_becomes_the_daemons_gives_up(runtime):
    done = {"mode": "materialize", "state": "done", "complete": True}
    reg = _register(Path("/m"), {"time": time.time(), "materialize": done})
    reg.status.write_text(json.dumps({"pid": 1, "time": time.time(), "materialize": done}))
    with pytest.raises(StatusNotReady):
        wait_background(Path("/m"), poll=0.01, stale_after=0.1)


def test_a_daemon_writes_the_status_only_while_the_mountpoint_is_registered_to_it(runtime):
    reg = _register(Path("/m"), {"time": 1.0})
    assert reg.write_status({"pid": os.getpid(), "time": 2.0})
    assert json.loads(reg.status.read_text())["time"] == 2.0
    assert not reg.write_status({"pid": os.getpid() + 1, "time": 3.0})  # a new mount registered meanwhile
    assert json.loads(reg.status.read_text())["time"] == 2.0
    reg.path.unlink()  # no registration (unmounted, its daemon lingering): nothing to take it from
    assert reg.write_status({"pid": os.getpid() + 1, "time": 4.0})


class _Reg:
    """A registration whose reads are observed: lock_state_dir reads it only while the lock is busy."""

    def __init__(self, info: dict | None, on_read=None) -> None:
        self.info, self.on_read, self.reads = info, on_read, 0

    def read(self) -> dict | None:
        self.reads += 1
        if self.on_read is not None:
            self.on_read(self.reads)
        return self.info


def _hold(state: Path) -> int:
    import fcntl

    fd = os.open(state / "mount.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another open file description: conflicts within this process too
    return fd


def test_a_state_lock_whose_mount_left_no_registration_is_waited_for(tmp_path):
    """A lazily unmounted daemon removes its registration before its process and keeper are gone:
    the remount right after must wait for the lock, not refuse (the lab's remount failed so)."""
    import threading

    from ogrefs.mount.plan import lock_state_dir

    holder = _hold(tmp_path)
    busy_seen = threading.Event()
    reg = _Reg(None, on_read=lambda n: busy_seen.set())
    result: list = []
    t = threading.Thread(target=lambda: result.append(_call(lock_state_dir, tmp_path, reg)), daemon=True)
    t.start()
    assert busy_seen.wait(30), "lock_state_dir never found the lock busy"
    os.close(holder)  # the old mount's last process goes
    t.join(30)
    assert not t.is_alive()
    assert isinstance(result[0], int), result[0]
    os.close(result[0])


def test_a_state_lock_of_a_live_mount_is_refused_at_once(tmp_path):
    from ogrefs.errors import UsageError
    from ogrefs.mount.plan import lock_state_dir

    def polled_again(n: int) -> None:
        if n > 1:
            raise AssertionError("waited for a live mount's lock instead of refusing")

    holder = _hold(tmp_path)
    try:
        reg = _Reg({"state_dir": str(tmp_path), "pid": os.getpid()}, on_read=polled_again)
        with pytest.raises(UsageError, match="in use by a live mount"):
            lock_state_dir(tmp_path, reg, wait_s=3600)
        detached = _Reg({"state_dir": str(tmp_path), "pid": os.getpid(), "detached": True},
                        on_read=lambda n: n > 3 and os.close(holder))
        fd = lock_state_dir(tmp_path, detached, wait_s=3600)  # a detached daemon's lock: waited for
        os.close(fd)
        assert detached.reads > 3
    finally:
        with contextlib.suppress(OSError):
            os.close(holder)


def _call(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test reads what it got
        return exc


@pytest.mark.expect_log(r"detaching the overlays without the keeper failed \(exit status 1\)",
                        level=logging.ERROR, logger="ogrefs.mount.daemon")
def test_a_failed_detach_without_the_keeper_is_logged_not_swallowed(tmp_path, monkeypatch):
    """The daemon detaches the box from a forked child when its keeper is gone; the child leaves with
    os._exit, so its failure must reach the daemon's log (its exit status), not vanish."""
    from ogrefs.mount import daemon, keeper
    from ogrefs.box import mountsys

    def broken(state_dir, reg):
        raise RuntimeError("an overlay that would not detach")

    monkeypatch.setattr(mountsys, "enter_namespace", lambda ns: None)
    monkeypatch.setattr(keeper, "teardown", broken)
    started = time.monotonic()
    daemon.teardown_in_box(0, tmp_path / "state", None, timeout=30)  # (the registration goes to the mock)
    assert time.monotonic() - started < 25  # it returned when the child exited, not at the deadline
