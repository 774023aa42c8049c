"""A writable mount at / of a box: the daemon never depends on what it serves (tier 5).

Real FUSE and overlayfs at real paths, inside ``unshare --mount
--propagation private``: a snapshot of a ``usr``-like and a ``var``-like
directory is mounted over those same directories, with ogrefs' state
directory and chunk cache *below* the overlaid ``var`` (as /var/lib/ogrefs
and /var/cache are on a real box). Each shell step has a timeout, so a hang
fails the test instead of the run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.nsbox import FUSE, OVERLAY, SCRIPT_HEAD, none_mounted

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not os.path.exists("/dev/fuse") and not os.environ.get("CI"), reason="no /dev/fuse here"),
    pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("nsenter") is None,
                       reason="util-linux unshare/nsenter missing"),
]

OGREFS = f"timeout 90 {sys.executable} -m ogrefs"
PY = f"timeout 30 {sys.executable}"


@pytest.fixture
def whole(tmp_path):
    """A snapshot of box/usr, box/var and box/mnt; then this box's own versions differ from it."""
    box = tmp_path / "box"
    for d in ("usr/bin", "usr/lib/pkg", "var/lib/app", "mnt/scratch"):
        (box / d).mkdir(parents=True)
    (box / "usr/marker").write_text("snap\n")
    (box / "usr/bin/tool").write_text("#!/bin/sh\necho tool from the snapshot\n")
    (box / "usr/lib/pkg/big.bin").write_bytes(os.urandom(2 * 1024 * 1024 + 5))
    shutil.copy(box / "usr/lib/pkg/big.bin", tmp_path / "expected-big.bin")
    (box / "var/lib/app/data").write_text("app data\n")
    (box / "mnt/from-snapshot").write_text("snap mnt\n")
    snap_env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "snapcache"))
    subprocess.run([sys.executable, "-m", "ogrefs", "-q", "init"], env=snap_env, check=True, timeout=60)
    out = subprocess.run([sys.executable, "-m", "ogrefs", "-q", "snapshot", "--json", str(box / "usr"),
                          str(box / "var"), str(box / "mnt")], env=snap_env, check=True, capture_output=True,
                         text=True, timeout=120).stdout
    (box / "usr/marker").write_text("host\n")  # from here on this is the other box
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"),
               OGREFS_CACHE_DIR=str(box / "var/cache/ogrefs"),
               OGREFS_STATE_DIR=str(box / "var/lib/ogrefs/mounts"),
               OGREFS_RUNTIME_DIR=str(tmp_path / "run"))
    yield {"env": env, "box": box, "snap": json.loads(out)["id"], "tmp": tmp_path}
    _kill_leftovers(tmp_path / "run" / "mounts")


def _kill_leftovers(mounts: Path) -> None:
    for reg in mounts.glob("*.json") if mounts.exists() else []:
        try:
            info = json.loads(reg.read_text())
        except (OSError, ValueError):
            continue
        for key in ("pid", "keeper_pid"):
            try:
                if info.get(key):
                    os.kill(info[key], signal.SIGKILL)
            except (OSError, AttributeError):
                pass


