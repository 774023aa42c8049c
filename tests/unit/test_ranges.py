"""Ranged reads: restore's rule (restore.plan_ranges) and the no-FUSE stream's cut of one range at a time
(inplace/stream.py) are one rule, restore.first_range."""

from __future__ import annotations

import random

import pytest

from ogrefs.inplace.stream import _cut
from ogrefs.restore import MAX_GAP, MAX_RANGE, Blob, plan_ranges

MiB = 1024 * 1024


def _blobs(seed: int, n: int = 300) -> list[Blob]:
    rnd = random.Random(seed)
    out, offset = [], 0
    for i in range(n):
        offset += rnd.choice((0, 0, 4096, MiB // 2, MAX_GAP, MAX_GAP + 1, 3 * MiB))  # gaps around the bridge limit
        size = rnd.choice((100, 64 * 1024, MiB, 2 * MiB, MAX_RANGE + 5))  # one over a range's bound now and then
        out.append(Blob(offset, size, size, i.to_bytes(4, "big"), ((1, 0),)))
        offset += size
    return out


@pytest.mark.parametrize("seed", range(5))
def test_plan_ranges_keeps_every_blob_once_bridges_small_gaps_only_and_bounds_each_range(seed):
    blobs = _blobs(seed)
    ranges = plan_ranges({"p": list(reversed(blobs))})  # (sorted by the rule itself)
    assert [b for r in ranges for b in r.blobs] == blobs
    for r in ranges:
        assert r.offset == r.blobs[0].pack_offset
        assert r.offset + r.length == max(b.pack_offset + b.stored_len for b in r.blobs)
        assert len(r.blobs) == 1 or r.length <= MAX_RANGE
        for a, b in zip(r.blobs, r.blobs[1:]):
            assert b.pack_offset - (a.pack_offset + a.stored_len) <= MAX_GAP
    for r, nxt in zip(ranges, ranges[1:]):  # each range ends where the next blob would break the rule
        b = nxt.blobs[0]
        assert b.pack_offset - (r.offset + r.length) > MAX_GAP or b.pack_offset + b.stored_len - r.offset > MAX_RANGE
    assert len(ranges) > 10, "the blobs made too few ranges to test the rule"


@pytest.mark.parametrize("seed", range(5))
def test_the_stream_cuts_the_same_ranges_one_at_a_time(seed):
    blobs = _blobs(seed)
    pending, cut = set(blobs), []
    while pending:
        taken, rng = _cut("p", pending)
        assert list(taken) == list(rng.blobs)
        pending -= set(taken)
        cut.append(rng)
    assert cut == plan_ranges({"p": list(blobs)})
