"""A live mount's status, as ``ogrefs status`` (and ``finalize``) read it: the file the daemon rewrites.

The daemon rewrites ``mounts/<key>.status.json`` (box.records.Registration)
atomically every :data:`STATUS_INTERVAL` seconds; :func:`read_status` joins
it with the registration (what the keeper did, the daemon's pid) and its
age, and :func:`wait_background` polls it until the background copy is
complete or cannot complete. Runs in the calling thread; only files.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from ogrefs.box.records import MountError, Registration, pid_alive
from ogrefs.errors import UsageError

#: How often the daemon rewrites its status file.
STATUS_INTERVAL = 0.5
#: A status file older than this means the daemon stopped answering (it is rewritten every STATUS_INTERVAL).
STALE_AFTER = 30.0
#: What the keeper of a writable mount adds to its registration (keeper.bring_up).
KEEPER_KEYS = ("overlays", "binds", "host_kept", "ldconfig", "own_directories", "keeper_pid", "top_files",
               "rescue", "command_around", "refused", "exact", "not_exact")
#: Background states after which nothing more will be copied.
_ENDED = {"done", "stopped", "incomplete", "not materializing", "off"}


def exact_line(info: dict[str, Any]) -> str:
    """One line for ``mount`` and ``status``: the directories shown exactly (box/exact.py), or ""."""
    dirs = info.get("exact") or []
    more = f" and {len(dirs) - 8} more" if len(dirs) > 8 else ""
    return f"exact: {', '.join(dirs[:8])}{more} (this box's entries hidden; --merge to show them)" if dirs else ""


class StatusNotReady(MountError):
    """The mount's daemon has not written its status file yet (or another daemon's is there): ask again."""


def read_status(mountpoint: Path) -> dict[str, Any]:
    """The mount's last status, with its age and what its keeper did; raises when there is none to read."""
    mp = Path(os.path.abspath(mountpoint))
    reg = Registration.for_mountpoint(mp)
    info = reg.read()
    if info is None:
        raise UsageError(f"{mp} is not an ogrefs mount")
    if info.get("in_place") and not pid_alive(info.get("pid") or 0):  # no-FUSE: its daemon has ended
        gone = {"state": "stopped", "complete": False,
                "reason": f"its daemon is gone (killed?); the same `ogrefs mount` resumes the copy to {mp}"}
        return {**info, "time": time.time(), "age": 0.0, "materialize": info.get("materialize") or gone}
    if info.get("finalized"):
        return {**info, "age": 0.0, "materialize": {"complete": True}}
    if not pid_alive(info.get("pid", 0)):
        raise MountError(f"the daemon of {mp} (pid {info.get('pid')}) is gone; run `ogrefs unmount {mp}`")
    try:
        status = json.loads(reg.status.read_text())
    except (OSError, ValueError):
        raise StatusNotReady(f"the status of {mp} is not readable yet; try again") from None
    if status.get("pid", info.get("pid")) != info.get("pid"):  # an earlier mount's daemon, still exiting, wrote it
        raise StatusNotReady(f"the status of {mp} is not its daemon's (pid {info.get('pid')}) yet but pid "
                             f"{status.get('pid')}'s, an earlier mount's daemon that has not exited; try again")
    status["age"] = max(0.0, time.time() - status.get("time", time.time()))
    for key in KEEPER_KEYS:  # what the keeper did (writable mounts): the registration has it
        if key in info:
            status[key] = info[key]
    return status


def wait_background(mountpoint: Path, *, poll: float = 0.2, timeout: float | None = None,
                    stale_after: float = STALE_AFTER,
                    progress: Callable[[dict[str, Any]], None] | None = None) -> tuple[dict[str, Any], str | None]:
    """Wait until the mount's background copy is complete; (last status, why it cannot complete or None).

    Materializing mounts end "done" (everything local); a mount that only warms
    its cache (read-only, ``--no-materialize``) ends when its prefetch is done.
    A mount that was to materialize but was refused (no room) and fell back to
    warming the cache did not complete: its reason is returned. A daemon that
    goes away, or stops rewriting its status for ``stale_after`` seconds (it
    rewrites it every 0.5 s), raises MountError, and so does ``timeout``.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    not_ready_since = None
    while True:
        try:
            st = read_status(mountpoint)
        except StatusNotReady:  # a moment after the mount, or an earlier mount's daemon wrote last: its next write
            not_ready_since = not_ready_since or time.monotonic()
            if time.monotonic() - not_ready_since > stale_after or (deadline is not None
                                                                    and time.monotonic() > deadline):
                raise
            time.sleep(poll)
            continue
        not_ready_since = None
        m = st.get("materialize") or {}
        if progress is not None:
            progress(st)
        if m.get("complete"):
            return st, None
        state = m.get("state")
        where = st.get("mountpoint", mountpoint)
        if m.get("mode") == "cache" and state == "done":
            return st, (f"{where} will not become fully local: {m['reason']}" if m.get("reason") else None)
        if state in _ENDED:
            return st, f"{where} will not become fully local: " + (m.get("reason") or state)
        if st.get("age", 0.0) > stale_after:
            raise MountError(f"the daemon of {where} (pid {st.get('pid')}) has not answered for "
                             f"{st['age']:.0f} s (stopped or hung?); see its log {st.get('log')}")
        if deadline is not None and time.monotonic() > deadline:
            raise MountError(f"{where} is not fully local after {timeout:.0f} s (still {state})")
        time.sleep(poll)
