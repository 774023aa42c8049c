"""The spot loop: A snapshots, B resumes lazily and is snapshotted again, C resumes from B (tier 5).

Every box is its own private mount namespace with a fresh tmpfs at ``/srv``, so
nothing of A's source is visible to B or C: what they see comes from the
repository.  A's tree is a small training box under ``/srv/box``: data files,
a run with a real ``torch.save`` checkpoint, a log, a file B deletes and a
directory B replaces (an opaque directory in the upper layer).

Whole-box snapshots exclude every other top-level directory of this machine
(the box is /srv); the walk, the mount at ``/`` and the overlays are the real
ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.daemons import kill_registered_daemons
from tests.treegen import compare_trees
from tests import REPO_ROOT

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not os.path.exists("/dev/fuse") and not os.environ.get("CI"), reason="no /dev/fuse here"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing"),
    pytest.mark.skipif(not os.path.isdir("/srv"), reason="the boxes live at /srv"),
]

PY = sys.executable
OGREFS = f"{PY} -m ogrefs"
BOX = "/srv/box"
TRAIN = '''
import os, sys, torch
run = "/srv/box/run"
step = int(sys.argv[1])
if step > 100:  # resume: the previous checkpoint must load
    prev = max(int(d.split("-")[1]) for d in os.listdir(run) if d.startswith("checkpoint-"))
    state = torch.load(f"{run}/checkpoint-{prev}/model.pt", weights_only=True)
    assert state["step"] == prev, state["step"]
os.makedirs(f"{run}/checkpoint-{step}", exist_ok=True)
g = torch.Generator().manual_seed(step)
torch.save({"step": step, "w": torch.randn(256, 256, generator=g)}, f"{run}/checkpoint-{step}/model.pt")
torch.save({"step": step, "m": torch.randn(64, 64, generator=g)}, f"{run}/checkpoint-{step}/optimizer.pt")
with open(f"{run}/train.log", "a") as fh:
    fh.write(f"step {step}\\n")
'''


def _excludes() -> str:
    return " ".join(f"--exclude /{n}" for n in sorted(os.listdir("/")) if n != "srv")


@pytest.fixture
def loop(tmp_path, store_url):
    env = dict(os.environ, OGREFS_REPO=store_url, OGREFS_CACHE_DIR=str(tmp_path / "cache"),
               OGREFS_STATE_DIR=str(tmp_path / "state"), OGREFS_RUNTIME_DIR=str(tmp_path / "run"),
               OGREFS_BOX="trainer")
    (tmp_path / "train.py").write_text(TRAIN)
    subprocess.run([PY, "-m", "ogrefs", "-q", "init"], env=env, check=True, timeout=60)
    yield {"env": env, "tmp": tmp_path}
    kill_registered_daemons(tmp_path / "run")


def box(loop: dict, script: str, disk: Path | None = None) -> str:
    """Run ``script`` as one box: a private mount namespace with a fresh /srv (or ``disk`` bound there)."""
    fresh = f"mount --bind {disk} /srv" if disk else "mount -t tmpfs fresh-box /srv"
    body = f"set -euo pipefail\n{fresh}\n" + textwrap.dedent(script)
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", body], env=loop["env"],
                          capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        raise AssertionError(f"box script failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def _box_a(loop: dict) -> dict:
    """Box A: /srv is a disk of its own (an ext4 directory bound there: a whole-box snapshot takes it)."""
    tmp = loop["tmp"]
    disk = tmp / "disk-a"
    disk.mkdir()
    box(loop, f"""
        mkdir -p {BOX}/data {BOX}/run {BOX}/cfg
        for i in 1 2 3; do head -c $((1500000 + i)) /dev/urandom > {BOX}/data/shard-$i.bin; done
        echo "to be deleted" > {BOX}/data/stale.txt
        echo "lr: 0.1" > {BOX}/cfg/params.yaml
        echo "old" > {BOX}/cfg/old.txt
        ln -s data/shard-1.bin {BOX}/first
        {PY} {tmp}/train.py 100
        {OGREFS} -q snapshot --whole-box {_excludes()} --json > {tmp}/a.json
    """, disk=disk)
    return json.loads((tmp / "a.json").read_text())


def _train_on_b(tmp: Path) -> str:
    """B's training: a new checkpoint and log line, a deleted file, a replaced (opaque) directory, a chmod."""
    return f"""
        {PY} {tmp}/train.py 200
        rm {BOX}/data/stale.txt
        rm -rf {BOX}/cfg && mkdir {BOX}/cfg && echo "lr: 0.05" > {BOX}/cfg/params.yaml
        chmod 0600 {BOX}/data/shard-3.bin
    """


