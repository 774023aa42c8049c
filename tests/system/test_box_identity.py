"""Two machines of one host name (a cloned image) sharing a repository stay two boxes (tier 5: namespaces).

Each "machine" is a private UTS and mount namespace (``unshare``) with the
same host name, its own ``/etc/machine-id`` bound over the real one, and its
own files bound at the same path: what two boxes booted from one image look
like to ogrefs.  Pinned: A's ``restore latest`` gets A's files, B's agent
``--keep-last 1`` and B's ``forget --keep-last 1`` never forget A's snapshot,
an old snapshot named by the host alone stays selectable by name, and a box
adopts a name on purpose with ``OGREFS_BOX`` in one line.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare")]
HOST = "cloned-trainer"
WORK = "/srv/ogrefs-box-identity-work"  # the path both machines snapshot; bound to each one's own directory


@pytest.fixture
def machines(tmp_path):
    env = dict(os.environ, OGREFS_REPO=f"file://{tmp_path}/repo", OGREFS_CACHE_DIR=str(tmp_path / "cache"),
               OGREFS_RUNTIME_DIR=str(tmp_path / "run"))
    env.pop("OGREFS_BOX", None)
    subprocess.run([sys.executable, "-m", "ogrefs", "-q", "init"], env=env, check=True, timeout=60)
    for name, mid in (("a", "a" * 32), ("b", "b" * 32), ("c", "c" * 32)):
        (tmp_path / name / "work").mkdir(parents=True)
        (tmp_path / name / "work" / "whose.txt").write_text(f"machine {name}\n")
        (tmp_path / name / "machine-id").write_text(mid + "\n")
    return {"env": env, "tmp": tmp_path}


def _on(machines: dict, name: str, argv: list[str], env: dict | None = None, popen: bool = False):
    """``ogrefs ARGV`` on machine ``name``: host name HOST, its machine id, its files at WORK."""
    tmp = machines["tmp"]
    script = (f"hostname {HOST} && mkdir -p {WORK} && mount --bind {tmp / name / 'work'} {WORK} && "
              f"mount --bind {tmp / name / 'machine-id'} /etc/machine-id && "
              f"exec {shlex.quote(sys.executable)} -m ogrefs {shlex.join(argv)}")
    cmd = ["unshare", "--uts", "--mount", "--propagation", "private", "bash", "-c", script]
    if popen:
        return subprocess.Popen(cmd, env=env or machines["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    return subprocess.run(cmd, env=env or machines["env"], capture_output=True, text=True, timeout=120)


def _snapshot(machines: dict, name: str, env: dict | None = None) -> dict:
    done = _on(machines, name, ["-q", "snapshot", "--json", WORK], env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _ids(machines: dict) -> set[str]:
    listed = subprocess.run([sys.executable, "-m", "ogrefs", "snapshots", "--json"], env=machines["env"],
                            check=True, capture_output=True, text=True, timeout=60).stdout
    return {m["id"] for m in json.loads(listed)}


def test_clones_of_one_host_name_restore_their_own_latest_and_never_forget_each_other(machines):
    a = _snapshot(machines, "a")
    b = _snapshot(machines, "b")  # the repository's newest, same host name and paths as A's
    target = machines["tmp"] / "restored-on-a"
    done = _on(machines, "a", ["-q", "restore", "latest", str(target)])
    assert done.returncode == 0, done.stderr
    assert (target / WORK.lstrip("/") / "whose.txt").read_text() == "machine a\n"  # A's own, not B's newer one
    # B's retention, by hand and by its agent: B's own snapshots only
    done = _on(machines, "b", ["-q", "forget", "--keep-last", "1"])
    assert done.returncode == 0, done.stderr
    agent = _on(machines, "b", ["agent", "--json", "--path", WORK, "--keep-last", "1", "--no-on-checkpoint"],
                popen=True)
    try:
        _wait_for_snapshot(agent)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=120) == 0, agent.stderr.read()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(timeout=30)
    left = _ids(machines)
    assert a["id"] in left and len(left) == 2  # A's only snapshot and B's newest
    assert a["box"] != b["box"] and a["box"].startswith(f"{HOST}-") and b["box"].startswith(f"{HOST}-")


def _wait_for_snapshot(agent: subprocess.Popen) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = agent.stdout.readline()  # the agent writes a line per event; it ends when the agent does
        if not line:
            break
        ev = json.loads(line)
        if ev["event"] == "snapshot":
            return ev
    raise AssertionError(f"no snapshot from the agent; stderr {agent.stderr.read() if agent.poll() is not None else ''}")


def test_a_host_named_box_of_an_older_ogrefs_stays_selectable_and_is_adopted_in_one_line(machines):
    old = _snapshot(machines, "a", dict(machines["env"], OGREFS_BOX=HOST))  # what an older ogrefs recorded
    assert old["box"] == HOST
    # a new machine of that host name: its `latest` is its own (none yet), never the old name by itself ...
    refused = _on(machines, "c", ["restore", "latest", str(machines["tmp"] / "nothing")])
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert f"OGREFS_BOX={HOST}" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    # ... the old one by name ...
    by_name = machines["tmp"] / "by-name"
    done = _on(machines, "c", ["-q", "restore", f"{HOST}:latest", str(by_name)])
    assert done.returncode == 0 and (by_name / WORK.lstrip("/") / "whose.txt").read_text() == "machine a\n", done.stderr
    # ... and adopted on purpose: its snapshots and `latest` are that box's from then on
    adopted = _snapshot(machines, "c", dict(machines["env"], OGREFS_BOX=HOST))
    assert adopted["box"] == HOST and adopted["parent"] == old["id"]
