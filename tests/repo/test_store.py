"""Store layer: one conformance suite over every backend, then the wrappers and
backend-specific failure mapping.

The conformance tests take the ``store`` fixture (memory, file, s3) and use
the raw backend (``retry=False``) so that a backend bug cannot hide behind a
retry.
"""

from __future__ import annotations

import errno
import os
import random
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import botocore.exceptions as bx
import pytest

from ogrefs.store import (FaultyStore, FileStore, MemoryStore, NotFound, PermissionDenied, RetryingStore,
                          ShortRead, Store, StoreError, TransientError, open_store, validate_key,
                          validate_prefix)
from ogrefs.store.s3 import S3Store, _translate, parse_s3_url

MiB = 1 << 20


def blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.fixture(params=["memory", "file", pytest.param("s3", marks=pytest.mark.s3)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "memory":
        s = open_store(f"memory://conformance-{secrets.token_hex(6)}", retry=False)
    elif request.param == "file":
        s = open_store(f"file://{tmp_path}/store", retry=False)
    else:
        seaweed = request.getfixturevalue("seaweed")
        seaweed.ensure_running()
        bucket = seaweed.new_bucket()
        s = open_store(f"s3://{bucket}/some/prefix", s3_endpoint=seaweed.endpoint, retry=False)
    yield s
    s.close()
    if request.param == "s3":
        seaweed.delete_bucket(bucket)


# ---------------------------------------------------------------------------
# conformance: every backend behaves the same
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 40 * MiB], ids=["empty", "1B", "40MiB"])
def test_put_get_roundtrip(store: Store, size: int) -> None:
    data = blob(size, seed=size)
    store.put("packs/ab/roundtrip", data)
    got = store.get("packs/ab/roundtrip")
    assert len(got) == size
    assert got == data
    assert store.exists("packs/ab/roundtrip")


def test_put_accepts_bytes_like(store: Store) -> None:
    store.put("ba", bytearray(b"abc"))
    store.put("mv", memoryview(b"xyzw")[1:3])
    assert store.get("ba") == b"abc"
    assert store.get("mv") == b"yz"


def test_overwrite(store: Store) -> None:
    store.put("config", b"first version, longer")
    store.put("config", b"second")
    assert store.get("config") == b"second"
    assert sorted(store.list()) == ["config"]


def test_get_range(store: Store) -> None:
    data = blob(1000, seed=7)
    store.put("packs/00/p", data)
    for offset, length in [(0, 10), (0, 1), (500, 17), (990, 10), (999, 1), (0, 1000)]:
        got = store.get_range("packs/00/p", offset, length)
        assert got == data[offset:offset + length], (offset, length)
        assert len(got) == length
    assert store.get_range("packs/00/p", 0, 0) == b""
    assert store.get_range("packs/00/p", 1000, 0) == b""


@pytest.mark.parametrize("offset,length", [(995, 10), (1000, 1), (2000, 5), (0, 1001)])
def test_get_range_past_end_is_an_error(store: Store, offset: int, length: int) -> None:
    store.put("packs/00/short", blob(1000))
    with pytest.raises(ShortRead) as info:
        store.get_range("packs/00/short", offset, length)
    assert not isinstance(info.value, (NotFound, TransientError))
    assert "past the end" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("length", [10, 3 * MiB + 17], ids=["small", "streamed"])
def test_open_range_yields_exactly_the_range_in_pieces(store: Store, length: int) -> None:
    data = blob(4 * MiB, seed=3)
    store.put("packs/00/s", data)
    with store.open_range("packs/00/s", 1001, length) as reader:
        parts = []
        while piece := reader.read(64 * 1024 + 3):
            assert len(piece) <= 64 * 1024 + 3
            parts.append(piece)
    assert b"".join(parts) == data[1001:1001 + length]


def test_a_range_in_memory_is_read_in_views_of_it_not_copies() -> None:
    """Issue 49: a local pack's range is cut into blobs without a copy of each (0.1 CPU-s per GB served)."""
    from ogrefs.store.base import BytesRange

    data = blob(1 * MiB, seed=4)
    reader = BytesRange(data)
    first, second = reader.read(1000), reader.read(5000)
    assert isinstance(first, memoryview) and first.obj is data and second.obj is data
    assert bytes(first) + bytes(second) == data[:6000] and reader.read(2 * MiB) == data[6000:]
    assert not reader.read(1)


def test_open_range_errors_are_get_range_errors(store: Store) -> None:
    store.put("packs/00/short", blob(1000))
    with pytest.raises(NotFound):
        store.open_range("packs/ff/missing", 0, 10).read(10)
    with pytest.raises(ShortRead):
        with store.open_range("packs/00/short", 500, 600) as reader:
            while reader.read(1 << 20):
                pass


def test_get_range_rejects_negative_arguments(store: Store) -> None:
    store.put("x", b"abc")
    with pytest.raises(ValueError):
        store.get_range("x", -1, 2)
    with pytest.raises(ValueError):
        store.get_range("x", 0, -2)


