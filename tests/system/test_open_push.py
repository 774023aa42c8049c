"""Small files the daemon holds in memory reach the program through the kernel's page cache (tier 5).

A real writable mount at ``/`` in a private mount namespace; the job reads
the first small file of its package, whose neighbours come along into the
daemon's memory (directory read-ahead), then opens and reads the others.
Each of them goes into the kernel's page cache at its open
(lazy/fs/openpush.py): the bytes the job reads are the snapshot's (``cmp``),
the mount answers at least one READ fewer per file than with the push
switched off (``OGREFS_OPEN_PUSH=0``), and the trace the mount records
holds every file, though no READ of them reached it.

(The neighbours are in the memory LRU, which nothing empties; a replayed
trace is held in memory only until the application settles, after which
the disk cache serves it, so a test that waited for a replay would race
that release.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.daemons import kill_registered_daemons
from tests.nsbox import OGREFS, in_namespace, traced_files

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not os.path.exists("/dev/fuse") and not os.environ.get("CI"), reason="no /dev/fuse here"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing"),
]

MiB = 1024 * 1024
QUIET_S = 2  # the recordings end at a quiet period (OGREFS_TRACE_QUIET), so each saved trace is the run's own
SMALL = 40


@pytest.fixture
def pkg_box(tmp_path):
    """A job that reads a 72 MiB file (over the recorder's 64 MiB) and a package of 40 small files and one large."""
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"),
               OGREFS_STATE_DIR=str(tmp_path / "state"), OGREFS_RUNTIME_DIR=str(tmp_path / "run"))
    proj = tmp_path / "box" / "proj"
    (proj / "job").mkdir(parents=True)
    (proj / "pkg").mkdir()
    with open(proj / "job" / "weights.bin", "wb") as fh:
        fh.write(bytes(72 * MiB))
    for i in range(SMALL):
        (proj / "pkg" / f"mod{i:02d}.pyc").write_bytes(os.urandom(1000 + 731 * i))
    (proj / "pkg" / "big.so").write_bytes(os.urandom(2 * MiB + 5))  # over OPEN_PUSH_MAX: read as usual
    shutil.copytree(proj / "pkg", tmp_path / "orig")  # the box is hidden by a tmpfs in the namespace
    subprocess.run([sys.executable, "-m", "ogrefs", "-q", "init"], env=env, check=True, timeout=60)
    out = subprocess.run([sys.executable, "-m", "ogrefs", "-q", "snapshot", "--json", str(proj)], env=env,
                         check=True, capture_output=True, text=True, timeout=120).stdout
    yield {"env": env, "proj": proj, "snap": json.loads(out)["id"], "tmp": tmp_path}
    kill_registered_daemons(tmp_path / "run")


def _fresh_status(out: str) -> str:
    """Shell: the daemon's status as of now into ``out`` (it rewrites it every 0.5 s: wait for a newer one)."""
    return f"""
        t0=$(date +%s.%N)
        for i in $(seq 100); do
            {OGREFS} status / --json > {out}
            python3 -c 'import json,sys; sys.exit(json.load(open(sys.argv[1]))["time"] <= float(sys.argv[2]))' \\
                {out} $t0 && break
            sleep 0.1
        done"""


def _job(box: dict, *, push: bool, status: str) -> None:
    """A fresh box: mount (the trace is recorded, none replayed), the first small file, the chunks its read asked
    for fetched, every file compared byte for byte with the originals, the status, a quiet period, unmount (which
    saves the trace)."""
    proj, tmp = box["proj"], box["tmp"]
    in_namespace(box, f"""
        rm -rf {tmp}/state {tmp}/cache
        mount -t tmpfs fresh-box {proj.parent}
        OGREFS_TRACE_QUIET={QUIET_S} OGREFS_OPEN_PUSH={int(push)} {OGREFS} mount {box['snap']} / --no-materialize \\
            --no-replay-trace
        cmp {tmp}/orig/mod00.pyc {proj}/pkg/mod00.pyc
        for i in $(seq 300); do  # until every chunk that missed was fetched (the neighbours: {SMALL - 1} of them)
            {OGREFS} status / --json > {tmp}/poll.json
            python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); \\
                sys.exit(0 if s["cache_misses"] >= {SMALL} and s["chunks_fetched"] == s["cache_misses"] \\
                         and s["chunks_in_flight"] == s["chunks_queued"] == 0 else 1)' {tmp}/poll.json && break
            sleep 0.1
        done
        for f in {tmp}/orig/*; do cmp "$f" {proj}/pkg/$(basename "$f"); done
        cat {proj}/job/weights.bin > /dev/null
        {_fresh_status(status)}
        sleep {2 * QUIET_S}
        {OGREFS} unmount /
    """)


def test_small_files_in_memory_are_served_by_the_page_cache_and_still_recorded(pkg_box):
    proj, tmp = pkg_box["proj"], pkg_box["tmp"]
    every = {str(proj / "job" / "weights.bin")} | {str(proj / "pkg" / n) for n in os.listdir(tmp / "orig")}
    _job(pkg_box, push=True, status=str(tmp / "with.json"))
    # the recording ended at the quiet period, so the saved trace is this mount's alone: the pushed files are in it
    assert traced_files(pkg_box) == every
    _job(pkg_box, push=False, status=str(tmp / "without.json"))
    assert traced_files(pkg_box) == every
    with_push, without = (json.loads((tmp / f"{n}.json").read_text()) for n in ("with", "without"))

    assert without["open_push"] is None
    assert with_push["open_push"]["files"] == SMALL - 1, with_push["open_push"]  # all but the first
    assert with_push["open_push"]["failed"] == with_push["open_push"]["late"] == 0
    # the kernel answered their reads itself: one READ (at least) less per pushed file
    assert with_push["reads"] <= without["reads"] - (SMALL - 1), (with_push["reads"], without["reads"])
    assert with_push["bytes_read"] == without["bytes_read"] - with_push["open_push"]["bytes"]
