"""The access trace holds the resume, not a bulk reader that comes after it (issue 13's spot loop, tier 5).

On box B of the spot loop, ``restic backup`` read every file through the
mount within the recorder's 300 s window, and the trace the next box replayed
was the whole box in restic's order. Here a real writable mount at ``/`` in a
private mount namespace: the job reads its file, the box is quiet for longer
than the quiet period, then a reader of every file; the saved trace holds the
job's reads only. And a trace poisoned that way in the past (recorded with the
rule off) is replaced, not extended, by the next resume's.
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
    pytest.mark.timeout(180),
    pytest.mark.skipif(not os.path.exists("/dev/fuse") and not os.environ.get("CI"), reason="no /dev/fuse here"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing"),
]

MiB = 1024 * 1024
QUIET_S = 2  # the quiet period the mounts use (OGREFS_TRACE_QUIET); the box then sleeps twice as long


@pytest.fixture
def job_box(tmp_path):
    """A snapshot of a box whose job reads one 72 MiB file (over the recorder's 64 MiB) among files it never reads."""
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"),
               OGREFS_STATE_DIR=str(tmp_path / "state"), OGREFS_RUNTIME_DIR=str(tmp_path / "run"))
    proj = tmp_path / "box" / "proj"
    (proj / "job").mkdir(parents=True)
    with open(proj / "job" / "weights.bin", "wb") as fh:  # zeros: stored as one chunk, read as 72 MiB
        fh.write(bytes(72 * MiB))
    for i in range(6):
        (proj / "data").mkdir(exist_ok=True)
        (proj / "data" / f"shard-{i}.bin").write_bytes(os.urandom(256 * 1024))
    (proj / "notes.txt").write_text("never read by the job\n")
    subprocess.run([sys.executable, "-m", "ogrefs", "-q", "init"], env=env, check=True, timeout=60)
    out = subprocess.run([sys.executable, "-m", "ogrefs", "-q", "snapshot", "--json", str(proj)], env=env,
                         check=True, capture_output=True, text=True, timeout=120).stdout
    yield {"env": env, "proj": proj, "snap": json.loads(out)["id"], "tmp": tmp_path}
    kill_registered_daemons(tmp_path / "run")


def _resume_then_backup(box: dict, quiet: float) -> None:
    """A fresh box: mount, the job's read, a pause, a reader of every file, unmount (which saves the trace)."""
    proj, tmp = box["proj"], box["tmp"]
    in_namespace(box, f"""
        rm -rf {tmp}/state {tmp}/cache
        mount -t tmpfs fresh-box {proj.parent}
        OGREFS_TRACE_QUIET={quiet} {OGREFS} mount {box['snap']} / --no-materialize
        cat {proj}/job/weights.bin > /dev/null          # the resume
        sleep {2 * QUIET_S}
        find {proj} -type f -exec cat {{}} + > /dev/null  # the backup
        {OGREFS} unmount /
    """)


def test_a_bulk_reader_after_the_resumes_quiet_period_is_not_recorded(job_box):
    _resume_then_backup(job_box, QUIET_S)
    assert traced_files(job_box) == {str(job_box["proj"] / "job" / "weights.bin")}


def test_a_trace_poisoned_by_a_bulk_reader_is_replaced_by_the_next_resumes(job_box):
    proj = job_box["proj"]
    _resume_then_backup(job_box, 0)  # the rule off: the backup is recorded, as before the rule
    everything = {os.fsdecode(os.path.join(d, f)) for d, _dirs, files in os.walk(proj) for f in files}
    assert traced_files(job_box) == everything
    _resume_then_backup(job_box, QUIET_S)  # replays the poisoned trace; records the job, then goes quiet
    assert traced_files(job_box) == {str(proj / "job" / "weights.bin")}


def test_a_snapshot_of_the_box_ends_the_trace_and_a_backup_right_after_it_is_not_recorded(job_box):
    """The spot loop's B on a small box: the job, a pause (it trains), ``ogrefs snapshot`` (its environment probe
    reads through the mount), ``restic``-like reads of every file at once. The quiet rule is off here, so only the
    snapshot can end the recording."""
    proj, tmp = job_box["proj"], job_box["tmp"]
    in_namespace(job_box, f"""
        mount -t tmpfs fresh-box {proj.parent}
        OGREFS_TRACE_QUIET=0 {OGREFS} mount {job_box['snap']} / --no-materialize
        cat {proj}/job/weights.bin > /dev/null          # the resume
        sleep 2                                         # the step trains (over the recorder's 1 s pause)
        echo step > {proj}/job/step.log
        {OGREFS} -q snapshot {proj} > /dev/null
        find {proj} -type f -exec cat {{}} + > /dev/null  # the backup, at once
        {OGREFS} unmount /
    """)
    assert traced_files(job_box) == {str(proj / "job" / "weights.bin")}
    assert list((tmp / "state").glob("*/snapshot-started"))  # the snapshot's mark (the next mount clears it)
