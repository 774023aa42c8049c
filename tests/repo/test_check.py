"""ogrefs check through the real entry point: missing packs name every snapshot, --read-data-subset."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.cli_run import assert_one_line_error, env, run  # noqa: F401  (env is a fixture)


def packs_of(repo: Path) -> list[Path]:
    return sorted(p for p in (repo / "packs").rglob("*") if p.is_file())


def two_snapshots(tmp_path: Path, env: dict) -> list[str]:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"f{i}.bin").write_bytes(os.urandom(700_000))
    run(["init", "--pack-size", "1"], env)
    first = json.loads(run(["snapshot", "--json", str(src)], env).stdout)["id"]
    (src / "new.txt").write_text("second")
    second = json.loads(run(["snapshot", "--json", str(src)], env).stdout)["id"]
    return [first, second]


def test_a_missing_pack_names_every_snapshot_that_needs_it(tmp_path, env):
    ids = two_snapshots(tmp_path, env)
    repo = Path(env["OGREFS_REPO"])
    victim = min(packs_of(repo), key=lambda p: p.stat().st_mtime_ns)  # written by the first snapshot: both need it
    victim.unlink()
    proc = run(["check", "--json"], env, check=False)
    assert proc.returncode == 1
    problems = [p for p in json.loads(proc.stdout)["problems"] if victim.name[:16] in p]
    assert len(problems) == 1, problems  # one problem per pack, not one per snapshot ...
    assert all(i[:12] in problems[0] for i in ids), problems  # ... naming both snapshots


def test_read_data_subset_slices_cover_every_pack_once_and_find_damage(tmp_path, env):
    two_snapshots(tmp_path, env)
    packs = packs_of(Path(env["OGREFS_REPO"]))
    assert len(packs) >= 4, packs
    slices = [json.loads(run(["check", "--read-data-subset", f"{n}/3", "--json"], env).stdout) for n in (1, 2, 3)]
    assert sum(s["packs_read"] for s in slices) == len(packs)
    full = json.loads(run(["check", "--read-data", "--json"], env).stdout)
    assert sum(s["blobs"] for s in slices) == full["blobs"] and full["packs_read"] == len(packs)
    one = json.loads(run(["check", "--read-data-subset", "1%", "--json"], env).stdout)
    assert one["ok"] and one["packs_read"] == 1
    # a flipped byte is found by the slice that holds its pack, and only by it
    victim = max(packs, key=lambda p: p.stat().st_size)  # a pack of chunk data: its middle is inside a blob
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    n = int(victim.name[:2], 16) % 3 + 1
    bad = run(["check", "--read-data-subset", f"{n}/3", "--json"], env, check=False)
    assert bad.returncode == 1 and any(victim.name[:16] in p for p in json.loads(bad.stdout)["problems"])
    for other in {1, 2, 3} - {n}:
        assert json.loads(run(["check", "--read-data-subset", f"{other}/3", "--json"], env).stdout)["ok"]


def test_a_bad_subset_is_one_line(tmp_path, env):
    run(["init"], env)
    for text in ("0/3", "4/3", "150%", "lots", "0G"):
        proc = run(["check", "--read-data-subset", text], env, check=False)
        assert proc.returncode == 2, (text, proc.returncode, proc.stderr)
        assert_one_line_error(proc, "--read-data-subset")
