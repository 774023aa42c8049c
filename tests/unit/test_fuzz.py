"""Every parser of a stored object, fuzzed: malformed input is a clean error, never a crash or a hang.

"Clean" means what ``cli.main`` turns into one line: an ``OgrefsError``
(``CorruptObject``, ``RepositoryError``, ...), a ``StoreError``, or an
``OSError`` from the local file system.  Anything else (struct.error,
KeyError, TypeError, OverflowError, RecursionError, sqlite3 or zstd errors)
would reach the user as a traceback, so it is a bug in the parser.

Inputs are random bytes and, more usefully, *valid* objects with bytes
flipped, cut or appended, and valid JSON/SQLite with fields replaced by
values of the wrong type or range.  Hypothesis runs derandomized (the same
examples every run, for CI) with a per-example deadline; pytest-timeout
backs it up against a real hang.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

from ogrefs.repo import codec
from ogrefs.repo.catalog import Catalog
from ogrefs.errors import CorruptObject, OgrefsError, RepositoryError
from ogrefs.repo import Repository
from ogrefs.repo.config import RepoConfig
from ogrefs.repo.index import decode_index, encode_index
from ogrefs.repo.locks import LockInfo, _encode, read_locks, remove_stale_locks
from ogrefs.repo.pack import TAIL_SIZE, PackBuilder, pack_key, parse_header, parse_trailer_tail
from ogrefs.restore import Restorer
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot
from ogrefs.store import MemoryStore, StoreError

pytestmark = pytest.mark.timeout(240)

CLEAN = (OgrefsError, StoreError, OSError)

FAST = settings(max_examples=600, deadline=timedelta(milliseconds=2000), derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SLOW = settings(FAST, max_examples=400, deadline=timedelta(seconds=10))


def mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """``valid`` with bytes flipped, cut short, cut in the middle, or extended."""
    n = len(valid)
    flips = st.lists(st.tuples(st.integers(0, max(0, n - 1)), st.integers(1, 255)), min_size=1, max_size=4).map(
        lambda fs: bytes(_flip(valid, fs)))
    cut = st.integers(0, n).map(lambda i: valid[:i])
    hole = st.tuples(st.integers(0, n), st.integers(1, 64)).map(lambda t: valid[:t[0]] + valid[t[0] + t[1]:])
    grow = st.binary(min_size=1, max_size=64).map(lambda extra: valid + extra)
    return st.one_of(flips, cut, hole, grow, st.binary(max_size=2 * n + 16))


def _flip(data: bytes, flips: list[tuple[int, int]]) -> bytearray:
    out = bytearray(data)
    for pos, mask in flips:
        if out:
            out[pos % len(out)] ^= mask
    return out


JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                      st.text(max_size=12))
JSON = st.recursive(JSON_LEAF, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                                            max_size=4), max_leaves=12)


def replaced_fields(valid: dict) -> st.SearchStrategy[dict]:
    """``valid`` with some fields (also nested ones, one level down) replaced by arbitrary JSON, or removed."""
    keys = sorted(valid)

    def patch(changes: list[tuple[str, str | None, object]]) -> dict:
        out = json.loads(json.dumps(valid))
        for key, sub, value in changes:
            if sub is not None and isinstance(out.get(key), dict):
                out[key][sub] = value
            elif value == "__delete__":
                out.pop(key, None)
            else:
                out[key] = value
        return out

    subkey = st.one_of(st.none(), st.sampled_from(["min_size", "avg_size", "max_size", "algorithm"]))
    value = st.one_of(JSON, st.just("__delete__"), st.sampled_from([True, 1.0, float("inf"), -1, 2**64, "1"]))
    return st.lists(st.tuples(st.sampled_from(keys), subkey, value), min_size=1, max_size=3).map(patch)


DEEP_JSON = b"[" * 100_000 + b"]" * 100_000  # json.loads: RecursionError, not ValueError


# -- config -------------------------------------------------------------------------------------------

VALID_CONFIG = RepoConfig.new().to_bytes()


def _parse_config(raw: bytes) -> None:
    try:
        cfg = RepoConfig.from_bytes(raw, "mem://x")
    except RepositoryError as exc:
        assert "\n" not in str(exc)
        return
    # accepted: then it is usable as the reader will use it
    assert type(cfg.version) is int and type(cfg.compression_level) is int and type(cfg.pack_target_size) is int
    assert cfg.pack_target_size > 0
    c = cfg.chunker
    assert all(type(v) is int for v in (c.min_size, c.avg_size, c.max_size))
    assert 64 <= c.min_size <= c.avg_size <= c.max_size


@FAST
@given(mutations(VALID_CONFIG))
@example(DEEP_JSON)
def test_config_bytes(raw):
    _parse_config(raw)


@FAST
@given(replaced_fields(json.loads(VALID_CONFIG)))
@example({**json.loads(VALID_CONFIG), "chunker": {"min_size": "a", "avg_size": 1, "max_size": 2}})
@example({**json.loads(VALID_CONFIG), "compression_level": 1e999})
@example({**json.loads(VALID_CONFIG), "version": True})
def test_config_fields(body):
    _parse_config(json.dumps(body).encode())


# -- envelopes and blobs (codec.py) ---------------------------------------------------------------------

ENVELOPES = [codec.wrap(b"x" * 300), codec.wrap(b"hello", compress=False), codec.wrap(b"")]


@FAST
@given(st.sampled_from(range(len(ENVELOPES))).flatmap(lambda i: mutations(ENVELOPES[i])))
def test_unwrap(obj):
    try:
        plain = codec.unwrap(obj, "obj")
    except CorruptObject as exc:
        assert "\n" not in str(exc)
        return
    assert codec.chunk_id(plain) == obj[6:38]  # accepted only if it is what the header promises


CHUNK = b"model weights " * 500
BLOBS = [codec.encode_blob(CHUNK), codec.encode_blob(os.urandom(100), level=0)]


@FAST
@given(st.sampled_from(range(len(BLOBS))).flatmap(lambda i: mutations(BLOBS[i])),
       st.one_of(st.just(len(CHUNK)), st.integers(0, 2**32 - 1)))
def test_decode_blob(blob, raw_len):
    try:
        data = codec.decode_blob(blob, raw_len, codec.chunk_id(CHUNK))
    except CorruptObject:
        return
    assert data == CHUNK


def test_decode_blob_raw_len_out_of_range():
    blob = codec.encode_blob(CHUNK)
    for raw_len in (-1, 2**63, 2**64):
        with pytest.raises(CorruptObject):
            codec.decode_blob(blob, raw_len, codec.chunk_id(CHUNK))


SEALER = codec.RepoCodec(3, os.urandom(32), os.urandom(32))
SEALED = SEALER.seal("snapshots/abc", b"{}")
SEALED_BLOB = SEALER.encode_blob(SEALER.chunk_id(CHUNK), CHUNK)


@FAST
@given(mutations(SEALED), mutations(SEALED_BLOB))
def test_encrypted_envelopes_and_blobs(obj, blob):
    try:
        assert SEALER.open("snapshots/abc", obj) == b"{}"
    except CorruptObject:
        pass
    try:
        assert SEALER.decode_blob(blob, len(CHUNK), SEALER.chunk_id(CHUNK)) == CHUNK
    except CorruptObject:
        pass


# -- packs ---------------------------------------------------------------------------------------------

def _pack() -> tuple[bytes, list]:
    b = PackBuilder()
    for i in range(5):
        data = bytes([i]) * (1000 + i)
        b.add(codec.chunk_id(data), codec.encode_blob(data), len(data))
    _, body, entries = b.finish()
    return body, entries


PACK_BODY, PACK_ENTRIES = _pack()


def _parse_pack(body: bytes) -> list | None:
    """The way check and orphan recovery read a pack: trailer, header, every entry inside the body."""
    try:
        header_len = parse_trailer_tail(body[-TAIL_SIZE:], "pack", len(body))
        header = body[len(body) - TAIL_SIZE - header_len:len(body) - TAIL_SIZE]
        entries = parse_header(header, len(body), "pack")
    except CorruptObject as exc:
        assert "\n" not in str(exc)
        return None
    for cid, off, slen, rlen in entries:
        assert type(cid) is bytes and len(cid) == 32
        assert 0 <= off and 1 <= slen and off + slen <= len(body) - TAIL_SIZE - header_len
    return entries


@FAST
@given(mutations(PACK_BODY))
def test_pack_trailer_and_header(body):
    _parse_pack(body)


@FAST
@given(st.binary(max_size=TAIL_SIZE + 4), st.integers(0, 2**40))
def test_pack_trailer_tail(tail, size):
    try:
        n = parse_trailer_tail(tail, "pack", size)
    except CorruptObject:
        return
    assert 0 <= n <= size - TAIL_SIZE


@FAST
@given(mutations(PACK_BODY[-TAIL_SIZE - 200:-TAIL_SIZE]), st.integers(0, 10**9))
def test_pack_header(header, size):
    try:
        parse_header(header, size, "pack")
    except CorruptObject:
        pass


def test_pack_header_bomb_is_refused():
    """A tiny header that decompresses to gigabytes is refused without inflating it all."""
    import zstandard

    for sized in (True, False):  # with and without the content size in the frame header
        bomb = zstandard.ZstdCompressor(level=19, write_content_size=sized).compress(bytes(64 * 1024 * 1024))
        assert len(bomb) < 10_000
        with pytest.raises(CorruptObject, match="header"):
            parse_header(bomb, len(bomb) + 1000, "pack")


@SLOW
@given(mutations(PACK_BODY))
def test_repository_reads_a_mutated_pack_header(body):
    """Orphan recovery (Repository.read_pack_header) on a damaged pack: CorruptObject or entries inside it."""
    repo = _memory_repo()
    name = secrets.token_hex(32)
    repo.store.put(pack_key(name), body)
    try:
        entries = repo.read_pack_header(name)
    except CorruptObject:
        return
    for _cid, off, slen, _rlen in entries:
        assert 0 <= off and off + slen <= len(body)


# -- index ---------------------------------------------------------------------------------------------

INDEX = encode_index([(os.urandom(32), secrets.token_hex(32), i * 100, 100, 200) for i in range(3)])


@FAST
@given(mutations(INDEX))
def test_index(obj):
    try:
        entries = list(decode_index(obj, "index/x"))
    except CorruptObject:
        return
    for cid, pack, off, slen, rlen in entries:
        assert len(cid) == 32 and len(pack) == 64 and int(pack, 16) >= 0


# -- manifests -----------------------------------------------------------------------------------------

_repos: list[Repository] = []


def _memory_repo() -> Repository:
    if not _repos:
        base = Path(tempfile.mkdtemp(prefix="ogrefs-fuzz-"))
        _repos.append(Repository.init(f"memory://fuzz-{secrets.token_hex(4)}", cache_root=base))
    return _repos[0]


def _load(obj: bytes):
    repo = _memory_repo()
    sid = secrets.token_hex(32)
    repo.store.put(f"snapshots/{sid}", obj)
    try:
        m = repo.load_manifest(sid)
    except OgrefsError as exc:
        assert "\n" not in str(exc)
        return None
    finally:
        repo.store.delete(f"snapshots/{sid}")
    assert isinstance(m, dict) and m["id"] == sid
    return m


VALID_MANIFEST = {"id": "0" * 64, "time": "2026-11-30T03:10:00+00:00", "host": "h", "paths": ["/x"], "tags": [],
                  "parent": None, "totals": {"files": 1}}


@FAST
@given(mutations(codec.wrap(json.dumps(VALID_MANIFEST).encode())))
def test_manifest_bytes(obj):
    _load(obj)


@FAST
@given(JSON)
def test_manifest_json_of_any_shape(body):
    _load(codec.wrap(json.dumps(body).encode()))


def test_manifest_deeply_nested_json():
    assert _load(codec.wrap(DEEP_JSON)) is None  # a clean one-line CorruptObject, not a RecursionError


@pytest.mark.expect_log(r"skipped snapshot .*wrong types", logger="ogrefs.repo")
def test_manifest_fields_of_the_wrong_type_do_not_break_listing():
    repo = Repository.init(f"memory://fuzz-list-{secrets.token_hex(4)}", cache_root=Path(tempfile.mkdtemp()))
    for t in ("2026-01-01T00:00:00+00:00", 5):
        sid = secrets.token_hex(32)
        repo.store.put(f"snapshots/{sid}", codec.wrap(json.dumps({**VALID_MANIFEST, "id": sid, "time": t}).encode()))
    try:
        repo.list_snapshots()
    except OgrefsError:
        pass


# -- locks ---------------------------------------------------------------------------------------------

VALID_LOCK = {"id": "a" * 32, "kind": "shared", "purpose": "snapshot", "host": "h", "pid": 1, "created": 1.0,
              "heartbeat": 1.0}


def _locks(*objs: bytes) -> None:
    store = MemoryStore("mem://locks")
    for i, obj in enumerate(objs):
        store.put(f"locks/l{i}", obj)
    store.put("locks/good", _encode(LockInfo(**{**VALID_LOCK, "id": "good"})))
    locks = read_locks(store)
    assert "good" in [lk.id for lk in locks]
    for lk in locks:  # whatever was accepted can be used the way prune uses it
        lk.stale()
        lk.describe()
        assert type(lk.id) is str and type(lk.kind) is str and isinstance(lk.heartbeat, (int, float))
    remove_stale_locks(store)


@FAST
@given(mutations(_encode(LockInfo(**VALID_LOCK))))
@example(codec.wrap(DEEP_JSON, compress=False))
def test_lock_bytes(obj):
    _locks(obj)


@FAST
@given(replaced_fields(VALID_LOCK))
@example({**VALID_LOCK, "heartbeat": "yesterday"})
@example({**VALID_LOCK, "created": 1e999})
def test_lock_fields(body):
    _locks(codec.wrap(json.dumps(body).encode(), compress=False))


# -- catalogs ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def snap(tmp_path_factory):
    """A small snapshot with every kind of entry, and its catalog file."""
    base = tmp_path_factory.mktemp("fuzzcat")
    src = base / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(300_000))
    (src / "d").mkdir()
    (src / "d" / "t.txt").write_text("text\n")
    os.symlink("a.bin", src / "link")
    os.link(src / "a.bin", src / "d" / "hard")
    os.mkfifo(src / "fifo")
    os.setxattr(src / "d" / "t.txt", "user.k", b"v")
    repo = Repository.init(f"memory://fuzzcat-{secrets.token_hex(4)}", cache_root=base / "cache")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    return repo, repo.catalog_path(m["id"])


TABLES = {
    "inodes": ["ino", "mode", "uid", "gid", "user", "grp", "size", "atime_ns", "mtime_ns", "ctime_ns", "nlink",
               "rdev", "target", "src_dev", "src_ino", "flags"],
    "dirents": ["parent", "name", "ino"],
    "xattrs": ["ino", "name", "value"],
    "extents": ["ino", "offset", "length", "blob"],
    "blobs": ["id", "chunk", "pack", "offset", "stored_len", "raw_len"],
    "packs": ["id", "name"],
    "roots": ["path"],
    "meta": ["key", "value"],
}
SQL_VALUE = st.one_of(
    st.none(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=True), st.text(max_size=8), st.binary(max_size=40),
    st.sampled_from([b"..", b".", b"", b"a/b", b"x\0y", b"/etc", -1, 0, 1, 2, 3, 2**32, 2**63 - 1, -2**63, "..",
                     stat.S_IFDIR | 0o755, stat.S_IFLNK | 0o777, stat.S_IFCHR | 0o600, stat.S_IFREG | 0o4755,
                     stat.S_IFSOCK | 0o644, "0" * 64, "../../etc"]))
SQL_EDIT = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(sorted(TABLES)), st.integers(0, 12), st.integers(0, 15), SQL_VALUE),
    st.tuples(st.just("delete"), st.sampled_from(sorted(TABLES)), st.integers(0, 12)),
    st.tuples(st.just("dirent"), st.integers(0, 12), SQL_VALUE, st.integers(0, 12)),
    st.tuples(st.just("drop"), st.sampled_from(sorted(TABLES))),
)


def _edit(path: Path, edits: list[tuple]) -> None:
    db = sqlite3.connect(path, isolation_level=None)
    for e in edits:
        try:
            if e[0] == "set":
                _, table, row, col, value = e
                cols = TABLES[table]
                db.execute(f"UPDATE {table} SET {cols[col % len(cols)]}=? WHERE rowid=(SELECT rowid FROM {table} "
                           f"LIMIT 1 OFFSET ?)", (value, row))
            elif e[0] == "delete":
                db.execute(f"DELETE FROM {e[1]} WHERE rowid=(SELECT rowid FROM {e[1]} LIMIT 1 OFFSET ?)", (e[2],))
            elif e[0] == "dirent":
                db.execute("INSERT OR REPLACE INTO dirents VALUES (?,?,?)", (e[1], e[2], e[3]))
            else:
                db.execute(f"DROP TABLE {e[1]}")
        except sqlite3.Error:
            pass
    db.close()


def _use_catalog(path: Path, repo: Repository) -> None:
    """Open, walk, list and restore; any failure must be clean, and nothing may land outside the target."""
    with tempfile.TemporaryDirectory(prefix="ogrefs-fuzz-restore-") as tmp:
        sandbox = Path(tmp)
        target = sandbox / "target"
        try:
            cat = Catalog(path)
            for _ in cat.walk():
                pass
            cat.counts()
            list(cat.all_blobs())
            cat.pack_names()
            r = Restorer(cat, repo.read_pack_range, os.fsencode(target), workers=2)
            r.run()
            event("restored" + (" with failures" if r.failed else "") + (" with skips" if r.skipped else ""))
        except CLEAN as exc:
            event(f"refused: {type(exc).__name__}")
            assert "\n" not in str(exc)
        assert os.listdir(sandbox) in ([], ["target"]), os.listdir(sandbox)


@pytest.mark.expect_log(r"skipped entry", logger="ogrefs.repo.catalog")
@SLOW
@given(st.lists(SQL_EDIT, min_size=1, max_size=5))
def test_catalog_rows_of_any_shape(snap, edits):
    repo, cat_path = snap
    with tempfile.TemporaryDirectory(prefix="ogrefs-fuzz-cat-") as tmp:
        path = Path(tmp) / "c.sqlite"
        shutil.copyfile(cat_path, path)
        _edit(path, edits)
        _use_catalog(path, repo)


# a flipped byte can join two directories into a cycle, which a walk skips and says so; whether one does depends
# on the fixture's catalog (its random file bytes and times), not only on hypothesis's derandomized draws
@pytest.mark.expect_log(r"skipped entry", logger="ogrefs.repo.catalog", required=False)
@SLOW
@given(st.data())
def test_catalog_file_bytes(snap, data):
    repo, cat_path = snap
    raw = cat_path.read_bytes()
    mutated = data.draw(mutations(raw))
    assume(mutated != raw)
    with tempfile.TemporaryDirectory(prefix="ogrefs-fuzz-cat-") as tmp:
        path = Path(tmp) / "c.sqlite"
        path.write_bytes(mutated)
        _use_catalog(path, repo)


# -- the CLI: one line, no traceback -------------------------------------------------------------------

def _cli(repo_dir: Path, cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OGREFS_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-m", "ogrefs", "-q", "--repo", str(repo_dir), *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_reports_damaged_objects_in_one_line(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(os.urandom(100_000))
    repo_dir = tmp_path / "repo"
    repo = Repository.init(str(repo_dir), cache_root=tmp_path / "c0")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)]))
    sid = m["id"]

    # a catalog that is valid as an envelope but not SQLite
    (repo_dir / "catalogs" / sid).write_bytes(codec.wrap(b"not sqlite" * 100))
    res = _cli(repo_dir, tmp_path / "c1", "restore", sid, str(tmp_path / "out"))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "catalog" in res.stderr
    res = _cli(repo_dir, tmp_path / "c1b", "check")
    assert res.returncode != 0 and "Traceback" not in res.stderr and "catalog" in res.stdout + res.stderr

    # a manifest that is not JSON
    (repo_dir / "snapshots" / sid).write_bytes(codec.wrap(b"{not json"))
    res = _cli(repo_dir, tmp_path / "c2", "snapshots")
    assert res.returncode != 0 and "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1

    # a config that is not JSON, then one nested too deep for the JSON parser
    for raw in (b"\xff\xfe garbage", DEEP_JSON):
        (repo_dir / "config").write_bytes(raw)
        res = _cli(repo_dir, tmp_path / "c3", "snapshots")
        assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert len(res.stderr.strip().splitlines()) == 1


# -- access traces (traces/<snapshot>/<name>) ------------------------------------------------------------

def _decode_trace(data: bytes) -> None:
    from ogrefs.repo.traces import decode_trace

    try:
        entries = decode_trace(data, "traces/x/y")
    except CorruptObject as exc:
        assert "\n" not in str(exc)
        return
    for path, off in entries:  # whatever is accepted is an absolute path and an offset
        assert type(path) is bytes and path.startswith(b"/") and type(off) is int and off >= 0


VALID_TRACE = {"format": "ogrefs-trace", "version": 1, "snapshot": "0" * 64, "created": "2026-11-30T00:00:00+00:00",
               "entries": [["/opt/venv/lib/x.py", 0], ["/data/ckpt.pt", 1048576]]}


@FAST
@given(mutations(json.dumps(VALID_TRACE).encode()))
@example(DEEP_JSON)
def test_trace_bytes(data):
    _decode_trace(data)


@FAST
@given(replaced_fields(VALID_TRACE))
@example({**VALID_TRACE, "entries": [["relative", 1], ["/x", -1], ["/x", 2**64], ["/x", True], ["/x"], "/x", None]})
def test_trace_fields(body):
    _decode_trace(json.dumps(body).encode())


def test_trace_path_with_a_lone_surrogate():
    _decode_trace(b'{"format":"ogrefs-trace","version":1,"entries":[["/a\\ud800",1]]}')


# -- size bounds (issue 14.5): every inflation stops at its bound -------------------------------------------------
def _frame(size: int, with_size: bool) -> bytes:
    return __import__("zstandard").ZstdCompressor(write_content_size=with_size).compress(bytes(size))


@FAST
@given(st.one_of(mutations(_frame(200_000, True)), mutations(_frame(200_000, False))), st.integers(0, 300_000))
@example(_frame(200_000, True), 1000)
@example(_frame(200_000, False), 1000)
def test_inflate_never_exceeds_its_bound(frame, limit):
    try:
        out = codec.inflate(frame, limit, "object")
    except CorruptObject as exc:
        assert "\n" not in str(exc)
        return
    assert len(out) <= limit


@FAST
@given(mutations(codec.wrap(bytes(300_000))), st.integers(0, 400_000))
def test_envelopes_respect_the_limit_they_are_given(obj, limit):
    try:
        plain = codec.unwrap(obj, "object", limit)
    except CorruptObject:
        return
    assert len(plain) <= limit


def _trash_repo(objs: list[bytes], rc=None):
    import types

    store = MemoryStore("mem://trash")
    for i, obj in enumerate(objs):
        store.put(f"trash/t{i}", obj)
    return types.SimpleNamespace(store=store, meta_codec=rc)


VALID_TRASH = {"packs": {"ab" * 32: 1796000000.5, "cd" * 32: 1796000001}, "readers": {"ab" * 32: ["ef" * 32]}}


def _trash(obj: bytes, rc=None) -> None:
    from ogrefs.repo.trash import load_trash

    warnings: list[str] = []
    trash = load_trash(_trash_repo([obj], rc), warn=warnings.append)
    assert len(warnings) == len(trash.malformed) and trash.keys == ["trash/t0"]  # reported, or accepted
    for pack, when in trash.marked.items():  # what is accepted is what prune relies on
        assert len(pack) == 64 and type(when) is float and when == when and abs(when) != float("inf")
        readers = trash.readers[pack]
        assert readers is None or all(type(r) is str for r in readers)
    assert all("\n" not in w for w in warnings)


@FAST
@given(mutations(codec.wrap(json.dumps(VALID_TRASH).encode())))
@example(codec.wrap(DEEP_JSON))
def test_trash_record_bytes(obj):
    _trash(obj)


@FAST
@given(replaced_fields(VALID_TRASH))
@example({"packs": {"ab" * 32: "yesterday"}})
@example({"packs": {"ab" * 32: 1e999}})
@example({"packs": {"../x": 1}})
@example({"packs": {"ab" * 32: 1}, "readers": {"ab" * 32: "all"}})
def test_trash_record_fields(body):
    _trash(codec.wrap(json.dumps(body).encode()))


SEALER = codec.RepoCodec(3, bytes(range(32)), bytes(range(32, 64)))


@FAST
@given(mutations(SEALER.seal("trash/t0", json.dumps(VALID_TRASH).encode())))
def test_sealed_trash_record_bytes(obj):
    _trash(obj, SEALER)


@FAST
@given(mutations(SEALER.seal(f"locks/{VALID_LOCK['id']}", json.dumps(VALID_LOCK).encode(), compress=False)))
def test_sealed_lock_bytes(obj):
    store = MemoryStore("mem://locks")
    store.put(f"locks/{VALID_LOCK['id']}", obj)
    for lk in read_locks(store, SEALER):
        lk.stale()
        assert lk.id == VALID_LOCK["id"]
    assert read_locks(store) == [] or obj[5] & codec.ENCRYPTED_FLAG == 0


def _sealed_pack() -> tuple[str, bytes]:
    b = PackBuilder(SEALER)
    for i in range(3):
        data = os.urandom(100 + i)
        cid = SEALER.chunk_id(data)
        b.add(cid, SEALER.encode_blob(cid, data), len(data))
    name, body, _entries = b.finish()
    return name, body


SEALED_NAME, SEALED_PACK = _sealed_pack()


@FAST
@given(mutations(SEALED_PACK))
def test_sealed_pack_header(body):
    from ogrefs.repo.pack import read_header

    try:
        entries = read_header(body, SEALED_NAME, SEALER, sealed_required=True)
    except CorruptObject as exc:
        assert "\n" not in str(exc)
        return
    for _cid, off, slen, _rlen in entries:
        assert 0 <= off and off + slen <= len(body)


# -- a trace's stale checkpoint reads (lazy/trace/newer_checkpoint.py reads the manifests' checkpoint records) ------
def _ck_record(step: int) -> dict:
    d = f"/run/checkpoint-{step}"
    return {"id": d, "path": d, "step": step, "epoch": step / 100, "coherent": True, "mtime": 1.0 * step,
            "files": [{"path": f"{d}/model.safetensors", "size": 3 << 20}, {"path": f"{d}/optimizer.pt", "size": 1 << 20}]}


def _replace(mounted_run: dict, recorded_ck: dict) -> None:
    from ogrefs.lazy.trace.newer_checkpoint import replace_stale_checkpoints

    def manifest(run: object) -> dict:
        return {"environment": {"checkpoints": {"runs": [run]}}}

    recorded = manifest({"dir": "/run", "latest_coherent": "/run/checkpoint-100", "checkpoints": [recorded_ck]})
    entries = [(b"/run/checkpoint-100/model.safetensors", 0), (b"/venv/x.py", 0),
               (b"/run/checkpoint-100/optimizer.pt", 1 << 20)]
    out = replace_stale_checkpoints(entries, manifest(mounted_run), recorded, lambda p: [0, 1 << 20])
    assert isinstance(out, list) and all(type(p) is bytes and type(o) is int for p, o in out)
    assert (b"/venv/x.py", 0) in out  # what is no checkpoint is never touched


VALID_RUN = {"dir": "/run", "latest_coherent": "/run/checkpoint-200", "checkpoints": [_ck_record(200), _ck_record(100)]}


@FAST
@given(replaced_fields(_ck_record(200)), replaced_fields(_ck_record(100)))
def test_stale_checkpoint_records(newer, recorded):
    _replace({**VALID_RUN, "checkpoints": [newer, _ck_record(100)]}, recorded)


@FAST
@given(replaced_fields(VALID_RUN))
def test_stale_checkpoint_runs(run):
    _replace(run, _ck_record(100))
