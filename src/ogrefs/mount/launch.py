"""The processes a mount runs as, entered right after client.py forks.

A read-only mount is one process, the daemon (daemon.py). A writable mount
is two (keeper.py's docstring draws them): the keeper, which stays in the
box's mount namespace, forks the daemon and then keeps the box; the daemon
serves from a namespace of its own. Each entry point reports failure on
the pipe it was given (``error <reason>``) rather than dying silently, and
a forked child leaves with ``os._exit`` so nothing of the caller's state
(atexit handlers, buffered output) runs twice.

Everything a child needs is imported by the time client.py forks (this
module imports the daemon, the lazy engine and pyfuse3 at the top): once
the overlays are up, an import could resolve through them.
"""

from __future__ import annotations

import contextlib
import logging
import os

from ogrefs.mount import keeper
from ogrefs.mount.detach import configure_logging, detach_stdio, serve_detached
from ogrefs.mount.daemon import Daemon, KeeperLink
from ogrefs.mount.plan import MountPlan

log = logging.getLogger(__name__)


def serve_here(plan: MountPlan) -> int:
    """A read-only mount in the foreground: this process is the daemon."""
    configure_logging(plan.opts.log_level)
    return Daemon(plan, None).run()


def daemon_child(plan: MountPlan, ready_fd: int) -> int:
    """The detached child of a background mount: the keeper (writable) or the daemon itself (read-only)."""
    if plan.writable:
        return run_keeper(plan, ready_fd)
    return serve_detached(plan.registration, plan.opts.log_level, ready_fd, lambda: Daemon(plan, ready_fd).run(),
                          "mount daemon")


def run_keeper(plan: MountPlan, ready_fd: int | None) -> int:
    """A writable mount: fork the daemon, then keep the box (keeper.py); ``ready_fd`` None: foreground."""
    if ready_fd is not None:
        detach_stdio(plan.registration)
    configure_logging(plan.opts.log_level)
    to_keeper_r, to_keeper_w = os.pipe()
    to_daemon_r, to_daemon_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(to_keeper_r)
            os.close(to_daemon_w)
            if ready_fd is not None:
                os.close(ready_fd)
            code = Daemon(plan, None, KeeperLink(to_keeper=to_keeper_w, from_keeper=to_daemon_r)).run()
        except BaseException:  # noqa: BLE001 - the daemon must report, not crash silently
            log.exception("mount daemon failed")
            with contextlib.suppress(OSError):
                os.write(to_keeper_w, b"error the mount daemon failed (see its log)\n")
        finally:
            os._exit(code)
    os.close(to_keeper_w)
    os.close(to_daemon_r)
    return keeper.keep(plan, pid, to_keeper_r, to_daemon_w, ready_fd)