def test_missing_key(store: Store) -> None:
    with pytest.raises(NotFound):
        store.get("packs/ff/missing")
    with pytest.raises(NotFound):
        store.get_range("packs/ff/missing", 0, 10)
    with pytest.raises(NotFound):
        store.get_range("packs/ff/missing", 0, 0)
    assert store.exists("packs/ff/missing") is False
    assert list(store.list("packs/")) == []


def test_exists(store: Store) -> None:
    assert store.exists("snapshots/s1") is False
    store.put("snapshots/s1", b"")
    assert store.exists("snapshots/s1") is True
    # a "directory" of keys is not itself a key
    assert store.exists("snapshots") is False
    with pytest.raises(NotFound):
        store.get("snapshots")


def test_list_prefixes_and_nesting(store: Store) -> None:
    keys = ["config", "packs/ab/ab01", "packs/ab/ab02", "packs/ac/ac01", "packs/cd/cd01",
            "snapshots/s1", "snapshotsx", "index/deep/er/still/i1"]
    for k in keys:
        store.put(k, k.encode())
    assert sorted(store.list()) == sorted(keys)
    assert sorted(store.list("")) == sorted(keys)
    assert sorted(store.list("packs/")) == ["packs/ab/ab01", "packs/ab/ab02", "packs/ac/ac01", "packs/cd/cd01"]
    assert sorted(store.list("packs/ab/")) == ["packs/ab/ab01", "packs/ab/ab02"]
    assert sorted(store.list("packs/a")) == ["packs/ab/ab01", "packs/ab/ab02", "packs/ac/ac01"]
    assert sorted(store.list("packs/ab/ab0")) == ["packs/ab/ab01", "packs/ab/ab02"]
    assert sorted(store.list("snap")) == ["snapshots/s1", "snapshotsx"]
    assert sorted(store.list("snapshots/")) == ["snapshots/s1"]
    assert list(store.list("config")) == ["config"]
    assert list(store.list("index/")) == ["index/deep/er/still/i1"]
    assert list(store.list("nothing/")) == []
    assert list(store.list("packs/zz")) == []


def test_delete_is_idempotent(store: Store) -> None:
    store.put("packs/ab/gone", b"x")
    store.put("packs/ab/stays", b"y")
    store.delete("packs/ab/gone")
    assert not store.exists("packs/ab/gone")
    with pytest.raises(NotFound):
        store.get("packs/ab/gone")
    store.delete("packs/ab/gone")  # again: fine
    store.delete("never/existed")  # never there: fine
    assert sorted(store.list()) == ["packs/ab/stays"]
    assert store.get("packs/ab/stays") == b"y"


BAD_KEYS = ["", "/abs", "trailing/", "a//b", ".", "..", "a/../b", "a/./b", "../escape", ".hidden",
            "a/.tmp-123", "sp ace", "back\\slash", "ümlaut", "nul\x00", "q?", "x" * 1025, "s/" + "y" * 256]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_keys_are_rejected_everywhere(store: Store, key: str) -> None:
    for op in (lambda: store.get(key), lambda: store.put(key, b"x"), lambda: store.exists(key),
               lambda: store.delete(key), lambda: store.get_range(key, 0, 1)):
        with pytest.raises(ValueError):
            op()
    assert list(store.list()) == []


def test_concurrent_puts_and_gets(store: Store) -> None:
    threads, per_thread = 16, 6

    def work(t: int) -> list[str]:
        done = []
        for i in range(per_thread):
            key = f"packs/{t:02x}/{i:04x}"
            data = blob(4096 + 997 * i + t, seed=t * 1000 + i)
            store.put(key, data)
            assert store.get(key) == data
            assert store.get_range(key, 100, 1000) == data[100:1100]
            # everyone overwrites one shared key; all versions are valid, none torn
            store.put("shared", data[:64])
            assert len(store.get("shared")) == 64
            done.append(key)
        return done

    with ThreadPoolExecutor(threads) as pool:
        written = [k for ks in pool.map(work, range(threads)) for k in ks]
    assert sorted(store.list("packs/")) == sorted(written)
    for t in range(threads):
        for i in range(per_thread):
            assert store.get(f"packs/{t:02x}/{i:04x}") == blob(4096 + 997 * i + t, seed=t * 1000 + i)


def test_modified_is_the_time_of_the_last_put_by_the_stores_clock(store: Store) -> None:
    """``modified``: what a lock whose heartbeat is from the future is judged by (locks.py)."""
    before = time.time()
    store.put("locks/abc", b"x")
    written = store.modified("locks/abc")
    assert before - 5 <= written <= time.time() + 5  # S3's LastModified has whole seconds; same machine's clock
    with pytest.raises(NotFound):
        store.modified("locks/none")


# ---------------------------------------------------------------------------
# keys and URLs
# ---------------------------------------------------------------------------

def test_validate_key_accepts_repository_keys() -> None:
    for key in ["config", "packs/ab/abcdef0123", "snapshots/" + "f" * 64, "a.b-c_D9", "index/x.y"]:
        assert validate_key(key) == key
    for key in BAD_KEYS:
        with pytest.raises(ValueError):
            validate_key(key)


