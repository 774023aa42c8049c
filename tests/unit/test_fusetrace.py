"""scripts/fusetrace.py: perf's fuse tracepoint lines paired into requests and summed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from fusetrace import buckets, by_opcode, parse  # noqa: E402


def send(comm: str, pid: int, t: float, conn: int, req: int, opcode: int, name: str) -> str:
    return (f"  {comm} {pid}/{pid} {t:.6f}: fuse:fuse_request_send: connection {conn} req {req} "
            f"opcode {opcode} ({name}) len 56 ")


def end(comm: str, pid: int, t: float, conn: int, req: int, data: int = 0) -> str:
    return (f"  {comm} {pid}/{pid} {t:.6f}: fuse:fuse_request_end: connection {conn} req {req} "
            f"len {16 + data} error 0")


def test_sends_and_ends_pair_by_connection_and_id():
    lines = [
        send("python", 10, 100.000000, 40, 2, 1, "FUSE_LOOKUP"),
        send("python", 10, 100.000100, 41, 2, 15, "FUSE_READ"),   # same id, another mount
        end("ogrefs", 9, 100.000300, 40, 2),                      # the daemon's task answers
        "  bash 11/11 100.0004: sched:sched_switch: prev_comm=bash",  # another event: ignored
        end("ogrefs", 9, 100.002100, 41, 2),
        send("python", 10, 100.003000, 40, 4, 14, "FUSE_OPEN"),   # never answered
        end("ogrefs", 9, 100.004000, 40, 99),                     # sent before recording
    ]
    p = parse(lines)
    assert [(r.opcode, r.connection, round(r.latency * 1e6)) for r in p.requests] == [
        ("LOOKUP", 40, 300), ("READ", 41, 2000)]
    assert all(r.comm == "python" and r.pid == 10 for r in p.requests)  # the sender, not the answerer
    assert p.unanswered == 1 and p.unmatched_ends == 1


def test_a_command_name_with_spaces_is_kept_whole():
    p = parse([send("Trio thread 3", 7, 1.0, 40, 6, 3, "FUSE_GETATTR"), end("x", 1, 1.5, 40, 6)])
    assert p.requests[0].comm == "Trio thread 3" and p.requests[0].opcode == "GETATTR"


def test_summary_per_opcode_largest_total_first():
    lines = []
    for i, lat in enumerate([0.001, 0.002, 0.003, 0.004, 0.100]):  # READs
        lines += [send("python", 5, 10.0 + i, 40, 2 * i + 2, 15, "FUSE_READ"),
                  end("ogrefs", 4, 10.0 + i + lat, 40, 2 * i + 2, data=131072)]
    lines += [send("python", 5, 20.0, 40, 100, 1, "FUSE_LOOKUP"), end("ogrefs", 4, 20.0005, 40, 100)]
    rows = by_opcode(parse(lines).requests)
    assert [r.opcode for r in rows] == ["READ", "LOOKUP"]
    read = rows[0]
    assert read.count == 5
    assert read.total_s == pytest.approx(0.110)
    assert read.median_us == pytest.approx(3000, rel=1e-3)
    assert read.p90_us == pytest.approx(100_000, rel=1e-3) and read.max_ms == pytest.approx(100, rel=1e-3)
    assert read.reply_bytes == 5 * 131072  # the data, without the answers' 16-byte headers
    assert rows[1].reply_bytes == 0


def test_buckets_split_reads_from_the_rest():
    lines = [send("python", 5, 50.0, 40, 2, 15, "FUSE_READ"), end("o", 4, 50.2, 40, 2),
             send("python", 5, 50.1, 40, 4, 1, "FUSE_LOOKUP"), end("o", 4, 50.15, 40, 4),
             send("python", 5, 51.3, 40, 6, 14, "FUSE_OPEN"), end("o", 4, 51.4, 40, 6)]
    rows = buckets(parse(lines).requests, 0.5)
    assert [(start, rn, on) for start, rn, _rl, on, _ol in rows] == [(0.0, 1, 1), (1.0, 0, 1)]
    assert rows[0][2] == pytest.approx(0.2) and rows[0][4] == pytest.approx(0.05)
    assert buckets([], 0.5) == []
