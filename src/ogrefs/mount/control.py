"""The control socket of a no-FUSE mount's daemon: what ``ogrefs run``'s supervisor asks while the copy runs.

Both sides live here: the daemon's server (:class:`ControlServer`) and the calls a client makes (:func:`ask`,
:func:`pending`, :func:`since`), which ``ogrefs run``'s supervisor (``mount/pending.py``) uses to hold a job's
system call until its file exists.

The protocol, one request a line, answered in order on the same connection (a Unix stream socket at
``<runtime>/mounts/<key>.sock``, owner-only, named ``control`` in the registration)::

    need <percent-encoded absolute path>\\n      ->  ok | absent | host | failed <reason> | error <reason>
    needall <percent-encoded absolute path>\\n   ->  (the same)
    pending\\n                                   ->  (f|o <percent-encoded path>\\n)* end <seq> copying|complete
    since <seq>\\n                               ->  (d <percent-encoded path>\\n)* end <seq> copying|complete

* ``ok``: the entry is in place as the snapshot has it (a regular file complete, verified and renamed to
  its name with its metadata; a directory: made, and with ``needall`` every entry directly in it too;
  symlinks of the snapshot on the way followed, and in place too);
* ``absent``: the snapshot has no such path (nothing will come: the job's ENOENT is the truth);
* ``host``: this box keeps the path (host-owned, a mount point): what is there is what there will be;
* ``failed <reason>``: it could not be written (a full disk, a bad chunk): the job's call should fail (EIO);
* ``error <reason>``: the request was malformed.
* ``pending``: every name not in place yet (``f`` a regular file, ``o`` anything else: a symlink of the
  snapshot is followed by the reader), and the position ``seq`` of the daemon's log of settled entries at
  that same instant; ``since <seq>``: the names put in place after that position (``d``), and the new
  position.  ``complete`` once every entry is in place.  Names only ever leave the pending set, so a reader
  that loads ``pending`` and applies each ``since`` holds a superset of what is still to come
  (docs/mount.md, "ogrefs run without FUSE").

:func:`ask` is what a caller uses: it finds the socket in the mount's registration and answers for a daemon
that has ended too (a finished copy: ``ok``).  The answer comes only once it is true, however long that takes: a caller bounds its own wait
(:func:`need`'s ``timeout``).  Paths are percent-encoded (``urllib.parse.quote_from_bytes``) so any
byte but NUL can be asked for; a path is absolute in the box's namespace.

Who owns what: the server's accept thread starts one thread per connection; each asks the engine
(``InPlace.need``, ``pending``, ``since``: thread-safe) and waits on the answer's event; nothing else is shared.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
import urllib.parse
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Protocol, TypeVar

from ogrefs.box.records import Registration, pid_alive

log = logging.getLogger(__name__)

#: The longest request line accepted (a path of PATH_MAX bytes, every one percent-encoded).
MAX_LINE = 3 * 4096 + 16
#: Longest AF_UNIX path; a longer one is reached through its directory's descriptor.
_SUN_PATH_MAX = 100
#: How long a refused connection is tried again while the daemon's pid still lives (ending, or starting).
_DYING_S = 2.0


class NeedFailed(OSError):
    """The daemon could not be asked (no daemon, refused), or did not answer within the caller's timeout."""


def _address(path: Path) -> tuple[str, int | None]:
    """A name for ``path`` short enough for AF_UNIX (through ``/proc/self/fd`` when it is long), and the fd to close."""
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        return str(path), None
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{fd}/{path.name}", fd


def encode_request(path: bytes, whole: bool = False) -> bytes:
    return (b"needall " if whole else b"need ") + _quote(path) + b"\n"


def _quote(path: bytes) -> bytes:
    return urllib.parse.quote_from_bytes(path, safe="/").encode()


def _exchange(sock_path: Path, request: bytes, timeout: float | None, last: Callable[[bytes], bool]) -> list[bytes]:
    """Send ``request`` to the daemon at ``sock_path``; the answer's lines up to the one ``last`` says ends it."""
    name, fd = _address(sock_path)
    lines: list[bytes] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(timeout)
            s.connect(name)
            s.sendall(request)
            reader = s.makefile("rb")
            while not lines or not last(lines[-1]):
                line = reader.readline(MAX_LINE)
                if not line.endswith(b"\n"):
                    # (ECONNRESET: a daemon that ends, complete, with a request in flight; the caller looks again)
                    raise NeedFailed(errno.ECONNRESET,
                                     f"the daemon at {sock_path} closed the connection without an answer")
                lines.append(line[:-1])
    except OSError as exc:
        if isinstance(exc, NeedFailed):
            raise
        raise NeedFailed(exc.errno or 0, f"the daemon at {sock_path} did not answer: {exc}") from None
    finally:
        if fd is not None:
            os.close(fd)
    return lines


def need(sock_path: Path, path: bytes, timeout: float | None = None, whole: bool = False) -> str:
    """Ask the daemon at ``sock_path`` for ``path`` and wait for its answer line (``ok``, ``absent``, ``host``,
    ``failed <reason>``); :class:`NeedFailed` when there is no daemon or no answer within ``timeout`` seconds."""
    return _exchange(sock_path, encode_request(path, whole), timeout, lambda _line: True)[0].decode(errors="replace")


@dataclass(frozen=True)
class Updates:
    """An answer to ``pending`` or ``since``: names (with whether each is a regular file), the log position
    after them, and whether every entry is in place."""

    names: list[tuple[bytes, bool]]
    seq: int
    complete: bool


