"""Opening a file that a local user may replace while a snapshot reads it.

The snapshot runs as root and reads a few files of the tree it walks
(checkpoint headers and pointers, ``.git`` files, a venv's ``pyvenv.cfg``,
package METADATA, cache markers). Between the walk seeing a regular file and
the read, a user can swap a FIFO in: a plain ``open()`` then waits for a
writer for ever, and the snapshot with it; a device node could be opened with
its side effects. So every such open goes through :func:`open_regular`:
``O_NONBLOCK`` (a FIFO opens at once), ``O_NOCTTY``, ``O_NOFOLLOW`` unless
the caller follows on purpose (system files such as ``/etc/os-release``, a
symlink by design), and the descriptor must be a regular file (``fstat``),
else OSError. No state.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import IO, Any


def open_regular(path: str | bytes, mode: str = "rb", *, follow: bool = False, **text: Any) -> IO[Any]:
    """``path`` open for reading (``mode`` "rb" or "r", ``text``: encoding/errors) if it is a regular file.

    Never blocks in the open (a FIFO, a device); a symlink at ``path`` is
    not followed unless ``follow``; anything but a regular file raises
    OSError (EINVAL), closed again.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fsdecode(path))
        return os.fdopen(fd, mode, **text)
    except BaseException:
        os.close(fd)
        raise
