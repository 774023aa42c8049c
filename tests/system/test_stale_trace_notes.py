"""A daemonized mount that replays a trace recorded on an older checkpoint tells the user (issue 13).

The trace is resolved in the calling process before it forks (mount/plan.py),
where nothing handles the lazy engine's log: the line that says a stale
checkpoint is replayed as the newest coherent one reaches the user through
the mount's registration instead — ``mount`` prints it, ``status`` shows it —
and the daemon's log has it. Both kinds of background mount: read-only (the
daemon itself) and writable (keeper, then daemon), real FUSE.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.daemons import kill_registered_daemons
from tests.lazy.test_trace import spot_loop  # noqa: F401  (a fixture: A's trace read checkpoint-100, B wrote 200)
from tests.mounter import Mounter

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not os.path.exists("/dev/fuse") and not os.environ.get("CI"), reason="no /dev/fuse here"),
]


def _expected(src) -> str:
    run = src / "run"
    return (f"trace: reads of checkpoint {run}/checkpoint-100 replayed as reads of {run}/checkpoint-200, "
            f"the newest coherent checkpoint of run {run} (3 files)")


@pytest.fixture
def mounter(tmp_path, spot_loop):  # noqa: F811
    repo = spot_loop[0]
    m = Mounter(tmp_path, repo.store.url, extra_env={"OGREFS_STATE_DIR": str(tmp_path / "state")})
    yield m
    m.cleanup()
    kill_registered_daemons(tmp_path / "run")


def test_a_read_only_mount_says_its_trace_is_replayed_as_the_newest_checkpoint(tmp_path, spot_loop, mounter):  # noqa: F811
    _repo, src, m_b, _cat, _stale, _fresh = spot_loop
    mp = tmp_path / "mnt"
    mp.mkdir()
    mounter.mounts.append(mp)
    out = mounter.cli("mount", m_b["id"], str(mp), "--read-only", "--prefetch").stdout
    assert _expected(src) in out.splitlines()
    st = mounter.status(mp)
    assert st["trace_notes"] == [_expected(src)] and st["trace_replayed"] > 0
    assert f"  {_expected(src)}" in mounter.cli("status", str(mp)).stdout.splitlines()
    log = open(st["log"]).read()
    assert "mounted snapshot" in log and _expected(src) in log  # the daemon's log has what this process resolved
    mounter.unmount(mp)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing")
def test_a_writable_mount_says_it_too_and_json_carries_it(tmp_path, spot_loop, mounter):  # noqa: F811
    _repo, src, m_b, _cat, _stale, _fresh = spot_loop
    target, out = tmp_path / "target", tmp_path / "out"
    target.mkdir()
    cli = f"{sys.executable} -m ogrefs --repo {mounter.repo_url}"
    script = f"""set -euo pipefail
        {cli} mount {m_b['id']} {target} --no-materialize --no-save-trace > {out}.txt
        {cli} status {target} --json > {out}.status.json
        {cli} unmount {target}
        {cli} mount {m_b['id']} {target} --no-materialize --no-save-trace --json > {out}.json
        {cli} unmount {target}
    """
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", script],
                          env=mounter.env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr
    printed = (tmp_path / "out.txt").read_text().splitlines()
    # the id as `snapshots` shows it (12 digits)
    assert printed[0].startswith(f"mounted {m_b['id'][:12]} at {target} (writable") and _expected(src) in printed
    st = json.loads((tmp_path / "out.status.json").read_text())
    assert st["trace_notes"] == [_expected(src)]
    log = open(st["log"]).read()  # the keeper's daemon logs it too (the log outlives the mount)
    assert "mounted snapshot" in log and _expected(src) in log
    assert json.loads((tmp_path / "out.json").read_text())["trace_notes"] == [_expected(src)]
