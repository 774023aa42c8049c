"""Open-time push: a small file whose bytes the daemon holds in memory goes into the kernel's page cache
before its open is answered, so the program's read of it never reaches the mount.

A resume opens ~1,700 small files (an import's ``.pyc`` files, a tokenizer,
configs) and reads each whole right after opening it.  With a trace replayed
(or hints, or a directory's neighbours fetched together) their chunks are
usually in the daemon's memory by then, and each READ is still a round trip:
the program blocks, the daemon wakes, the loop answers, the program wakes on
whichever core is free.  On a two-core box those round trips, not the link,
were what a trace run's step waited for (docs/benchmarks.md, "Small files
pushed at their open").  Pushing the file at its open costs a copy into the
page cache inside a round trip the program makes anyway, and takes one away.

Only files of at most ``OPEN_PUSH_MAX`` whose every chunk is in memory
(:func:`whole_in_memory`) are pushed, whole: a small file opened is a small
file read, so recording its chunks at the open (the vfs does, when an access
trace is being recorded) is what its read would have recorded.  A large
file's reads come as usual: pushing what memory holds of it would make the
open wait for bytes the program may never read, and a recording could not
tell which of them it read (measured: pushing large files too gave back the
gain, docs/benchmarks.md).  Each file is pushed once while the kernel holds
its pages: the vfs's set of such inodes (a read answered, or a push), which
it empties of an inode the kernel forgets, is shared with the directory
pusher (:mod:`ogrefs.lazy.fs.pagepush`).

Where the store runs.  The kernel locks a page while a READ for it is on its
way to the daemon, and a store into that page waits for the lock: on the
loop, which alone answers the READ, that would never end.  A READ comes
only through an open handle of the file (an mmap holds one too, and the
kernel releases a handle only once its requests are answered), so when the
file being opened has no other handle open in the vfs, no READ of it can be
queued or in flight, and the store runs inline on the loop (``inline``): a
copy into the page cache, like the answer to the READ it replaces.  In a
worker thread (measured: one thread hop per open, waiting for the GIL behind
the fetch threads' decoding, made a hints-only run slower than no push at
all, docs/benchmarks.md) it runs only when another handle is open; the open
then waits for it at most ``wait_s`` and a push that takes longer finishes
in the background (the open's answer goes out, and the pyfuse3 worker tasks
can never all end up waiting on pushes that wait on READs).  A push that
fails (the kernel forgot the inode) only costs the read it would have saved.

Who owns what: an OpenPush belongs to the trio loop, like the vfs that calls
it (which counts the open handles per inode and owns the set of inodes whose
pages the kernel holds: OpenPush adds the files it pushes and takes back
those whose push failed); its nursery is the loop's.  A push's worker thread
gets the inode number, an immutable ``bytes`` and the adapter's thread-safe
store function, and returns nothing but an exception.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import trio

from ogrefs.repo.catalog import Extent

log = logging.getLogger(__name__)

#: Files up to this size are pushed at their open when memory holds all of their chunks.
OPEN_PUSH_MAX = 1024 * 1024
#: How long an open waits for its push before it is answered anyway (the push goes on).
OPEN_PUSH_WAIT_S = 1.0


def whole_in_memory(size: int, extents: Sequence[Extent],
                    in_memory: Callable[[bytes], bytes | None]) -> bytes | None:
    """The file's whole content from memory (holes as zeros), or None if any chunk is not in memory.

    ``extents`` in file order; ``in_memory`` answers a chunk's verified
    plaintext or None.  A chunk whose length is not
    its extent's, or extents that overlap or run past ``size``, give None: the
    reads then come as usual and meet the same checks as every read.
    """
    parts: list[bytes] = []
    pos = 0
    for ext in extents:
        if ext.offset < pos or ext.end > size:
            return None
        data = in_memory(ext.chunk)
        if data is None or len(data) != ext.length:
            return None
        if ext.offset > pos:
            parts.append(bytes(ext.offset - pos))
        parts.append(data)
        pos = ext.end
    if pos < size:
        parts.append(bytes(size - pos))
    return parts[0] if len(parts) == 1 else b"".join(parts)


class OpenPush:
    """Pushes small in-memory files at their open; see the module docstring."""

    def __init__(self, page_cache: Callable[[int, bytes], None], kernel_pages: set[int], *,
                 wait_s: float = OPEN_PUSH_WAIT_S) -> None:
        # the adapter's: puts a file's whole content into the kernel's page cache (see the module docstring)
        self.page_cache = page_cache
        self.wait_s = wait_s
        # the vfs's: inodes whose pages the kernel holds (a read answered, a push) until it forgets them
        self.kernel_pages = kernel_pages
        self._nursery: trio.Nursery | None = None
        self.pushed = 0  # files pushed
        self.pushed_bytes = 0
        self.failed = 0  # pushes the kernel refused (it forgot the inode) or that raised
        self.late = 0  # opens answered before their push was done (wait_s)

    def wanted(self, ino: int, size: int) -> bool:
        """Whether an open of ``ino`` (``size`` bytes) should try a push: small, and not already the kernel's."""
        return self._nursery is not None and 0 < size <= OPEN_PUSH_MAX and ino not in self.kernel_pages

    def stats(self) -> dict[str, int]:
        return {"files": self.pushed, "bytes": self.pushed_bytes, "late": self.late, "failed": self.failed}

    async def run(self) -> None:
        """Hold the nursery pushes run in, until cancelled (a task in the mount's nursery)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await trio.sleep_forever()
        finally:
            self._nursery = None

    async def push(self, ino: int, data: bytes, *, inline: bool = False) -> bool:
        """Put ``data`` (all of ``ino``) into the kernel's page cache; True once it is there.

        ``inline``: on the loop, for a file no other handle has open (the
        caller knows; see the module docstring).  Otherwise in a worker thread,
        waited for at most ``wait_s``; after that the push goes on in the
        background and False is returned, as when it fails.
        """
        nursery = self._nursery
        if nursery is None:
            return False
        self.kernel_pages.add(ino)  # (a second open meanwhile does not push it again)
        if inline:
            try:
                self.page_cache(ino, data)
            except Exception as exc:  # noqa: BLE001 - as in _store
                self._failed(ino, exc)
                return False
            self._done(data)
            return True
        done = trio.Event()
        outcome: list[bool] = []
        nursery.start_soon(self._store, ino, data, done, outcome)
        with trio.move_on_after(self.wait_s):
            await done.wait()
        if not done.is_set():
            self.late += 1
            return False
        return outcome == [True]

    async def _store(self, ino: int, data: bytes, done: trio.Event, outcome: list[bool]) -> None:
        try:
            await trio.to_thread.run_sync(self.page_cache, ino, data)
        except Exception as exc:  # noqa: BLE001 - a push only saves a round trip; the read comes as usual
            self._failed(ino, exc)
            outcome.append(False)
        else:
            self._done(data)
            outcome.append(True)
        finally:
            done.set()

    def _done(self, data: bytes) -> None:
        self.pushed += 1
        self.pushed_bytes += len(data)

    def _failed(self, ino: int, exc: Exception) -> None:
        self.failed += 1
        self.kernel_pages.discard(ino)
        log.debug("open-time push of inode %d failed: %s", ino, exc)