def test_validate_prefix() -> None:
    for prefix in ["", "packs/", "packs/a", "p", "index/x/"]:
        assert validate_prefix(prefix) == prefix
    for prefix in ["/x", "a//", "../", "a/../", ".t", "a/.tmp", "sp ace"]:
        with pytest.raises(ValueError):
            validate_prefix(prefix)


def test_open_store_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = open_store(f"file://{tmp_path}/r")
    assert isinstance(s, RetryingStore) and isinstance(s.inner, FileStore)
    assert s.url == f"file://{tmp_path}/r"
    assert isinstance(open_store(str(tmp_path / "plain"), retry=False), FileStore)
    monkeypatch.chdir(tmp_path)
    rel = open_store("relative/dir", retry=False)
    assert isinstance(rel, FileStore) and rel.url == f"file://{tmp_path}/relative/dir"
    # named memory stores are shared within the process
    a, b = open_store("memory://shared-x", retry=False), open_store("memory://shared-x")
    a.put("k", b"v")
    assert b.get("k") == b"v"
    assert isinstance(a, MemoryStore)
    s3 = open_store("s3://my-bucket/some/prefix/", s3_endpoint="http://127.0.0.1:9", retry=False)
    assert isinstance(s3, S3Store) and s3.url == "s3://my-bucket/some/prefix"
    assert s3.endpoint_url == "http://127.0.0.1:9"
    monkeypatch.setenv("OGREFS_S3_ENDPOINT", "http://127.0.0.1:10")
    env_s3 = open_store("s3://my-bucket", retry=False)
    assert isinstance(env_s3, S3Store) and env_s3.endpoint_url == "http://127.0.0.1:10"
    for bad in ["ftp://host/x", "s3://", "s3://ab", "s3://b_/x//y", "memory://", "file://relative", ""]:
        with pytest.raises(ValueError) as info:
            open_store(bad)
        assert "\n" not in str(info.value)


def test_parse_s3_url() -> None:
    assert parse_s3_url("s3://bkt") == ("bkt", "")
    assert parse_s3_url("s3://bkt/") == ("bkt", "")
    assert parse_s3_url("s3://bkt/a/b/") == ("bkt", "a/b")


# ---------------------------------------------------------------------------
# RetryingStore and FaultyStore
# ---------------------------------------------------------------------------

class Sleeps(list[float]):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def retrying(inner: Store, attempts: int = 6) -> tuple[RetryingStore, Sleeps]:
    sleeps = Sleeps()
    return RetryingStore(inner, attempts=attempts, base_delay=0.2, max_delay=1.0, sleep=sleeps,
                         rng=random.Random(1)), sleeps


def test_retry_recovers_from_two_transient_failures() -> None:
    faulty = FaultyStore(MemoryStore("r"))
    faulty.inner.put("k", b"v")
    store, sleeps = retrying(faulty)
    faulty.fail_next(2)
    assert store.get("k") == b"v"
    assert faulty.calls["get"] == 3
    assert faulty.injected["get"] == 2
    assert len(sleeps) == 2
    assert 0.1 <= sleeps[0] <= 0.2 and 0.2 <= sleeps[1] <= 0.4
    faulty.fail_next(2, ops={"put"})
    store.put("k2", b"w")
    assert faulty.inner.get("k2") == b"w"


def test_every_retry_is_told_with_its_error_and_what_is_left() -> None:
    """The CLI prints a line per retry (issue 51.4): the wrapper tells each one, with the time or tries left."""
    faulty = FaultyStore(MemoryStore("told"))
    faulty.inner.put("k", b"v")
    notes: list = []
    clock = iter(range(100)).__next__  # one second per reading
    store = RetryingStore(faulty, base_delay=0.2, max_delay=1.0, sleep=Sleeps(), rng=random.Random(1),
                          on_retry=notes.append)
    faulty.fail_next(2)
    assert store.get("k") == b"v"
    assert [(n.what, n.attempt, n.attempts_left) for n in notes] == [("get k", 1, 5), ("get k", 2, 4)]
    assert all(isinstance(n.error, TransientError) and n.wait > 0 for n in notes)
    notes.clear()
    timed = RetryingStore(faulty, retry_for=10, sleep=Sleeps(), clock=clock, on_retry=notes.append)
    faulty.fail_next(1)
    # the budget less the seconds read off the clock before the retry (one a reading: how many is the
    # wrapper's own business, the per-attempt deadline reads it too)
    assert timed.get("k") == b"v" and len(notes) == 1 and 5 <= notes[0].seconds_left <= 9


@pytest.mark.parametrize("exc", [NotFound, PermissionDenied, ShortRead, StoreError])
def test_retry_passes_permanent_errors_through_at_once(exc: type[StoreError]) -> None:
    faulty = FaultyStore(MemoryStore("p"))
    store, sleeps = retrying(faulty)
    faulty.fail_next(1, exc)
    with pytest.raises(exc):
        store.exists("k")
    assert faulty.calls["exists"] == 1
    assert sleeps == []