def in_namespace(env: dict, script: str, check: bool = True) -> subprocess.CompletedProcess:
    body = SCRIPT_HEAD + textwrap.dedent(script)
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", body], env=env,
                          capture_output=True, text=True, timeout=200)
    if check and proc.returncode != 0:
        raise AssertionError(f"script failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def _pid(tmp: Path, key: str = "pid") -> str:
    return (f"$({PY} -c \"import json,glob; print(json.load(open(glob.glob('{tmp}/run/mounts/*[0-9a-f].json')[0]))"
            f"['{key}'])\")")


def test_daemon_sees_the_box_as_it_was_while_the_overlays_are_up(whole):
    box, tmp, snap = whole["box"], whole["tmp"], whole["snap"]
    in_namespace(whole["env"], f"""
        {OGREFS} mount {snap} /
        test "$(cat {box}/usr/marker)" = "snap"                 # the box sees the snapshot
        pid={_pid(tmp)}
        test "$(readlink /proc/$pid/ns/mnt)" != "$(readlink /proc/self/ns/mnt)"
        {none_mounted(tmp, OVERLAY, "/proc/$pid/mountinfo")}   # no overlay in the daemon's view
        test "$(timeout 10 nsenter -t $pid -m cat {box}/usr/marker)" = "host"   # its own files as they were
        timeout 10 nsenter -t $pid -m stat {sys.executable} > /dev/null
        # the local copy and its database live below the overlaid var: the daemon reads and writes
        # them there (in its own view) while serving that very overlay's lower
        {OGREFS} status / --wait > {tmp}/wait.txt
        cmp {box}/usr/lib/pkg/big.bin {tmp}/expected-big.bin
        test "$(cat {box}/var/lib/app/data)" = "app data"
        test "$({box}/usr/bin/tool 2>/dev/null || sh {box}/usr/bin/tool)" = "tool from the snapshot"
        ls {box}/var/lib/ogrefs/mounts/*/materialize.sqlite > /dev/null   # ogrefs' state is not covered
        echo written > {box}/var/lib/app/new
        {OGREFS} unmount /
        {none_mounted(tmp, OVERLAY)}
        test "$(cat {box}/usr/marker)" = "host"
        {OGREFS} mount {snap} /                                  # remount resumes
        test "$(cat {box}/var/lib/app/new)" = "written"
        {OGREFS} unmount /
    """)
    assert "complete" in (tmp / "wait.txt").read_text()


def test_hard_kill_of_the_daemon_leaves_a_box_that_unmounts_and_remounts(whole):
    box, tmp, snap = whole["box"], whole["tmp"], whole["snap"]
    in_namespace(whole["env"], f"""
        {OGREFS} mount {snap} / --no-materialize
        echo kept > {box}/var/lib/app/written
        pid={_pid(tmp)}
        keeper={_pid(tmp, 'keeper_pid')}
        kill -9 "$pid"
        for i in $(seq 300); do kill -0 "$keeper" 2>/dev/null || break; sleep 0.1; done
        fails kill -0 "$keeper" 2>/dev/null                     # the keeper saw it and cleaned up
        {none_mounted(tmp, OVERLAY)}                             # no dead overlay left ...
        test "$(cat {box}/usr/marker)" = "host"                  # ... the box shows its own tree again
        fails {OGREFS} status / 2> {tmp}/status.err
        {PY} -c "
import json; from ogrefs.box.records import registered_mounts, writable_state
print(json.dumps([writable_state(i) for i in registered_mounts()]))" > {tmp}/died.json
        {OGREFS} mount {snap} /  --no-materialize                # and a remount recovers every write
        test "$(cat {box}/var/lib/app/written)" = "kept"
        test "$(cat {box}/usr/marker)" = "snap"
        {OGREFS} unmount /
        {OGREFS} mount {snap} /  --no-materialize
        {OGREFS} unmount /
    """)
    assert "gone" in (tmp / "status.err").read_text()
    [st] = json.loads((tmp / "died.json").read_text())
    assert st["died"] and st["overlays"] == []  # the state says truthfully: nothing is mounted


def test_submounts_and_ogrefs_directories_stay_visible(whole):
    box, tmp, snap = whole["box"], whole["tmp"], whole["snap"]
    repo = box / "var" / "srv-repo"  # a file:// repository below an overlaid directory
    shutil.move(str(tmp / "repo"), str(repo))
    env = dict(whole["env"], OGREFS_REPO=str(repo))
    in_namespace(env, f"""
        mount -t tmpfs scratch-disk {box}/mnt/scratch               # this box's own disk
        echo "on the disk" > {box}/mnt/scratch/disk-file
        {OGREFS} mount {snap} / > {tmp}/mount.out
        test "$(cat {box}/mnt/from-snapshot)" = "snap mnt"           # the snapshot's /mnt ...
        test "$(cat {box}/mnt/scratch/disk-file)" = "on the disk"    # ... and the disk below it
        echo more > {box}/mnt/scratch/second                         # writes go to the disk itself
        {OGREFS} snapshots > /dev/null                                # the repository is reachable
        test -d {repo}/snapshots
        {OGREFS} status / --json > {tmp}/status.json
        {OGREFS} status / --wait > /dev/null
        {OGREFS} unmount /                                            # not busy: the bind-backs go first
        test "$(cat {box}/mnt/scratch/second)" = "more"
        grep -q " {box}/mnt/scratch " /proc/self/mountinfo           # the disk itself stays mounted
        {OGREFS} mount {snap} /
        test "$(cat {box}/mnt/scratch/disk-file)" = "on the disk"
        {OGREFS} unmount /
    """)
    st = json.loads((tmp / "status.json").read_text())
    assert f"{box}/mnt/scratch" in st["binds"]
    assert any(b.startswith(str(box / "var")) for b in st["binds"])  # state, cache and repository
    assert "still visible" in (tmp / "mount.out").read_text()


def test_a_second_mount_of_the_same_state_directory_is_refused_and_the_first_lives_on(whole):
    box, tmp, snap = whole["box"], whole["tmp"], whole["snap"]
    other = tmp / "elsewhere"
    other.mkdir()
    proc = in_namespace(whole["env"], f"""
        {OGREFS} mount {snap} / --state-dir {tmp}/shared-state
        fails {OGREFS} mount {snap} {other} --state-dir {tmp}/shared-state 2> {tmp}/second.err
        test "$(cat {box}/usr/marker)" = "snap"                  # the first one still serves
        grep -q " {box}/usr " /proc/self/mountinfo
        {none_mounted(other)}
        {OGREFS} unmount /
    """)
    err = (tmp / "second.err").read_text()
    assert "in use by a live mount" in err and "Traceback" not in err, proc.stderr


def test_a_file_with_overlayfs_metadata_reads_through_the_writable_mount(tmp_path):
    src = tmp_path / "src" / "data"
    src.mkdir(parents=True)
    (src / "copied-up").write_text("real bytes\n")
    os.setxattr(src / "copied-up", "trusted.overlay.metacopy", b"")   # as in an overlay's upper dir
    os.setxattr(src / "copied-up", "trusted.overlay.origin", b"\x00\xfb\x21")
    os.setxattr(src / "copied-up", "user.kept", b"yes")
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"),
               OGREFS_STATE_DIR=str(tmp_path / "state"), OGREFS_RUNTIME_DIR=str(tmp_path / "run"))
    subprocess.run([sys.executable, "-m", "ogrefs", "-q", "init"], env=env, check=True, timeout=60)
    out = subprocess.run([sys.executable, "-m", "ogrefs", "-q", "snapshot", "--json", str(src)], env=env,
                         check=True, capture_output=True, text=True, timeout=60).stdout
    snap = json.loads(out)["id"]
    try:
        in_namespace(env, f"""
            mount -t tmpfs fresh {src.parent}
            {OGREFS} mount {snap} /
            test "$(cat {src}/copied-up)" = "real bytes"
            test "$(getfattr --only-values -n user.kept {src}/copied-up)" = "yes"
            echo more >> {src}/copied-up
            {OGREFS} unmount /
        """)
    finally:
        _kill_leftovers(tmp_path / "run" / "mounts")


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, mode)


