"""Run the ogrefs command with pack reads held until a file exists: a store that delivers nothing until told.

``python -m tests.heldpacks GATE ogrefs-args...``: every pack read of this
process and of the daemons it forks waits until the file GATE exists (at
most :data:`HOLD_S`), so a test can look at a no-FUSE mount's tree before
anything of the snapshot's but its directories has arrived, then let it come.
With ``OGREFS_TEST_READS_FREE=N`` in the environment the first N reads of each
process go through unheld (the working set's, where a test knows how many that is).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from ogrefs.cli.entry import main
from ogrefs.repo import Repository

#: The longest a read is held (a test that never opens the gate fails on its own timeout, not here).
HOLD_S = 120.0

_read = Repository.read_pack_range
_free = [int(os.environ.get("OGREFS_TEST_READS_FREE", "0"))]
_free_lock = threading.Lock()


def _held(self, *args, **kwargs):
    with _free_lock:
        free = _free[0] > 0
        _free[0] -= free
    if free:
        return _read(self, *args, **kwargs)
    deadline = time.monotonic() + HOLD_S
    while not os.path.exists(GATE) and time.monotonic() < deadline:
        time.sleep(0.02)
    return _read(self, *args, **kwargs)


if __name__ == "__main__":
    GATE = sys.argv.pop(1)
    Repository.read_pack_range = _held
    main(sys.argv[1:])
