"""The proof that a keeper's descriptor is an overlay's lowest layer, rule by rule (tier 1: real /proc).

snapshot/mounted.py reads the box's own directory below the snapshot through
``/proc/<keeper>/fd/<n>`` only when every part of the proof holds; here this
test process plays the keeper (it holds an O_PATH descriptor of a directory),
and each rule, broken alone, must make the reader fall back (None).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from ogrefs.box.records import process_start
from ogrefs.snapshot.mounted import LOWER_ONLY, LOWER_OVER_OWN, UNKNOWN, classify_lowers, own_layer_root


@pytest.fixture
def held(tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    fd = os.open(own, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    st = os.fstat(fd)
    ws = {"keeper_pid": os.getpid(), "keeper_start": process_start(os.getpid()), "finalized": False}
    o = {"own_fd": fd, "own_dev": st.st_dev, "own_ino": st.st_ino, "mount_id": 42}
    yield ws, o
    os.close(fd)


def test_the_keepers_descriptor_is_the_own_root_when_everything_holds(held):
    ws, o = held
    root = own_layer_root(ws, o, 42)
    assert root == f"/proc/{os.getpid()}/fd/{o['own_fd']}".encode()
    assert os.path.samestat(os.stat(root), os.stat(f"/proc/self/fd/{o['own_fd']}"))


@pytest.mark.parametrize("broken", ["finalized", "keeper gone", "other process", "no start recorded", "other directory",
                                    "other overlay", "no descriptor"])
def test_each_broken_rule_falls_back(held, broken):
    ws, o = dict(held[0]), dict(held[1])
    mount_id = 42
    if broken == "finalized":
        ws["finalized"] = True
    elif broken == "keeper gone":  # a process that has exited (reaped): its /proc entry is gone
        child = subprocess.Popen(["sleep", "30"])
        ws["keeper_pid"], ws["keeper_start"] = child.pid, process_start(child.pid)
        child.kill()
        child.wait(timeout=10)
    elif broken == "other process":  # the pid now names a process that started at another time
        ws["keeper_start"] += 1
    elif broken == "no start recorded":  # a registration written before keeper_start existed
        ws["keeper_start"] = None
    elif broken == "other directory":  # the descriptor number now holds something else
        o["own_ino"] += 1
    elif broken == "other overlay":  # the overlay at the target was mounted again since
        mount_id = 43
    else:
        o["own_fd"] = None
    assert own_layer_root(ws, o, mount_id) is None


def test_a_descriptor_number_reused_for_a_file_falls_back(held, tmp_path):
    ws, o = held
    (tmp_path / "f").write_text("x")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        os.dup2(fd, o["own_fd"])  # the keeper's number now names a file (closed and reused)
        assert own_layer_root(ws, o, 42) is None
    finally:
        os.close(fd)


def test_classify_lowers():
    lower, merged, own = b"/s/lower/usr", b"/s/host/0", b"/usr"
    assert classify_lowers("rw,lowerdir=/s/lower/usr,upperdir=/u", lower, None, own) == LOWER_ONLY
    assert classify_lowers("rw,lowerdir=/s/lower/usr:/usr,upperdir=/u", lower, None, own) == LOWER_OVER_OWN
    assert classify_lowers("rw,lowerdir=/s/host/0:/s/lower/usr:/usr,upperdir=/u", lower, merged, own) == LOWER_OVER_OWN
    for opts in ("rw,lowerdir=/s/lower/usr:/opt,upperdir=/u", "rw,lowerdir=/s/lower/usr:/usr:/x,upperdir=/u",
                 "rw,lowerdir=/x:/s/lower/usr:/usr", "rw,upperdir=/u", "rw,lowerdir=/s/lower/usr2:/usr"):
        assert classify_lowers(opts, lower, None, own) == UNKNOWN, opts
