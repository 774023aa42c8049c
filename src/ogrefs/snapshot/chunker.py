"""Split a file into content-defined chunks, skipping holes.

Chunks never span a hole: the data extents found with SEEK_DATA/SEEK_HOLE are
chunked one by one, so a sparse 5 GiB file with 1 MiB of data costs 1 MiB of
reads and the holes are restored as holes.  Large extents are streamed through
a bounded window; memory stays O(window + max chunk) whatever the file size.
"""

from __future__ import annotations

import errno
import os
from typing import Iterator

import pyfastcdc

from ogrefs.repo.config import ChunkerParams

WINDOW = 16 * 1024 * 1024


def data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """(start, end) of the regions holding data; the whole file if holes cannot be asked for."""
    if size == 0:
        return []
    extents = []
    pos = 0
    try:
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # no data after pos: a trailing hole
                    break
                raise
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            if end > start:
                extents.append((start, end))
            pos = end
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            return [(0, size)]
        raise
    return extents


class Chunker:
    """FastCDC over file extents.  Not thread-safe: one per thread."""

    def __init__(self, params: ChunkerParams) -> None:
        # pyfastcdc's effective average is avg_size + min_size (cut-point skipping),
        # so ask for avg - min to land on the configured average.
        self._cdc = pyfastcdc.FastCDC(
            max(256, params.avg_size - params.min_size), min_size=params.min_size, max_size=params.max_size
        )
        self.max_size = params.max_size
        self.min_size = params.min_size

    def chunks(self, fd: int, extents: list[tuple[int, int]]) -> Iterator[tuple[int, bytes]]:
        """Yield (file offset, bytes) for every chunk of the given extents, in order."""
        for start, end in extents:
            if end - start <= self.min_size:
                # Below the minimum chunk size there is nothing to cut: one read, no copies.
                data = os.pread(fd, end - start, start)
                if data:
                    yield start, data
                continue
            if end - start <= WINDOW:
                data = os.pread(fd, end - start, start)
                view = memoryview(data)
                for c in self._cdc.cut_buf(data):
                    yield start + c.offset, bytes(view[c.offset:c.offset + c.length])
                continue
            pos = start
            carry = b""
            carry_off = start
            while pos < end or carry:
                want = min(WINDOW, end - pos)
                data = os.pread(fd, want, pos) if want > 0 else b""
                if want > 0 and len(data) == 0:
                    end = pos  # file shrank under us; the caller's stat check notices
                pos += len(data)
                buf = carry + data if carry else data
                base = carry_off
                at_end = pos >= end
                if not buf:
                    break
                pieces = list(self._cdc.cut_buf(buf))
                if not at_end and len(pieces) > 1:
                    last = pieces[-1]
                    for c in pieces[:-1]:
                        yield base + c.offset, bytes(c.data)
                    carry = buf[last.offset:]
                    carry_off = base + last.offset
                elif not at_end:
                    carry = buf
                    carry_off = base
                    if len(carry) > self.max_size * 4:  # cannot happen with FastCDC, but never grow unbounded
                        yield base, bytes(buf)
                        carry = b""
                        carry_off = pos
                else:
                    for c in pieces:
                        yield base + c.offset, bytes(c.data)
                    carry = b""
                    break