def test_host_owned_paths_keep_this_box_identity_logins_and_driver(tmp_path):
    """Rules under a test box (the defaults name the real /etc, /usr/lib...): what each kind keeps."""
    box = tmp_path / "box"
    a = {"etc/hostname": "box-a\n", "etc/passwd": "root:x:0:0::/root:/bin/bash\nalice:x:1000:1000::/home/alice:/bin/bash\n",
         "etc/group": "root:x:0:\nsudo:x:27:alice\nalice:x:1000:\n", "etc/sudoers.d/common": "A\n",
         "etc/sudoers.d/from-a": "A only\n", "root/.ssh/authorized_keys": "ssh-ed25519 KEY-A a@a\n",
         "usr/lib/libcuda.so.1": "cuda 535\n", "usr/lib/libnvidia-ml.so.1": "nvml 535\n",
         "usr/lib/libcudart.so.12": "toolkit from A\n", "usr/bin/nvidia-smi": "smi 535\n", "usr/bin/app": "A app\n"}
    for rel, text in a.items():
        _write(box / rel, text)
    os.chmod(box / "root/.ssh", 0o700)
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"),
               OGREFS_STATE_DIR=str(tmp_path / "state"), OGREFS_RUNTIME_DIR=str(tmp_path / "run"))
    subprocess.run([sys.executable, "-m", "ogrefs", "-q", "init"], env=env, check=True, timeout=60)
    out = subprocess.run([sys.executable, "-m", "ogrefs", "-q", "snapshot", "--json", str(box / "etc"),
                          str(box / "root"), str(box / "usr")], env=env, check=True, capture_output=True, text=True,
                         timeout=60).stdout
    snap = json.loads(out)["id"]
    # box B: another provider's image
    (box / "usr/lib/libnvidia-ml.so.1").unlink()
    (box / "usr/lib/libcudart.so.12").unlink()
    for rel, text in {"etc/hostname": "box-b\n", "etc/passwd": "root:x:0:0::/root:/bin/sh\ndebian:x:1000:1000::/home/debian:/bin/bash\n",
                      "etc/group": "root:x:0:\nsudo:x:27:debian\ndebian:x:1000:\n", "etc/sudoers.d/common": "B\n",
                      "etc/sudoers.d/from-b": "B only\n", "root/.ssh/authorized_keys": "ssh-ed25519 KEY-B provider\n",
                      "usr/lib/libcuda.so.1": "cuda 550\n", "usr/bin/nvidia-smi": "smi 550\n"}.items():
        _write(box / rel, text)
    (box / "etc/sudoers.d/from-a").unlink()
    rules = tmp_path / "host-paths"
    rules.write_text(f"""# the defaults, re-rooted at the test box
host {box}/etc/hostname
accounts {box}/etc/passwd
accounts {box}/etc/group
prefer-host {box}/etc/sudoers.d
merge {box}/root/.ssh/authorized_keys
host {box}/usr/lib/libcuda.so*
host {box}/usr/lib/libnvidia-*.so*
host {box}/usr/bin/nvidia-smi
""")
    try:
        in_namespace(env, f"""
            {OGREFS} mount {snap} / --no-host-paths --host-paths-file {rules} > {tmp_path}/mount.out
            test "$(cat {box}/etc/hostname)" = "box-b"                       # identity: this box's
            test "$(cat {box}/usr/lib/libcuda.so.1)" = "cuda 550"            # driver: this box's
            test "$(cat {box}/usr/bin/nvidia-smi)" = "smi 550"
            test ! -e {box}/usr/lib/libnvidia-ml.so.1                        # A's driver library: not here
            test "$(cat {box}/usr/lib/libcudart.so.12)" = "toolkit from A"   # the toolkit: the snapshot's
            test "$(cat {box}/usr/bin/app)" = "A app"
            grep -qx "debian:x:1000:1000::/home/debian:/bin/bash" {box}/etc/passwd # B's login is added ...
            fails grep -q "^alice:" {box}/etc/passwd                              # ... A's of its uid gives way
            grep -qx "root:x:0:0::/root:/bin/bash" {box}/etc/passwd                # system accounts: A's
            grep -qx "sudo:x:27:debian" {box}/etc/group                           # B's user keeps sudo
            grep -qx "ssh-ed25519 KEY-A a@a" {box}/root/.ssh/authorized_keys       # keys: both sides
            grep -qx "ssh-ed25519 KEY-B provider" {box}/root/.ssh/authorized_keys
            test "$(stat -c %a {box}/root/.ssh)" = "700"
            test "$(cat {box}/etc/sudoers.d/common)" = "B"                   # sudoers.d: B's files win ...
            test "$(cat {box}/etc/sudoers.d/from-b)" = "B only"
            test "$(cat {box}/etc/sudoers.d/from-a)" = "A only"              # ... A's others stay
            echo "edited" > {box}/etc/motd                                    # still writable
            {OGREFS} unmount /
            test "$(cat {box}/etc/hostname)" = "box-b"
            test "$(cat {box}/root/.ssh/authorized_keys)" = "ssh-ed25519 KEY-B provider"
        """)
    finally:
        _kill_leftovers(tmp_path / "run" / "mounts")
    said = (tmp_path / "mount.out").read_text()
    assert f"{box}/etc/hostname" in said and f"{box}/etc/passwd (merged)" in said and "libcuda.so.1" in said
    assert "the snapshot's alice gives its uid to this box's debian" in said


