"""The control socket of a no-FUSE mount's daemon: ``need PATH`` brings a path to the front and answers when it
is in place.  Both sides live here: the daemon's server (:class:`ControlServer`) and the one call a client
makes (:func:`need`), which ``ogrefs run``'s supervisor uses to hold a job's system call until the file exists.

The protocol, one request a line, answered in order on the same connection (a Unix stream socket at
``<runtime>/mounts/<key>.sock``, owner-only, named ``control`` in the registration)::

    need <percent-encoded absolute path>\\n   ->   ok\\n | absent\\n | host\\n | failed <reason>\\n | error <reason>\\n

* ``ok``: the entry is in place as the snapshot has it (a regular file complete, verified and renamed to
  its name with its metadata; a directory: every entry directly in it; symlinks of the snapshot on the way
  followed, and in place too);
* ``absent``: the snapshot has no such path (nothing will come: the job's ENOENT is the truth);
* ``host``: this box keeps the path (host-owned, a mount point): what is there is what there will be;
* ``failed <reason>``: it could not be written (a full disk, a bad chunk): the job's call should fail (EIO);
* ``error <reason>``: the request was malformed.

:func:`ask` is what a caller uses: it finds the socket in the mount's registration and answers for a daemon
that has ended too (a finished copy: ``ok``).  The answer comes only once it is true, however long that takes: a caller bounds its own wait
(:func:`need`'s ``timeout``).  Paths are percent-encoded (``urllib.parse.quote_from_bytes``) so any
byte but NUL can be asked for; a path is absolute in the box's namespace.

Who owns what: the server's accept thread starts one thread per connection; each asks the engine
(``InPlace.need``, thread-safe) and waits on the answer's event; nothing else is shared.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import urllib.parse
from pathlib import Path
from typing import Callable

from ogrefs.box.records import Registration, pid_alive

log = logging.getLogger(__name__)

#: The longest request line accepted (a path of PATH_MAX bytes, every one percent-encoded).
MAX_LINE = 3 * 4096 + 16
#: Longest AF_UNIX path; a longer one is reached through its directory's descriptor.
_SUN_PATH_MAX = 100


class NeedFailed(OSError):
    """The daemon could not be asked (no daemon, refused), or did not answer within the caller's timeout."""


def _address(path: Path) -> tuple[str, int | None]:
    """A name for ``path`` short enough for AF_UNIX (through ``/proc/self/fd`` when it is long), and the fd to close."""
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        return str(path), None
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{fd}/{path.name}", fd


def encode_request(path: bytes) -> bytes:
    return b"need " + urllib.parse.quote_from_bytes(path, safe="/").encode() + b"\n"


def need(sock_path: Path, path: bytes, timeout: float | None = None) -> str:
    """Ask the daemon at ``sock_path`` for ``path`` and wait for its answer line (``ok``, ``absent``, ``host``,
    ``failed <reason>``); :class:`NeedFailed` when there is no daemon or no answer within ``timeout`` seconds."""
    name, fd = _address(sock_path)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(timeout)
            s.connect(name)
            s.sendall(encode_request(path))
            answer = s.makefile("rb").readline(MAX_LINE)
    except OSError as exc:
        raise NeedFailed(exc.errno or 0, f"the daemon at {sock_path} did not answer: {exc}") from None
    finally:
        if fd is not None:
            os.close(fd)
    if not answer.endswith(b"\n"):
        raise NeedFailed(0, f"the daemon at {sock_path} closed the connection without an answer")
    return answer[:-1].decode(errors="replace")


def ask(mountpoint: Path, path: bytes, timeout: float | None = None) -> str:
    """The supervisor's call: :func:`need` of the no-FUSE mount at ``mountpoint``, also once its daemon has ended.

    A finished copy has no daemon: its registration says ``finalized`` and every path is as it will be
    (``ok``).  A copy whose daemon is gone before the end answers ``failed`` (the same ``ogrefs mount``
    resumes it); no registration is :class:`NeedFailed`.
    """
    reg = Registration.for_mountpoint(mountpoint)
    for _attempt in range(2):  # the daemon may end between the registration's read and the connection
        info = reg.read()
        if not info or not info.get("in_place"):
            raise NeedFailed(0, f"{mountpoint} is not a no-FUSE ogrefs mount")
        if info.get("finalized"):
            return "ok"
        if not info.get("pid") or not pid_alive(info["pid"]):
            return f"failed the copy to {mountpoint} stopped before the end; the same `ogrefs mount` resumes it"
        try:
            return need(Path(info["control"]), path, timeout)
        except NeedFailed as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ECONNRESET):
                raise
    raise NeedFailed(0, f"the daemon of {mountpoint} did not answer")


#: What the server asks for each path: an object with ``event`` (set when answered) and ``answer``.
Asker = Callable[[bytes], object]


class ControlServer:
    """Listens at ``sock_path`` and answers ``need`` requests through ``ask`` (see the module docstring)."""

    def __init__(self, sock_path: Path, ask: Asker, stop: threading.Event) -> None:
        self.sock_path = sock_path
        self.ask = ask
        self.stop = stop
        with contextlib.suppress(FileNotFoundError):
            sock_path.unlink()
        name, fd = _address(sock_path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            old = os.umask(0o177)
            try:
                self.sock.bind(name)
            finally:
                os.umask(old)
            self.sock.listen(64)
            self.sock.settimeout(0.5)
        finally:
            if fd is not None:
                os.close(fd)

    def start(self) -> None:
        threading.Thread(target=self._accept, name="ogrefs-control", daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        with contextlib.suppress(OSError):
            self.sock_path.unlink()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _addr = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="ogrefs-control-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(None)
            reader = conn.makefile("rb")
            while not self.stop.is_set():
                line = reader.readline(MAX_LINE)
                if not line:
                    return
                with contextlib.suppress(OSError):
                    conn.sendall(self._answer(line).encode() + b"\n")

    def _answer(self, line: bytes) -> str:
        verb, _, arg = line.rstrip(b"\n").partition(b" ")
        if verb != b"need" or not arg:
            return "error expected `need <percent-encoded absolute path>`"
        path = urllib.parse.unquote_to_bytes(arg)
        if not path.startswith(b"/") or b"\0" in path:
            return "error the path must be absolute"
        try:
            waiter = self.ask(path)
        except Exception as exc:  # noqa: BLE001 - one request's trouble is its answer, never the server's end
            log.exception("need %r", path)
            return f"failed {exc}"
        while not waiter.event.wait(0.5):  # type: ignore[attr-defined]
            if self.stop.is_set():
                return "failed the daemon is stopping"
        return str(waiter.answer)  # type: ignore[attr-defined]