def _fresh_status(out: Path) -> str:
    """Shell: the mount's status as written after this moment (the daemon rewrites it every 0.5 s)."""
    return f"""{PY} - <<'PY'
import json, subprocess, sys, time
since = time.time()
for _ in range(100):
    st = json.loads(subprocess.run([sys.executable, "-m", "ogrefs", "status", "/", "--json"], check=True,
                                   capture_output=True, text=True, timeout=30).stdout)
    if st["time"] > since:
        break
    time.sleep(0.2)
else:
    raise SystemExit("the mount's status was not rewritten")
open({str(out)!r}, "w").write(json.dumps(st))
PY"""


def _fetched(tmp: Path, name: str) -> int:
    return json.loads((tmp / name).read_text())["bytes_fetched"]


def test_three_box_chain_lazily_whole_box_and_by_path(loop):
    tmp = loop["tmp"]
    a = _box_a(loop)
    assert a["box"] == "trainer"
    assert a["totals"]["files"] == 9 and not any(m["path"] == "/srv" for m in a["skipped_mounts"])
    box(loop, f"""
        {OGREFS} -q mount --no-materialize latest /
        {_train_on_b(tmp)}
        {OGREFS} status / --wait --json > /dev/null   # the mount's prefetch has ended: counters are still
        {_fresh_status(tmp / "before.json")}
        {OGREFS} -q snapshot --whole-box {_excludes()} --json > {tmp}/b.json
        {OGREFS} -q snapshot {BOX} --json > {tmp}/bp.json
        {_fresh_status(tmp / "after.json")}
        cp -a {BOX} {tmp}/b-view                  # what B saw (reads it all: after the snapshots)
        {OGREFS} unmount /
    """)
    b, bp = json.loads((tmp / "b.json").read_text()), json.loads((tmp / "bp.json").read_text())
    # nothing of the box was fetched to snapshot it: the mount's store counters did not move
    assert _fetched(tmp, "after.json") == _fetched(tmp, "before.json")
    new_ckpt = sum(p.stat().st_size for p in (tmp / "b-view/run/checkpoint-200").iterdir())
    written = new_ckpt + (tmp / "b-view/run/train.log").stat().st_size + (tmp / "b-view/cfg/params.yaml").stat().st_size
    for m in (b, bp):
        t = m["totals"]
        assert m["parent"] == a["id"] and m["box"] == "trainer" and m["resumed_from"]["snapshot"] == a["id"]
        # untouched: three shards (one chmodded: its data is still the snapshot's only with metacopy),
        # the old checkpoint's two files; read: what B wrote
        assert t["read_bytes"] in (written, written + (tmp / "b-view/data/shard-3.bin").stat().st_size), t
        assert t["mount_reused_files"] >= 4, t
    ck = b["environment"]["checkpoints"]["latest_coherent"]
    assert ck["step"] == 200 and ck["coherent"]
    # the by-path snapshot restores to exactly what B saw
    subprocess.run([PY, "-m", "ogrefs", "-q", "restore", bp["id"], str(tmp / "restored")], env=loop["env"],
                   check=True, timeout=120)
    assert compare_trees(tmp / "b-view", Path(f"{tmp}/restored{BOX}")) == []
    # `latest-checkpoint` of this box: step 200, the newest of B's two snapshots that hold it
    show = subprocess.run([PY, "-m", "ogrefs", "show", "--json", "latest-checkpoint"], env=loop["env"], check=True,
                          capture_output=True, text=True, timeout=60)
    assert json.loads(show.stdout)["id"] == bp["id"]
    # C resumes from B's whole-box snapshot and trains on from B's checkpoint
    box(loop, f"""
        {OGREFS} -q mount --no-materialize {b["id"]} /
        {OGREFS} status / --json > {tmp}/c.json
        {PY} - <<'PY'
import sys; sys.path.insert(0, {str(REPO_ROOT)!r})
from tests.treegen import compare_trees
diffs = compare_trees({str(tmp / "b-view")!r}, {BOX!r})
assert diffs == [], diffs
PY
        {PY} {tmp}/train.py 300
        grep -q "step 300" {BOX}/run/train.log
        {OGREFS} unmount /
    """)
    c = json.loads((tmp / "c.json").read_text())
    assert c["snapshot"] == b["id"]


@pytest.fixture
def encrypted_loop(tmp_path):
    """The loop on an encrypted file repository, and a second (plain) repository to snapshot B into."""
    env = dict(os.environ, OGREFS_REPO=f"file://{tmp_path}/store", OGREFS_CACHE_DIR=str(tmp_path / "cache"),
               OGREFS_STATE_DIR=str(tmp_path / "state"), OGREFS_RUNTIME_DIR=str(tmp_path / "run"),
               OGREFS_BOX="trainer", OGREFS_PASSWORD="correct horse")
    (tmp_path / "train.py").write_text(TRAIN)
    subprocess.run([PY, "-m", "ogrefs", "-q", "init", "--encrypt"], env=env, check=True, timeout=60)
    subprocess.run([PY, "-m", "ogrefs", "-q", "--repo", f"file://{tmp_path}/other", "init"], env=env, check=True,
                   timeout=60)
    yield {"env": env, "tmp": tmp_path}
    kill_registered_daemons(tmp_path / "run")


