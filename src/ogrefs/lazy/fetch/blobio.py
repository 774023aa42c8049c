"""Fetch I/O: what the fetcher's worker threads do, and the one place a fetch failure gets its name.

The :class:`~ogrefs.lazy.fetch.fetcher.Fetcher` decides *what* to fetch on the trio
loop; this module does the blocking part in worker threads and has no trio
import: ranged reads of packs through the store (:class:`PackReads`), a
streamed range cut into blobs (:func:`stream_blobs`, :class:`BlobReader`), one
blob read on its own (:func:`read_blob`), disk-cache probes and loads
(:func:`cached`, :func:`load_cached`), and
:func:`classify`, the single mapping from whatever a store, a decoder or a
forged catalog location raised to a :class:`FetchError` subclass.  Its
catch-all turns an exception nobody expected into a logged
:class:`FetchError`: the reader of that chunk gets EIO, the fetcher's nursery
(and with it the mount) lives on.

Retries are not made here: a store call that fails transiently is retried by
the store's :class:`~ogrefs.store.retry.RetryingStore`, within the budget the
caller gave :class:`PackReads` (``--retry-for``), and a stream that breaks
part way is resumed there too.  What reaches :func:`classify` is final for
this read; the next read tries again (failures are not remembered).

Who owns what: nothing here is shared.  Each function gets immutable inputs
(a pack name, a range, a tuple of blob locations) and the callables it
needs, and hands results to its caller (``deliver`` runs the caller's code on
the trio loop); a :class:`BlobReader` belongs to the one thread that reads
its range.  :class:`PackReads` holds only a store view and is thread-safe as
the store is.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable

from ogrefs.errors import CorruptObject, OgrefsError
from ogrefs.repo.chunkref import ChunkRef
from ogrefs.repo.pack import pack_key
from ogrefs.store.base import NotFound, PermissionDenied, RangeReader, ShortRead, Store, StoreError, TransientError
from ogrefs.store.retry import RetryingStore

if TYPE_CHECKING:
    from ogrefs.lazy.fetch.chunkcache import ChunkCache

log = logging.getLogger(__name__)

#: (pack, offset, length) -> the bytes of that range of the pack
ReadRange = Callable[[str, int, int], bytes]
#: (pack, offset, length) -> a stream of the range (``PackReads.open_range``)
OpenRange = Callable[[str, int, int], RangeReader]
#: (blob, raw length, chunk id) -> verified plaintext; raises CorruptObject.  ``Repository.codec.decode_blob``
#: for an encrypted repository.
DecodeBlob = Callable[[memoryview, int, bytes], bytes]
#: One decoded blob for the trio loop: (index in the request, its plaintext or why it failed verification);
#: index -1 carries the byte count of a gap read across and dropped.
Delivery = list[tuple[int, "bytes | CorruptObject | int"]]

#: A streaming GET hands decoded chunks to the trio loop once this many bytes are ready (or at its end).
DELIVER_BYTES = 256 * 1024
#: ... and reads its body at least this much at a time (small blobs are cut from the piece).
READ_PIECE = 256 * 1024


class FetchError(OgrefsError):
    """A chunk could not be delivered; its reader gets EIO, never wrong bytes."""

    def __init__(self, ref: ChunkRef, reason: str) -> None:
        super().__init__(f"chunk {ref.chunk.hex()[:16]} (pack {ref.pack[:16]} at {ref.offset}): {reason}")
        self.ref = ref
        self.reason = reason


class ChunkCorrupt(FetchError):
    """The bytes in the store do not decode to the chunk the catalog names."""


class ChunkMissing(FetchError):
    """The store no longer has the pack that holds the chunk."""


class StoreUnavailable(FetchError):
    """The store kept failing (unreachable, refusing) for longer than the caller's retry budget."""


def classify(exc: BaseException, ref: ChunkRef) -> FetchError:
    """The one answer to "why did fetching ``ref`` fail?": a FetchError for its readers (EIO).

    Retrying is over when this is asked (the store's RetryingStore spent the
    caller's budget), so a transient failure is :class:`StoreUnavailable`
    now.  A location no store accepts (a forged pack name, a negative offset:
    ValueError from key validation) is :class:`ChunkCorrupt` for its chunks
    only.  Anything else is a bug or a backend's surprise: logged with its
    traceback, and still only this read's failure.
    """
    if isinstance(exc, FetchError):
        return exc
    if isinstance(exc, NotFound):
        return ChunkMissing(ref, f"pack {ref.pack} is missing from the repository")
    if isinstance(exc, ShortRead):
        return ChunkCorrupt(ref, f"pack {ref.pack} is shorter than the catalog says ({exc})")
    if isinstance(exc, CorruptObject):
        return ChunkCorrupt(ref, str(exc))
    if isinstance(exc, PermissionDenied):
        return StoreUnavailable(ref, f"permission denied: {exc}")
    if isinstance(exc, (TransientError, ConnectionError, TimeoutError)):
        return StoreUnavailable(ref, f"store unreachable ({exc})")
    if isinstance(exc, StoreError):
        return StoreUnavailable(ref, str(exc))
    if isinstance(exc, ValueError):
        return ChunkCorrupt(ref, f"the catalog's location is invalid: {exc}")
    log.error("fetch of chunk %s from pack %s failed unexpectedly", ref.chunk.hex()[:16], ref.pack[:16],
              exc_info=exc)
    return FetchError(ref, f"unexpected {type(exc).__name__}: {exc}")


