"""What a forked mount process does first: leave the caller's terminal and log to the mount's log.

Shared by the FUSE mount's processes (launch.py) and the no-FUSE daemon (inplace.py), which must not
import the FUSE side (a container without pyfuse3 still gets its no-FUSE mount). No state.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Callable

from ogrefs.box.records import Registration

log = logging.getLogger(__name__)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True)


def detach_stdio(reg: Registration) -> None:
    """Leave the caller's terminal: stdin from /dev/null, stdout and stderr to the mount's log."""
    os.chdir("/")
    devnull = os.open(os.devnull, os.O_RDWR)
    logfd = os.open(reg.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(devnull, 0)
    os.dup2(logfd, 1)
    os.dup2(logfd, 2)
    os.close(devnull)
    os.close(logfd)


def serve_detached(reg: Registration, level: str, ready_fd: int, serve: Callable[[], int], what: str) -> int:
    """Leave the terminal, log to the mount's log, and run ``serve``; a failure is logged with its traceback and
    said on the mount command's pipe (``error <reason>``) rather than dying silently."""
    detach_stdio(reg)
    configure_logging(level)
    try:
        return serve()
    except BaseException as exc:  # noqa: BLE001 - the daemon must report, not crash silently
        log.exception("%s failed", what)
        with contextlib.suppress(OSError):
            os.write(ready_fd, f"error {exc}\n".encode())
        return 1