def test_run_enters_the_snapshot_box_in_a_private_namespace_and_passes_the_exit_code(whole):
    box, tmp, snap = whole["box"], whole["tmp"], whole["snap"]
    env = dict(whole["env"], OGREFS_RUN_DIR=str(tmp / "runs"))
    rules = tmp / "host-paths"
    rules.write_text(f"host {box}/usr/bin/tool\n")  # a host-owned path that this box lacks: hidden
    base = [sys.executable, "-m", "ogrefs", "run", snap, "--no-host-paths", "--host-paths-file", str(rules), "--"]
    script = (f"test \"$(cat {box}/usr/marker)\" = snap && test ! -e {box}/usr/bin/tool && "
              f"test -e /proc/self/status && test -c /dev/null && ! grep -q ' {box}/usr ' /proc/self/mountinfo && "
              f"echo inside > {box}/var/lib/app/from-run && exit 7")
    (box / "usr/bin/tool").unlink()
    proc = subprocess.run(base + ["sh", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 7, proc.stderr
    assert not (box / "var/lib/app/from-run").exists()      # writes stayed in the snapshot's box ...
    proc = subprocess.run(base + ["cat", f"{box}/var/lib/app/from-run"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout == "inside\n", proc.stderr   # ... and are there next time
    assert (box / "usr/marker").read_text() == "host\n"
    with open("/proc/self/mountinfo") as fh:
        assert str(tmp / "runs") not in fh.read()           # nothing of it reached this namespace
    assert not list((tmp / "run" / "mounts").glob("*[0-9a-f].json"))   # and every daemon is gone


def test_writable_state_accessor_describes_a_live_mount(whole):
    box, tmp, snap = whole["box"], whole["tmp"], whole["snap"]
    in_namespace(whole["env"], f"""
        {OGREFS} mount {snap} / --no-materialize
        {PY} -c "
import json; from ogrefs.box.records import registered_mounts, writable_state
print(json.dumps([writable_state(i) for i in registered_mounts()]))" > {tmp}/state.json
        {OGREFS} unmount /
    """)
    [st] = json.loads((tmp / "state.json").read_text())
    assert st["snapshot"] == snap and st["target"] == "/" and not st["finalized"] and st["pid"] and st["keeper_pid"]
    assert sorted(o["target"] for o in st["overlays"]) == [str(box / d) for d in ("mnt", "usr", "var")]
    assert all(o["lower"].startswith(st["state_dir"] + "/lower") for o in st["overlays"])
    var = next(o for o in st["overlays"] if o["target"] == str(box / "var"))
    assert str(box / "var/lib/ogrefs/mounts") in var["binds"] or any(
        st["state_dir"].startswith(b) for b in var["binds"])


def test_sigterm_to_the_whole_unit_takes_the_box_down_cleanly(whole):
    """As systemd stops the unit after a busy unmount: SIGTERM to the keeper and the daemon at once."""
    box, tmp, snap = whole["box"], whole["tmp"], whole["snap"]
    in_namespace(whole["env"], f"""
        {OGREFS} mount {snap} / --no-materialize
        echo kept > {box}/var/lib/app/written
        cd {box}/usr                                          # another process keeps the overlay busy
        sleep 300 &                                           # (forked here, so its cwd is in the overlay) ...
        holder=$!
        cd /
        fails {OGREFS} unmount / 2> {tmp}/busy.err           # ... so unmount refuses, all or nothing
        grep -q " {box}/usr " /proc/self/mountinfo
        grep -q " {box}/var " /proc/self/mountinfo
        pid={_pid(tmp)}
        keeper={_pid(tmp, 'keeper_pid')}
        kill -TERM "$pid" "$keeper"
        for i in $(seq 300); do kill -0 "$keeper" 2>/dev/null || kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fails kill -0 "$pid" 2>/dev/null
        fails kill -0 "$keeper" 2>/dev/null
        kill "$holder"
        {none_mounted(tmp, OVERLAY)}
        {none_mounted(tmp, FUSE)}
        test "$(cat {box}/usr/marker)" = "host"
        {OGREFS} mount {snap} / --no-materialize
        test "$(cat {box}/var/lib/app/written)" = "kept"
        {OGREFS} unmount /
    """)
    err = (tmp / "busy.err").read_text()
    assert "in use by" in err and "sleep (cwd " in err and "nothing was changed" in err and "--lazy" in err
    assert len(err.strip().splitlines()) == 1


def test_run_shows_this_box_disks_inside_the_root(whole):
    box, tmp, snap = whole["box"], whole["tmp"], whole["snap"]
    env = dict(whole["env"], OGREFS_RUN_DIR=str(tmp / "runs"))
    (tmp / "disk").mkdir()
    in_namespace(env, f"""
        mount -t tmpfs data-disk {tmp}/disk
        echo "on this box's disk" > {tmp}/disk/f
        test "$({OGREFS} run {snap} --no-host-paths -- cat {tmp}/disk/f)" = "on this box's disk"
        grep -q " {tmp}/disk " /proc/self/mountinfo                 # still mounted here afterwards
    """)


def test_daemon_stopped_after_its_keeper_was_killed_still_takes_the_box_down(whole):
    box, tmp, snap = whole["box"], whole["tmp"], whole["snap"]
    in_namespace(whole["env"], f"""
        {OGREFS} mount {snap} / --no-materialize
        pid={_pid(tmp)}
        keeper={_pid(tmp, 'keeper_pid')}
        kill -9 "$keeper"
        kill -TERM "$pid"
        for i in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fails kill -0 "$pid" 2>/dev/null
        {none_mounted(tmp, OVERLAY)}                            # no overlay left on a dead lower
        {none_mounted(tmp, FUSE)}
        test "$(cat {box}/usr/marker)" = "host"
        {OGREFS} mount {snap} / --no-materialize
        {OGREFS} unmount /
    """)