class PackReads:
    """Ranged reads of a repository's packs for one caller, with that caller's retry budget.

    ``retry_for``: seconds each store call may retry an outage (None: the
    store's few attempts); ``stop``: set when the caller stops (an unmount),
    which ends a retry wait at once.  Both go to the store's RetryingStore
    (:meth:`~ogrefs.store.retry.RetryingStore.budget`); a store without one
    does not retry.  :attr:`retries` counts the retries made for this caller.
    """

    def __init__(self, store: Store, retry_for: float | None = None, stop: threading.Event | None = None) -> None:
        self._store = store.budget(retry_for, stop) if isinstance(store, RetryingStore) else store

    def read_range(self, pack: str, offset: int, length: int) -> bytes:
        return self._store.get_range(pack_key(pack), offset, length)

    def open_range(self, pack: str, offset: int, length: int) -> RangeReader:
        return self._store.open_range(pack_key(pack), offset, length)

    @property
    def retries(self) -> int:
        return self._store.retries if isinstance(self._store, RetryingStore) else 0


class BlobReader:
    """Exact-size reads from a range, in pieces of at least ``READ_PIECE`` bytes.

    A pack range of small files holds thousands of blobs of a few KiB; one
    call into the HTTP stack per blob costs more CPU than the bytes do.
    Owned by the one worker thread that reads the range.
    """

    def __init__(self, body: RangeReader) -> None:
        self._body = body
        self._buf = b""
        self._pos = 0

    def read_exact(self, n: int) -> bytes:
        have = len(self._buf) - self._pos
        if n <= have:
            out = self._buf[self._pos:self._pos + n]
            self._pos += n
            return out
        parts = [self._buf[self._pos:]] if have else []
        need = n - have
        self._buf, self._pos = b"", 0
        while need > 0:
            piece = self._body.read(max(need, READ_PIECE))
            if not piece:
                raise ShortRead(f"the store's answer ended {need} bytes early")
            if len(piece) > need:  # keep the rest for the next blobs
                parts.append(piece[:need])
                self._buf, self._pos = piece, need
                need = 0
            else:
                parts.append(piece)
                need -= len(piece)
        return parts[0] if len(parts) == 1 else b"".join(parts)


def stream_blobs(open_range: OpenRange, decode: DecodeBlob, pack: str, start: int, length: int,
                 blobs: tuple[tuple[int, int, int, int, bytes], ...], deliver: Callable[[Delivery], None]) -> None:
    """Worker thread: read one range, decode and verify each blob, hand results to ``deliver``.

    ``blobs``: (index, offset in the range, stored length, raw length, chunk
    id), in range order.  ``deliver`` (the caller's: it runs the result on
    the trio loop) gets batches of about ``DELIVER_BYTES``, and whatever was
    decoded is delivered before an error propagates.
    """
    batch: Delivery = []
    batch_bytes = 0
    try:
        with open_range(pack, start, length) as body:
            reader = BlobReader(body)
            pos = 0
            for i, off, slen, rlen, cid in blobs:
                if off > pos:
                    reader.read_exact(off - pos)  # blobs in a gap nobody asked for (max_gap)
                    batch.append((-1, off - pos))
                raw = reader.read_exact(slen)
                pos = off + slen
                try:
                    result: bytes | CorruptObject = decode(memoryview(raw), rlen, cid)
                except CorruptObject as exc:
                    result = exc
                batch.append((i, result))
                batch_bytes += slen
                if batch_bytes >= DELIVER_BYTES:
                    deliver(batch)
                    batch, batch_bytes = [], 0
    finally:
        if batch:
            deliver(batch)


def read_blob(read_range: ReadRange, ref: ChunkRef) -> bytes:
    """Worker thread: the stored bytes of one blob, exactly ``stored_len`` of them (ShortRead otherwise)."""
    body = read_range(ref.pack, ref.offset, ref.stored_len)
    if len(body) != ref.stored_len:
        raise ShortRead(f"store returned {len(body)} bytes, expected {ref.stored_len}")
    return body


def cached(cache: "ChunkCache", chunks: list[bytes]) -> list[bool]:
    """Worker thread: which of ``chunks`` have a file in the disk cache (one stat each)."""
    return [cache.contains(c) for c in chunks]


def load_cached(cache: "ChunkCache", keys: list[tuple[bytes, int]]) -> list[bytes | None]:
    """Worker thread: the cached chunks (chunk id, plaintext length) read and verified; None where gone or bad."""
    return [cache.load(chunk, raw_len) for chunk, raw_len in keys]