def test_after_finalize_and_into_another_repository(encrypted_loop):
    """Finalized (the lower is the local copy): untouched files are still known, never re-read; into another
    repository (no shared chunks) their data is read from the local copy."""
    loop = encrypted_loop
    tmp = loop["tmp"]
    a = _box_a(loop)
    box(loop, f"""
        {OGREFS} -q mount latest /
        {OGREFS} status / --wait --json > /dev/null
        {_train_on_b(tmp)}
        {OGREFS} finalize /
        {OGREFS} -q snapshot --whole-box {_excludes()} --json > {tmp}/b.json
        {OGREFS} -q --repo file://{tmp}/other snapshot --whole-box {_excludes()} --json > {tmp}/other.json
        cp -a {BOX} {tmp}/b-view
        {OGREFS} unmount /
    """)
    b, other = json.loads((tmp / "b.json").read_text()), json.loads((tmp / "other.json").read_text())
    assert b["parent"] == a["id"] and b["resumed_from"] == {"snapshot": a["id"], "same_repository": True,
                                                             "finalized": True}
    untouched = [tmp / "b-view" / p for p in ("data/shard-1.bin", "data/shard-2.bin", "run/checkpoint-100/model.pt",
                                              "run/checkpoint-100/optimizer.pt")]
    assert b["totals"]["mount_reused_files"] == 4 and b["totals"]["local_copy_bytes"] == 0
    assert b["totals"]["read_bytes"] < b["totals"]["bytes"] - sum(p.stat().st_size for p in untouched) + 1
    # another repository: nothing reused from the mount, the untouched files' data came from the local copy
    t = other["totals"]
    assert t["mount_reused_files"] == 0 and other["resumed_from"]["same_repository"] is False
    assert t["local_copy_bytes"] == sum(p.stat().st_size for p in untouched)
    assert t["read_bytes"] == t["bytes"]
    subprocess.run([PY, "-m", "ogrefs", "-q", "--repo", f"file://{tmp}/other", "restore", other["id"],
                    str(tmp / "restored")], env=loop["env"], check=True, timeout=120)
    assert compare_trees(tmp / "b-view", Path(f"{tmp}/restored{BOX}")) == []


def test_nothing_is_skipped_in_silence(loop):
    """Whole-box: a second disk is taken, a tmpfs is listed with its type and reason (manifest, summary,
    `show`); by path with --one-file-system: the walk stays on the path's own file system (issue 14 item 8)."""
    tmp = loop["tmp"]
    disk, second = tmp / "disk-a", tmp / "disk-2"
    disk.mkdir()
    second.mkdir()
    out = box(loop, f"""
        mkdir -p {BOX}/data {BOX}/scratch {BOX}/workspace
        echo kept > {BOX}/data/a.txt
        mount --bind {second} {BOX}/workspace && echo "second disk" > {BOX}/workspace/w.txt
        mount -t tmpfs scratch {BOX}/scratch && echo gone > {BOX}/scratch/s.txt
        {OGREFS} -q snapshot --whole-box {_excludes()} --json > {tmp}/whole.json 2> {tmp}/whole.err
        {OGREFS} -q snapshot --one-file-system {BOX} --json > {tmp}/one.json 2> {tmp}/one.err
        {OGREFS} show latest --path {BOX}
    """, disk=disk)
    whole, one = json.loads((tmp / "whole.json").read_text()), json.loads((tmp / "one.json").read_text())
    assert [(m["path"], m["type"]) for m in whole["skipped_mounts"]] == [(f"{BOX}/scratch", "tmpfs")]
    assert "memory" in whole["skipped_mounts"][0]["reason"]
    assert whole["totals"]["files"] == 2  # a.txt and the second disk's w.txt
    assert f"not descended into {BOX}/scratch (tmpfs" in (tmp / "whole.err").read_text()
    assert sorted(m["path"] for m in one["skipped_mounts"]) == [f"{BOX}/scratch", f"{BOX}/workspace"]
    assert one["totals"]["files"] == 1 and all("--one-file-system" in m["reason"] for m in one["skipped_mounts"])
    assert f"not descended into {BOX}/workspace" in out  # `show` of the last one lists them (a bare `latest`
    # is the whole-box one: the snapshot of {BOX} lies inside it, README "Which snapshot `latest` is")
