"""What a snapshot owns besides packs moves with ``tag`` and goes with ``forget`` (tier 3: repositories on disk)."""

from __future__ import annotations

import pytest

from ogrefs.maint.remove import carry_traces, remove_snapshot
from ogrefs.repo import Repository
from ogrefs.repo.keys import Secret
from ogrefs.repo.traces import newest_trace, store_trace, trace_prefix

OLD, NEW = "a" * 64, "b" * 64


@pytest.mark.expect_log(r"not carrying access trace", logger="ogrefs.maint")
@pytest.mark.parametrize("encrypted", [False, True])
def test_traces_are_carried_resealed_under_the_new_id_and_removed_with_the_snapshot(tmp_path, encrypted, caplog):
    repo = Repository.init(str(tmp_path / "r"), cache_root=tmp_path / "c",
                           secret=Secret(b"pw", "scrypt") if encrypted else None)
    first = store_trace(repo, OLD, [(b"/a", 0)])
    second = store_trace(repo, OLD, [(b"/b", 4096), (b"/a", 0)])
    broken = trace_prefix(OLD) + "00000000T000000.000000Z-00000000"  # sorts first; not a trace
    repo.store.put(broken, b"not a trace")
    assert carry_traces(repo, OLD, NEW) == 2
    assert f"not carrying access trace {broken}" in caplog.text  # skipped, never in silence
    assert sorted(repo.store.list(trace_prefix(NEW))) == sorted(
        k.replace(OLD, NEW) for k in (first, second))  # the same names: the same order of age
    key, entries = newest_trace(repo, NEW)  # readable under its new key (an encrypted object is bound to it)
    assert key == second.replace(OLD, NEW) and entries == [(b"/b", 4096), (b"/a", 0)]
    remove_snapshot(repo, OLD)
    assert list(repo.store.list(trace_prefix(OLD))) == [] and newest_trace(repo, NEW) is not None
