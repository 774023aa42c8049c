"""The tree build's child process: its entry point (``python -m``), the side of :mod:`.buildproc` that runs in it.

It reads its spec (the plan and catalog paths, the tree's root, the parent's
pid, the log level) as JSON on stdin, asks to die with its parent, drops to
the scheduler's idle priority, builds (:func:`.build.build`), and writes one
JSON line on stdout (:func:`.buildproc.build_in_child` reads it).  It has its
own module so that the parent's side and :mod:`.build` import each other in
one direction only: the parent starts this module, this module runs the build.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sqlite3
import sys
from pathlib import Path

from ogrefs.errors import CorruptObject, OgrefsError
from ogrefs.lazy.background.materialize.build import build
from ogrefs.lazy.background.materialize.buildproc import set_policy
from ogrefs.box.copyplan import Plan
from ogrefs.lazy.background.materialize.writer import TreeWriter
from ogrefs.localtree import LocalTree
from ogrefs.repo.catalog import Catalog

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _idle_priority() -> None:
    """SCHED_IDLE, else the lowest nice value: a core only when nothing else wants it."""
    if not set_policy(0, os.SCHED_IDLE):
        log.info("tree build: SCHED_IDLE refused; running at nice 19 instead")
        os.setpriority(os.PRIO_PROCESS, 0, 19)


def _die_with_parent(parent: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        log.warning("tree build: cannot ask to die with the daemon; it stops on its own when the daemon is gone")
    if os.getppid() != parent:  # the daemon died before the prctl
        os._exit(1)


def main() -> int:
    """The child: build the tree and the plan described on stdin; one JSON line on stdout."""
    spec = json.loads(sys.stdin.read())
    logging.basicConfig(level=spec.get("level", logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _die_with_parent(spec["parent"])
    _idle_priority()
    result: dict
    try:
        tree_root = os.fsencode(spec["tree"])
        plan = Plan(Path(spec["plan"]))
        writer = TreeWriter(Catalog(Path(spec["catalog"])), LocalTree(tree_root, create=True), plan)
        build(writer, tree_root)
        result = {"ok": True}
    except OSError as exc:
        result = {"error": exc.strerror or str(exc), "errno": exc.errno or 0}
    except CorruptObject as exc:
        result = {"corrupt": str(exc)}
    except (sqlite3.Error, OgrefsError) as exc:
        result = {"error": str(exc)}
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0 if result.get("ok") else 2


if __name__ == "__main__":
    sys.exit(main())