def test_retry_does_not_retry_real_not_found() -> None:
    faulty = FaultyStore(MemoryStore("nf"))
    store, sleeps = retrying(faulty)
    with pytest.raises(NotFound):
        store.get("absent")
    assert faulty.calls["get"] == 1 and sleeps == []


def test_retry_gives_up_with_transient_error() -> None:
    faulty = FaultyStore(MemoryStore("g"))
    store, sleeps = retrying(faulty, attempts=4)
    faulty.down = True
    with pytest.raises(TransientError) as info:
        store.get_range("k", 0, 1)
    assert "gave up after 4 attempts" in str(info.value)
    assert "store is down" in str(info.value)
    assert faulty.calls["get_range"] == 4
    assert len(sleeps) == 3


def test_retry_delays_grow_and_are_capped() -> None:
    store = RetryingStore(MemoryStore(), base_delay=0.2, max_delay=1.0, rng=random.Random(3))
    for retry, step in [(1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (10, 1.0)]:
        for _ in range(20):
            d = store.delay(retry)
            assert step / 2 <= d <= step, (retry, d)
    with pytest.raises(ValueError):
        RetryingStore(MemoryStore(), attempts=0)


def test_retry_list_restarts_without_duplicates() -> None:
    faulty = FaultyStore(MemoryStore("l"))
    keys = [f"packs/{i:03d}" for i in range(50)]
    for k in keys:
        faulty.inner.put(k, b"")
    store, sleeps = retrying(faulty, attempts=3)
    faulty.break_next_list(after=10)
    faulty.break_next_list(after=30)
    got = list(store.list("packs/"))
    assert sorted(got) == keys and len(got) == len(set(got))
    assert faulty.injected["list_break"] == 2
    assert len(sleeps) == 2
    # no progress at all: gives up after `attempts`
    faulty.down = True
    with pytest.raises(TransientError, match="gave up after 3 attempts"):
        list(store.list("packs/"))


def test_faulty_store_is_deterministic_with_a_seed() -> None:
    def outcomes(seed: int) -> list[str]:
        f = FaultyStore(MemoryStore(), seed=seed, error_rate=0.3, corrupt_rate=0.3)
        f.inner.put("k", b"abcdefgh")
        out = []
        for _ in range(60):
            try:
                out.append(f.get("k").hex())
            except TransientError:
                out.append("E")
        return out

    a, b, c = outcomes(5), outcomes(5), outcomes(6)
    assert a == b
    assert a != c
    assert "E" in a and b"abcdefgh".hex() in a and any(x not in ("E", b"abcdefgh".hex()) for x in a)


def test_faulty_store_read_faults() -> None:
    data = blob(4096, seed=3)
    f = FaultyStore(MemoryStore(), seed=1, corrupt_rate=1.0)
    f.inner.put("k", data)
    bad = f.get("k")
    assert len(bad) == len(data)
    diff = int.from_bytes(bad, "big") ^ int.from_bytes(data, "big")
    assert bin(diff).count("1") == 1  # exactly one bit flipped
    f = FaultyStore(MemoryStore(), seed=1, truncate_rate=1.0, ops={"get_range"})
    f.inner.put("k", data)
    assert len(f.get_range("k", 0, 4096)) < 4096
    assert f.get("k") == data  # `ops` limits the fault to get_range
    assert f.injected["truncate"] == 1


def test_faulty_store_write_faults() -> None:
    f = FaultyStore(MemoryStore(), fail_puts={2})
    f.put("a", b"1")
    with pytest.raises(TransientError, match="put #2"):
        f.put("b", b"2")
    f.put("c", b"3")
    assert sorted(f.inner.list()) == ["a", "c"]
    seen = []
    f = FaultyStore(MemoryStore(), fail_put_where=lambda key: seen.append(key) or key.startswith("cat"))
    f.put("pack", b"1")
    with pytest.raises(TransientError, match=r"put #2 \(cat/1\)"):
        f.put("cat/1", b"2")
    f.put("cat/2", b"3")  # once: the next put it would accept is written
    assert sorted(f.inner.list()) == ["cat/2", "pack"] and seen == ["pack", "cat/1"]
    f = FaultyStore(MemoryStore(), lost_ack_rate=1.0)
    with pytest.raises(TransientError, match="lost acknowledgement"):
        f.put("x", b"written anyway")
    assert f.inner.get("x") == b"written anyway"


def test_faulty_store_streak_limit_ends_a_run_of_faults_on_one_key() -> None:
    f = FaultyStore(MemoryStore(), error_rate=1.0, streak_limit=2)
    outcomes = []
    for _ in range(6):
        try:
            f.put("k", b"v")
            outcomes.append("ok")
        except TransientError:
            outcomes.append("fail")
    assert outcomes == ["fail", "fail", "ok", "fail", "fail", "ok"]
    with pytest.raises(TransientError):
        f.put("other", b"v")  # each key has its own streak
    f = FaultyStore(MemoryStore(), error_rate=0.5, lost_ack_rate=1.0, streak_limit=3, seed=5)
    outcomes = []
    for _ in range(12):  # errors and lost acknowledgements count in one streak
        try:
            f.put("k", b"v")
            outcomes.append("ok")
        except TransientError:
            outcomes.append("fail")
    assert outcomes == (["fail"] * 3 + ["ok"]) * 3
    assert f.injected["put"] > 0 and f.injected["lost_ack"] > 0


def test_faulty_store_latency() -> None:
    sleeps = Sleeps()
    f = FaultyStore(MemoryStore(), latency=(0.01, 0.02), sleep=sleeps)
    f.put("k", b"v")
    f.get("k")
    assert len(sleeps) == 2 and all(0.01 <= s <= 0.02 for s in sleeps)
    with pytest.raises(ValueError):
        FaultyStore(MemoryStore(), ops={"gett"})


# ---------------------------------------------------------------------------
# FileStore specifics
# ---------------------------------------------------------------------------

def _leftovers(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in root.rglob(".tmp-*")]


def test_file_put_interrupted_mid_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStore(tmp_path / "repo")
    store.put("packs/ab/old", b"old contents")
    real_write = os.write

    def half_then_fail(fd: int, data: Any) -> int:
        real_write(fd, bytes(data[: len(data) // 2]))
        raise RuntimeError("simulated crash mid-write")

    monkeypatch.setattr(os, "write", half_then_fail)
    with pytest.raises(RuntimeError):
        store.put("packs/ab/new", blob(10000))
    with pytest.raises(RuntimeError):
        store.put("packs/ab/old", blob(10000))
    monkeypatch.undo()
    assert not store.exists("packs/ab/new")
    assert store.get("packs/ab/old") == b"old contents"
    assert sorted(store.list()) == ["packs/ab/old"]
    assert _leftovers(tmp_path / "repo") == []


def test_file_crash_leftover_temp_files_are_not_listed(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("packs/ab/real", b"x")
    (tmp_path / "packs" / "ab" / ".tmp-deadbeef").write_bytes(b"half")
    (tmp_path / ".tmp-top").write_bytes(b"half")
    (tmp_path / "lost+found").mkdir()
    (tmp_path / "lost+found" / "junk").write_bytes(b"")
    assert sorted(store.list()) == ["packs/ab/real"]


def test_file_stale_temporaries_are_removed_fresh_ones_and_objects_kept(tmp_path: Path) -> None:
    """What killed puts left, untouched for the threshold, goes; a put in progress (a fresh file) and every
    object stay; a dry run counts without removing; wrappers pass it through; S3 and memory have none."""
    store = FileStore(tmp_path)
    store.put("packs/ab/real", b"x")
    old_a = tmp_path / "packs" / "ab" / ".tmp-deadbeef"
    old_b = tmp_path / ".tmp-top"
    fresh = tmp_path / "packs" / ".tmp-inflight"
    for path, data in ((old_a, b"half a pack"), (old_b, b"half"), (fresh, b"being written")):
        path.write_bytes(data)
    for path in (old_a, old_b):
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    (tmp_path / "packs" / "ab" / ".hidden").write_bytes(b"not ours")
    os.utime(tmp_path / "packs" / "ab" / ".hidden", (0, 0))
    wrapped = RetryingStore(FaultyStore(store))
    assert wrapped.remove_stale_temporaries(3600, dry_run=True) == (2, 15)
    assert old_a.exists() and old_b.exists()
    assert wrapped.remove_stale_temporaries(3600) == (2, 15)
    assert not old_a.exists() and not old_b.exists()
    assert fresh.exists() and (tmp_path / "packs" / "ab" / ".hidden").exists()
    assert store.get("packs/ab/real") == b"x"
    assert store.remove_stale_temporaries(3600) == (0, 0)
    assert MemoryStore().remove_stale_temporaries(0) == (0, 0)


def test_file_permission_denied_is_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStore(tmp_path)
    store.put("k", b"v")

    def denied(*args: Any, **kwargs: Any) -> int:
        raise PermissionError(errno.EACCES, "Permission denied", str(args[0]))

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(PermissionDenied) as info:
        store.get("k")
    assert "permission denied" in str(info.value)
    with pytest.raises(PermissionDenied):
        store.put("k2", b"v")
    with pytest.raises(PermissionDenied):
        store.get_range("k", 0, 1)
    monkeypatch.undo()

    def stat_denied(path: Any, *a: Any, **k: Any) -> os.stat_result:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(os, "stat", stat_denied)
    sleeps = Sleeps()
    with pytest.raises(PermissionDenied):
        RetryingStore(store, sleep=sleeps).exists("k")
    assert sleeps == []  # permanent: not retried
    monkeypatch.undo()
    assert store.exists("k")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_file_permission_denied_real(tmp_path: Path) -> None:  # pragma: no cover - runs as non-root only
    store = FileStore(tmp_path / "ro")
    store.put("k", b"v")
    (tmp_path / "ro").chmod(0o500)
    try:
        with pytest.raises(PermissionDenied):
            store.put("k2", b"v")
    finally:
        (tmp_path / "ro").chmod(0o700)


@pytest.mark.parametrize("code,text,cls", [
    (errno.ENOSPC, "no space left", StoreError),
    (errno.EIO, "I/O error", StoreError),
    (errno.ETIMEDOUT, "timed out", TransientError),
])
def test_file_write_errors_are_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      code: int, text: str, cls: type[StoreError]) -> None:
    store = FileStore(tmp_path)

    def failing(fd: int, data: Any) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "write", failing)
    with pytest.raises(cls) as info:
        store.put("packs/x", b"data")
    monkeypatch.undo()
    assert text in str(info.value).lower() or text in str(info.value)
    if cls is StoreError:
        assert not isinstance(info.value, (TransientError, NotFound, PermissionDenied))
    assert not store.exists("packs/x")
    assert _leftovers(tmp_path) == []


def test_file_modes_and_missing_root(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "new" / "root")
    assert list(store.list()) == []          # a root that does not exist yet is empty
    assert not (tmp_path / "new").exists()   # and reading did not create it
    store.put("packs/ab/x", b"secret")
    assert (tmp_path / "new" / "root" / "packs" / "ab" / "x").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "new" / "root" / "packs").stat().st_mode & 0o777 == 0o700


def test_file_reads_survive_short_preads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Network file systems may return fewer bytes than asked; the store loops."""
    store = FileStore(tmp_path)
    data = blob(40000, seed=9)
    store.put("packs/p", data)
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: real_pread(fd, min(n, 999), off))
    assert store.get("packs/p") == data
    assert store.get_range("packs/p", 123, 30000) == data[123:30123]
    with pytest.raises(ShortRead):
        store.get_range("packs/p", 39000, 1001)


def test_file_truncated_object_is_a_short_read(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("packs/p", blob(1000))
    os.truncate(tmp_path / "packs" / "p", 600)
    with pytest.raises(ShortRead, match="600 bytes"):
        store.get_range("packs/p", 500, 200)
    assert store.get_range("packs/p", 500, 100) == blob(1000)[500:600]


# ---------------------------------------------------------------------------
# S3Store specifics (unit: synthetic botocore errors and responses)
# ---------------------------------------------------------------------------

def _client_error(code: str, status: int, message: str = "msg") -> bx.ClientError:
    return bx.ClientError({"Error": {"Code": code, "Message": message},
                           "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


@pytest.mark.parametrize("exc,cls", [
    (_client_error("NoSuchKey", 404), NotFound),
    (_client_error("404", 404, "Not Found"), NotFound),
    (_client_error("AccessDenied", 403), PermissionDenied),
    (_client_error("InvalidAccessKeyId", 403), PermissionDenied),
    (_client_error("SignatureDoesNotMatch", 403), PermissionDenied),
    (_client_error("403", 403), PermissionDenied),
    (_client_error("SlowDown", 503), TransientError),
    (_client_error("InternalError", 500), TransientError),
    (_client_error("ServiceUnavailable", 503), TransientError),
    (_client_error("RequestTimeout", 400), TransientError),
    (_client_error("InvalidRange", 416), ShortRead),
    (_client_error("InvalidArgument", 400), StoreError),
    (bx.EndpointConnectionError(endpoint_url="http://127.0.0.1:9"), TransientError),
    (bx.ConnectionClosedError(endpoint_url="http://127.0.0.1:9"), TransientError),
    (bx.ReadTimeoutError(endpoint_url="http://127.0.0.1:9"), TransientError),
    (bx.ConnectTimeoutError(endpoint_url="http://127.0.0.1:9"), TransientError),
    (bx.NoCredentialsError(), PermissionDenied),
    (ConnectionResetError(104, "Connection reset by peer"), TransientError),
])
def test_s3_error_translation(exc: BaseException, cls: type[StoreError]) -> None:
    err = _translate(exc, "get", "s3://bkt/p/key", "bkt", "http://127.0.0.1:9")
    assert type(err) is cls
    assert "s3://bkt/p/key" in str(err)
    assert "\n" not in str(err)


def test_s3_no_such_bucket_message() -> None:
    err = _translate(_client_error("NoSuchBucket", 404), "get", "s3://bkt/k", "bkt", None)
    assert type(err) is StoreError
    assert "bucket bkt does not exist" in str(err)


class _Body:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self) -> bytes:
        return self.data


class _FakeClient:
    """Returns canned get_object responses, to test range verification."""

    def __init__(self, data: bytes, content_range: str | None) -> None:
        self.data, self.content_range = data, content_range

    def get_object(self, **kw: Any) -> dict[str, Any]:
        resp: dict[str, Any] = {"Body": _Body(self.data), "ContentLength": len(self.data)}
        if self.content_range is not None:
            resp["ContentRange"] = self.content_range
        return resp


def test_s3_range_read_is_verified() -> None:
    # server sent fewer bytes than asked although the object is long enough: transient
    s = S3Store("bkt", "p", client=_FakeClient(b"x" * 50, "bytes 0-49/1000"))
    with pytest.raises(TransientError, match="got 50 of 100"):
        s.get_range("k", 0, 100)
    # the object really is shorter: permanent
    s = S3Store("bkt", "p", client=_FakeClient(b"x" * 50, "bytes 950-999/1000"))
    with pytest.raises(ShortRead):
        s.get_range("k", 950, 100)
    # the server ignored Range and sent everything: we slice
    s = S3Store("bkt", "p", client=_FakeClient(bytes(range(200)), None))
    assert s.get_range("k", 10, 5) == bytes(range(10, 15))
    with pytest.raises(ShortRead):
        s.get_range("k", 150, 100)


class _BreakingBody:
    """A body that delivers ``good`` bytes, then fails with ``exc`` (or ends early when None)."""

    def __init__(self, good: bytes, exc: BaseException | None) -> None:
        self.good, self.exc, self.closed = good, exc, False

    def read(self, n: int) -> bytes:
        if self.good:
            out, self.good = self.good[:n], self.good[n:]
            return out
        if self.exc is not None:
            raise self.exc
        return b""

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("exc", [None, bx.ReadTimeoutError(endpoint_url="http://x"), ConnectionResetError("reset")],
                         ids=["ends-early", "timeout", "reset"])
def test_s3_stream_that_breaks_is_transient_never_short(exc: BaseException | None) -> None:
    n = 1 * MiB
    body = _BreakingBody(b"y" * (n // 2), exc)

    class Client:
        def get_object(self, **kw: Any) -> dict[str, Any]:
            return {"Body": body, "ContentLength": n, "ContentRange": f"bytes 0-{n - 1}/{n}"}

    reader = S3Store("bkt", "p", client=Client()).open_range("k", 0, n)
    got = b""
    with pytest.raises(TransientError) as info:
        while piece := reader.read(64 * 1024):
            got += piece
    assert got == b"y" * (n // 2) and "\n" not in str(info.value)
    assert body.closed


def test_s3_client_creation_lists_no_other_service(monkeypatch: pytest.MonkeyPatch) -> None:
    """Making the client looks into S3's data only, not into the ~450 other services botocore ships."""
    import botocore.loaders

    data = os.path.join(os.path.dirname(botocore.loaders.__file__), "data")
    real_listdir = os.listdir
    listed: list[str] = []

    def listdir(path: Any = ".") -> list[str]:
        listed.append(os.fspath(path))
        return real_listdir(path)

    monkeypatch.setattr(botocore.loaders.os, "listdir", listdir)
    store = S3Store("some-bucket", endpoint_url="http://127.0.0.1:9")
    services = {os.path.relpath(p, data).split(os.sep)[0] for p in listed if p.startswith(data + os.sep)}
    assert services == {"s3"}, sorted(services)[:5]
    assert data not in listed  # the list of every service was never asked for
    assert store._client.meta.service_model.service_name == "s3"


def test_s3_only_loader_answers_as_botocore_does_for_s3() -> None:
    import botocore.loaders

    from ogrefs.store.s3 import _S3OnlyLoader

    narrow, full = _S3OnlyLoader(), botocore.loaders.Loader()
    for type_name in ("service-2", "endpoint-rule-set-1", "paginators-1", "no-such-type-1"):
        assert narrow.list_available_services(type_name) == \
            [s for s in full.list_available_services(type_name) if s == "s3"], type_name
    assert narrow.list_available_services("service-2") == ["s3"]


# ---------------------------------------------------------------------------
# S3 against the real SeaweedFS server
# ---------------------------------------------------------------------------

@pytest.mark.s3
def test_s3_store_url_fixture_roundtrip(seaweed: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seaweed.ensure_running()
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    bucket = seaweed.new_bucket()
    store = open_store(f"s3://{bucket}/r")  # endpoint from OGREFS_S3_ENDPOINT
    store.put("config", b"cfg")
    assert store.get("config") == b"cfg"
    keys = [o["Key"] for o in seaweed.client().list_objects_v2(Bucket=bucket)["Contents"]]
    assert keys == ["r/config"]  # the prefix is honoured on the server


def test_store_url_fixture(store_url: str) -> None:
    store = open_store(store_url)
    assert list(store.list()) == []
    store.put("config", b"c")
    assert open_store(store_url).get("config") == b"c"


@pytest.mark.s3
def test_s3_missing_bucket_and_bad_credentials(seaweed: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seaweed.ensure_running()
    store = open_store("s3://no-such-bucket-here/x", s3_endpoint=seaweed.endpoint, retry=False)
    with pytest.raises(StoreError, match="bucket no-such-bucket-here does not exist") as info:
        store.get("config")
    assert not isinstance(info.value, (NotFound, TransientError))
    with pytest.raises(StoreError, match="does not exist"):
        store.put("config", b"x")
    bucket = seaweed.new_bucket()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    bad = open_store(f"s3://{bucket}", s3_endpoint=seaweed.endpoint, retry=False)
    with pytest.raises(PermissionDenied):
        bad.put("k", b"v")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    bad = open_store(f"s3://{bucket}", s3_endpoint=seaweed.endpoint, retry=False)
    with pytest.raises(PermissionDenied):
        bad.get("k")


@pytest.mark.s3
def test_s3_server_down_then_back(seaweed: Any) -> None:
    seaweed.ensure_running()
    bucket = seaweed.new_bucket()
    store = open_store(f"s3://{bucket}/r", s3_endpoint=seaweed.endpoint)
    assert isinstance(store, RetryingStore)
    store.base_delay, store.max_delay = 0.01, 0.05
    store.put("packs/ab/p", b"survives a restart")
    seaweed.stop()
    try:
        with pytest.raises(TransientError) as info:
            store.get("packs/ab/p")
        assert "gave up after 6 attempts" in str(info.value)
        assert f"127.0.0.1:{seaweed.s3_port}" in str(info.value)
        assert "\n" not in str(info.value)
        with pytest.raises(TransientError):
            store.put("packs/ab/q", b"x")
    finally:
        seaweed.start()
    assert store.get("packs/ab/p") == b"survives a restart"
    store.put("packs/ab/q", b"after")
    assert sorted(store.list("packs/")) == ["packs/ab/p", "packs/ab/q"]


# -- a caller's budget (RetryingStore.budget): restic's MaxElapsedTime per call -----------------------

class FakeClock:
    """A clock that moves only when the store sleeps: budgets run out without waiting."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def __call__(self) -> float:
        return self.now


def budgeted(inner: Store) -> tuple[RetryingStore, FakeClock]:
    clock = FakeClock()
    return RetryingStore(inner, attempts=2, base_delay=0.5, max_delay=4.0, sleep=clock.sleep, clock=clock,
                         rng=random.Random(2)), clock


def test_a_budget_view_retries_until_its_budget_is_spent_then_gives_up() -> None:
    faulty = FaultyStore(MemoryStore("budget-view"))
    faulty.inner.put("k", b"v")
    store, clock = budgeted(faulty)
    view = store.budget(30.0)
    faulty.fail_next(10)  # far more than the store's own 2 attempts
    assert view.get("k") == b"v" and faulty.calls["get"] == 11 and view.retries == 10
    faulty.down = True
    clock.now, clock.sleeps[:] = 0.0, []
    calls = faulty.calls["get"]
    with pytest.raises(TransientError, match="gave up after 30 s"):
        view.get("k")
    assert clock.now == pytest.approx(30.0)  # the caller has its answer when the budget is spent ...
    assert faulty.calls["get"] - calls == len(clock.sleeps) + 1  # ... after one call per wait, and one more
    # the store itself keeps its own policy: 2 attempts, and its retries are counted apart
    with pytest.raises(TransientError, match="gave up after 2 attempts"):
        store.get("k")
    assert store.retries == 1
    with pytest.raises(ValueError):
        store.budget(-1)


def test_a_stop_event_ends_a_budget_wait_at_once() -> None:
    faulty = FaultyStore(MemoryStore("budget-stop"))
    faulty.down = True
    store, clock = budgeted(faulty)
    stop = threading.Event()
    view = store.budget(10_000.0, stop)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            view.get("k")
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 10
    while faulty.calls["get"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()  # the call waits (on the event, not the fake sleep) for its first retry
    t.join(10)
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], TransientError) and "stopping" in str(outcome[0])
    assert faulty.calls["get"] <= 2 and clock.sleeps == []
    with pytest.raises(TransientError, match="stopping"):  # once stopped, a failing call does not wait at all
        view.get("k")


def test_a_broken_stream_is_resumed_from_the_first_missing_byte() -> None:
    faulty = FaultyStore(MemoryStore("resume"))
    data = os.urandom(100_000)
    faulty.inner.put("packs/ab/abc", data)
    store, clock = budgeted(faulty)
    view = store.budget(60.0)
    faulty.break_next_range(after=30_000)  # the first stream breaks ...
    faulty.break_next_range(after=10_000)  # ... and so does the second, further on
    got = b""
    with view.open_range("packs/ab/abc", 5, 90_000) as body:
        while piece := body.read(7_000):
            got += piece
    assert got == data[5:90_005]
    assert faulty.injected["range_break"] == 2 and faulty.calls["get_range"] == 3 and view.retries == 2


def test_a_stream_that_stays_broken_gives_up_within_the_budget() -> None:
    faulty = FaultyStore(MemoryStore("resume-fail"))
    faulty.inner.put("k", os.urandom(1000))
    store, clock = budgeted(faulty)
    view = store.budget(20.0)
    faulty.break_next_range(after=100)
    body = view.open_range("k", 0, 1000)
    assert len(body.read(500)) == 100
    faulty.down = True  # the store is gone: every reopening fails
    with pytest.raises(TransientError, match="gave up after 20 s"):
        body.read(500)
    assert clock.now == pytest.approx(20.0)
