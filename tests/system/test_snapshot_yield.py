"""A snapshot of a box running from a writable mount holds the mount's background fetches back (tier 5).

The daemon's hints stream in over a slowed store (a token bucket on the
file store's pack reads, installed through ``sitecustomize`` in every ogrefs
process of the test, the forked daemon included) while the test marks a
snapshot as running: the fetched bytes must stop growing with hints left to
fetch, and go on once the mark is gone.  Then a real ``ogrefs snapshot`` of
the box: the daemon must say it yields while that runs, and no mark may be
left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from ogrefs.box.records import clear_snapshot_running, mark_snapshot_running
from tests.nsbox import OGREFS, box  # noqa: F401  (box is a fixture)

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not os.path.exists("/dev/fuse") and not os.environ.get("CI"), reason="no /dev/fuse here"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing"),
]

MiB = 1024 * 1024
LINK = 32 * MiB  # bytes a second the slowed store hands out, all readers together
HINTS = 160 * MiB  # about 5 s of hints on that link

SITECUSTOMIZE = '''
import glob, json, os, threading, time
_rate = float(os.environ.get("OGREFS_TEST_LINK_BPS", "0"))
if _rate:
    from ogrefs.store import file as _file
    _lock = threading.Lock()
    _get_range = _file.FileStore.get_range
    def get_range(self, key, offset, length):
        if key.startswith("packs/"):
            with _lock:  # one link for every reader
                time.sleep(length / _rate)
        return _get_range(self, key, offset, length)
    _file.FileStore.get_range = get_range
_seen = os.environ.get("OGREFS_TEST_SEEN_YIELD")
if _seen:
    from ogrefs.snapshot import pipeline as _pipeline
    _mark = _pipeline._mark_snapshot_running
    def mark(state_dir):
        made = _mark(state_dir)
        said = False
        deadline = time.monotonic() + 30
        while not said and time.monotonic() < deadline:
            for path in glob.glob(os.environ["OGREFS_TEST_STATUS_GLOB"]):
                try:
                    with open(path) as fh:
                        said = bool((json.load(fh).get("snapshot_yield") or {}).get("yielding"))
                except (OSError, ValueError):
                    pass
            time.sleep(0.05)
        with open(_seen, "w") as fh:
            fh.write("yielded" if said else "not yielded")
        return made
    _pipeline._mark_snapshot_running = mark
'''


def _wait(what: str, cond, timeout: float = 60.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_snapshot_of_the_box_holds_the_mounts_background_fetches_back(box):
    tmp = box["tmp"]
    venv = tmp / "box" / "venv"
    site = venv / "lib" / "python3.11" / "site-packages" / "pkg"
    site.mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.11.2\n")
    for i in range(HINTS // (4 * MiB)):
        (site / f"ext{i}.so").write_bytes(os.urandom(4 * MiB))
    out = subprocess.run([*OGREFS.split(), "-q", "snapshot", "--json", str(venv)], env=box["env"], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    snap = json.loads(out)["id"]
    hooks = tmp / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    status_glob = str(tmp / "run" / "mounts" / "*.status.json")
    env = dict(box["env"], PYTHONPATH=str(hooks), OGREFS_TEST_LINK_BPS=str(LINK),
               OGREFS_TEST_SEEN_YIELD=str(tmp / "seen"), OGREFS_TEST_STATUS_GLOB=status_glob)
    script = textwrap.dedent(f"""
        set -euo pipefail
        mount -t tmpfs fresh-box {venv.parent}
        {OGREFS} -q mount {snap} / --no-materialize
        touch {tmp}/mounted
        timeout 120 bash -c 'until [ -e {tmp}/go ]; do sleep 0.05; done'
        {OGREFS} -q snapshot --json {venv} > {tmp}/snap2.json
        touch {tmp}/snapped
        timeout 120 bash -c 'until [ -e {tmp}/done ]; do sleep 0.05; done'
        {OGREFS} unmount /
    """)
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "bash", "-c", script], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def status() -> dict:
        paths = list(Path(tmp / "run" / "mounts").glob("*.status.json"))
        try:
            return json.loads(paths[0].read_text()) if len(paths) == 1 else {}
        except (OSError, ValueError):
            return {}

    def hint() -> dict:
        return (status().get("materialize") or {}).get("classes", {}).get("hint") or {}

    try:
        _wait("the mount", lambda: (tmp / "mounted").exists() or proc.poll() is not None, 90)
        assert proc.poll() is None, proc.communicate()
        _wait("the hints to start", lambda: status().get("bytes_fetched", 0) > 0)
        state_dir = Path(status()["state_dir"])
        mark = mark_snapshot_running(state_dir)  # this process "snapshots the box"
        _wait("the mount to yield", lambda: (status().get("snapshot_yield") or {}).get("yielding"), 30)

        def still() -> int | None:  # bytes fetched, once they stayed the same for 1 s (in-flight GETs ended)
            before = status()["bytes_fetched"]
            time.sleep(1.0)
            after = status()["bytes_fetched"]
            return after if after == before else None

        held = _wait("the fetches to stop", still, 30, every=0)
        left = hint()
        assert 0 < left["bytes_done"] < left["bytes_total"], left  # stopped with hints still to fetch
        time.sleep(1.0)
        assert status()["bytes_fetched"] == held  # and nothing started since
        clear_snapshot_running(mark)
        _wait("the hints to go on", lambda: status()["bytes_fetched"] > held, 30)
        _wait("the hints to finish", lambda: hint().get("bytes_done") == hint().get("bytes_total"), 60)
        assert status()["snapshot_yield"]["snapshots"] == 1 and not status()["snapshot_yield"]["yielding"]

        (tmp / "go").touch()  # a real snapshot of the box, from the mount
        _wait("the snapshot", lambda: (tmp / "snapped").exists() or proc.poll() is not None, 120)
        assert (tmp / "seen").read_text() == "yielded"  # the daemon yielded while it ran
        assert not list(state_dir.glob("snapshot-running.*"))  # its mark is gone with it
        _wait("the yield to end", lambda: status()["snapshot_yield"] == {
            **status()["snapshot_yield"], "yielding": False, "snapshots": 2}, 10)
        assert json.loads((tmp / "snap2.json").read_text())["parent"] == snap
    finally:
        (tmp / "done").touch()
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
    assert proc.returncode == 0, f"{stdout}\n{stderr}"