def _updates(lines: list[bytes], kinds: bytes) -> Updates:
    *entries, end = lines
    verb, seq, state = (end.split(b" ") + [b"", b""])[:3]
    if verb != b"end" or not seq.isdigit():
        raise NeedFailed(0, f"the daemon answered {end[:80]!r}")
    names = []
    for line in entries:
        if line[:1] not in kinds or line[1:2] != b" ":
            raise NeedFailed(0, f"the daemon answered {line[:80]!r}")
        names.append((urllib.parse.unquote_to_bytes(line[2:]), line[:1] != b"o"))
    return Updates(names, int(seq), state == b"complete")


def pending(mountpoint: Path, timeout: float | None = None) -> Updates:
    """What the no-FUSE mount at ``mountpoint`` has not put in place yet (a finished copy: nothing)."""
    return _at_daemon(mountpoint, Updates([], 0, True), lambda sock: _updates(
        _exchange(sock, b"pending\n", timeout, _is_end), b"fo"))


def since(mountpoint: Path, seq: int, timeout: float | None = None) -> Updates:
    """The names the no-FUSE mount at ``mountpoint`` put in place after log position ``seq``."""
    return _at_daemon(mountpoint, Updates([], seq, True), lambda sock: _updates(
        _exchange(sock, b"since %d\n" % seq, timeout, _is_end), b"d"))


def _is_end(line: bytes) -> bool:
    return line.startswith(b"end") or line.startswith(b"error ")


def ask(mountpoint: Path, path: bytes, timeout: float | None = None, whole: bool = False) -> str:
    """The supervisor's call: :func:`need` of the no-FUSE mount at ``mountpoint``, also once its daemon has ended.

    A finished copy has no daemon: its registration says ``finalized`` and every path is as it will be
    (``ok``).  A copy whose daemon is gone before the end answers ``failed`` (the same ``ogrefs mount``
    resumes it); no registration is :class:`NeedFailed`.
    """
    try:
        return _at_daemon(mountpoint, "ok", lambda sock: need(sock, path, timeout, whole))
    except Stopped as exc:
        return f"failed {exc.strerror}"


class Stopped(NeedFailed):
    """The copy's daemon is gone before the end."""


T = TypeVar("T")


def _at_daemon(mountpoint: Path, finished: T, call: Callable[[Path], T]) -> T:
    """``call`` with the control socket of the no-FUSE mount at ``mountpoint``; ``finished`` once it is complete;
    :class:`Stopped` when its daemon is gone before the end, :class:`NeedFailed` when there is no such mount."""
    reg = Registration.for_mountpoint(mountpoint)
    # The daemon may end between the registration's read and the connection, and a killed one refuses
    # connections before its pid reads as gone (its threads exit one by one): refused, look again, a while.
    deadline = time.monotonic() + _DYING_S
    while True:
        info = reg.read()
        if not info or not info.get("in_place"):
            raise NeedFailed(0, f"{mountpoint} is not a no-FUSE ogrefs mount")
        if info.get("finalized"):
            return finished
        if not info.get("pid") or not pid_alive(info["pid"]):
            raise Stopped(0, f"the copy to {mountpoint} stopped before the end; the same `ogrefs mount` resumes it")
        try:
            return call(Path(info["control"]))
        except NeedFailed as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ECONNRESET):
                raise
        if time.monotonic() > deadline:
            raise NeedFailed(0, f"the daemon of {mountpoint} did not answer")
        time.sleep(0.02)


class Engine(Protocol):
    """What the server asks (``InPlace``): each call thread-safe."""

    def need(self, path: bytes, whole: bool = True) -> Any: ...  # with ``event`` (set once answered), ``answer``

    def pending(self) -> tuple[list[tuple[bytes, bool]], int, bool]: ...

    def since(self, seq: int) -> tuple[list[bytes], int, bool]: ...


class ControlServer:
    """Listens at ``sock_path`` and answers requests through ``engine`` (see the module docstring)."""

    def __init__(self, sock_path: Path, engine: Engine, stop: threading.Event) -> None:
        self.sock_path = sock_path
        self.engine = engine
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
                    conn.sendall(self._answer(line))

    def _answer(self, line: bytes) -> bytes:
        verb, _, arg = line.rstrip(b"\n").partition(b" ")
        try:
            if verb == b"pending" and not arg:
                names, seq, complete = self.engine.pending()
                return _listing([(b"f " if reg else b"o ") + _quote(n) for n, reg in names], seq, complete)
            if verb == b"since" and arg.isdigit():
                done, seq, complete = self.engine.since(int(arg))
                return _listing([b"d " + _quote(n) for n in done], seq, complete)
        except Exception as exc:  # noqa: BLE001 - one request's trouble is its answer, never the server's end
            log.exception("%r", line[:80])
            return f"error {exc}\n".encode()
        return self._need(verb, arg).encode() + b"\n"

    def _need(self, verb: bytes, arg: bytes) -> str:
        if verb not in (b"need", b"needall") or not arg:
            return "error expected `need|needall <percent-encoded absolute path>`, `pending` or `since <seq>`"
        path = urllib.parse.unquote_to_bytes(arg)
        if not path.startswith(b"/") or b"\0" in path:
            return "error the path must be absolute"
        try:
            waiter = self.engine.need(path, verb == b"needall")
        except Exception as exc:  # noqa: BLE001 - one request's trouble is its answer, never the server's end
            log.exception("need %r", path)
            return f"failed {exc}"
        while not waiter.event.wait(0.5):  # type: ignore[attr-defined]
            if self.stop.is_set():
                return "failed the daemon is stopping"
        return str(waiter.answer)  # type: ignore[attr-defined]


def _listing(lines: list[bytes], seq: int, complete: bool) -> bytes:
    return b"".join(line + b"\n" for line in lines) + b"end %d %s\n" % (seq, b"complete" if complete else b"copying")
