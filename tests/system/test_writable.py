"""Writable mounts at the original paths, inside private mount namespaces (tier 5).

Each test runs a shell script under ``unshare --mount --propagation private``:
it hides the source tree with a tmpfs (a fresh box has nothing there), mounts
the snapshot at ``/`` and checks what a user would. Nothing leaks into the
host's mount table; the namespace dies with its last process, and teardown
kills any daemon a failed test left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.treegen import compare_trees
from tests.nsbox import FUSE, OGREFS, OURS, box, in_namespace, none_mounted  # noqa: F401  (box is a fixture)
from tests import REPO_ROOT

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not os.path.exists("/dev/fuse") and not os.environ.get("CI"), reason="no /dev/fuse here"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing"),
]

def test_mount_at_original_paths_writes_land_locally_and_resume(box):
    proj, tmp, snap = box["proj"], box["tmp"], box["snap"]
    copy = tmp / "expected"
    subprocess.run(["cp", "-a", str(proj), str(copy)], check=True)  # keeps FIFOs, devices, xattrs, times
    in_namespace(box, f"""
        mount -t tmpfs fresh-box {proj.parent}      # a fresh box: nothing at the original path
        {OGREFS} mount {snap} /
        grep -q "^{proj} " <(awk '{{print $5" "$9}}' /proc/self/mountinfo)
        {sys.executable} - <<'PY'
import sys; sys.path.insert(0, {str(REPO_ROOT)!r})
from tests.treegen import compare_trees
diffs = compare_trees({str(copy)!r}, {str(proj)!r}, check_holes=False)
assert diffs == [], diffs
PY
        echo "new checkpoint" > {proj}/written-after-restore
        echo "appended" >> {proj}/small.txt
        rm {proj}/random.bin
        {OGREFS} status / --json > {tmp}/status.json
        {OGREFS} unmount /
        {none_mounted(tmp, OURS)}
        {OGREFS} mount {snap} /                    # same state dir: resumes with every write
        test "$(cat {proj}/written-after-restore)" = "new checkpoint"
        tail -n1 {proj}/small.txt | grep -q appended
        test ! -e {proj}/random.bin
        {OGREFS} unmount /
    """)
    status = json.loads((tmp / "status.json").read_text())
    assert status["writable"] and status["overlays"] == [str(proj)]
    # writes went to the state directory, never to the snapshot or the source
    uppers = list((tmp / "state").glob("*/upper/0/written-after-restore"))
    assert len(uppers) == 1 and uppers[0].read_text() == "new checkpoint\n"
    assert compare_trees(copy, proj) == []


def test_existing_content_stays_visible_below_the_snapshot_with_merge_only(box):
    """A snapshot of a project directory at /: its directory exactly (issue 47: this box's newer files are
    not mixed into the snapshot's), this box's own beside it with --merge; the box's own back afterwards."""
    proj, snap = box["proj"], box["snap"]
    in_namespace(box, f"""
        mount -t tmpfs fresh-box {proj.parent}
        mkdir -p {proj}
        echo "from the new box" > {proj}/local-only
        echo "box version" > {proj}/small.txt
        {OGREFS} mount {snap} /
        test ! -e {proj}/local-only
        test "$(cat {proj}/small.txt)" = "hello ogrefs"   # the snapshot's copy
        {OGREFS} unmount /
        {OGREFS} mount --merge {snap} /
        test "$(cat {proj}/local-only)" = "from the new box"
        test "$(cat {proj}/small.txt)" = "hello ogrefs"   # the snapshot's copy is on top
        {OGREFS} unmount /
        test "$(cat {proj}/small.txt)" = "box version"    # and the box's own is back afterwards
    """)


def test_other_target_shows_the_roots_below_it(box):
    proj, tmp, snap = box["proj"], box["tmp"], box["snap"]
    target = tmp / "elsewhere"
    in_namespace(box, f"""
        mkdir -p {target}
        {OGREFS} mount {snap} {target}
        test "$(cat {target}{proj}/small.txt)" = "hello ogrefs"
        echo x > {target}{proj}/scratch
        {OGREFS} unmount {target}
    """)
    assert not (proj / "scratch").exists()


@pytest.mark.parametrize("target", ["/proc", "/sys/kernel", "/boot"])
def test_protected_targets_are_refused(box, target):
    proc = in_namespace(box, f"{OGREFS} mount {box['snap']} {target}", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("ogrefs: refusing to cover") and "--force" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_daemon_killed_then_remount_with_same_state_dir(box):
    proj, tmp, snap = box["proj"], box["tmp"], box["snap"]
    in_namespace(box, f"""
        mount -t tmpfs fresh-box {proj.parent}
        {OGREFS} mount {snap} /
        echo "survives" > {proj}/kept
        pid=$({sys.executable} -c "import json,sys; print(json.load(open(sys.argv[1]))['pid'])" {tmp}/run/mounts/*.status.json)
        kill -9 "$pid"
        {OGREFS} mount {snap} /                            # at once: it waits for the keeper's teardown
        test "$(cat {proj}/kept)" = "survives"
        {OGREFS} unmount /
        {OGREFS} mount {snap} /
        pid=$({sys.executable} -c "import json,sys; print(json.load(open(sys.argv[1]))['pid'])" {tmp}/run/mounts/*.status.json)
        kill -9 "$pid"
        sleep 0.5
        fails cat {proj}/small.txt 2>/dev/null           # the lower is gone ...
        {OGREFS} mount {snap} /                            # ... and a remount recovers
        test "$(cat {proj}/kept)" = "survives"
        test "$(cat {proj}/small.txt)" = "hello ogrefs"
        {OGREFS} unmount /
    """)


def test_lazy_unmount_with_a_file_held_open_then_remount(box):
    """A whole box cannot be unmounted while its own processes run from it; --lazy detaches and says so."""
    proj, tmp, snap = box["proj"], box["tmp"], box["snap"]
    out = in_namespace(box, f"""
        mount -t tmpfs fresh-box {proj.parent}
        {OGREFS} mount --no-materialize {snap} /
        echo "local write" > {proj}/kept
        sleep 600 3<{proj}/small.txt &                     # a process that still holds a file of the snapshot
        holder=$!
        fails {OGREFS} unmount / 2> {tmp}/busy.txt         # plain unmount: refused, naming the holder
        grep -q "in use by $holder sleep (file {proj}/small.txt); nothing was changed" {tmp}/busy.txt
        test "$(cat {proj}/small.txt)" = "hello ogrefs"
        {OGREFS} unmount --lazy /                          # detached: exit 0 although the daemon still serves
        fails test -e {proj}/small.txt                    # the box shows its own tree at once
        test "$(cat /proc/$holder/fd/3)" = "hello ogrefs"  # ... and the holder keeps its file
        kill $holder; wait $holder || true
        {OGREFS} mount --no-materialize {snap} /           # the old daemon exits once its last user left
        test "$(cat {proj}/kept)" = "local write"
        {OGREFS} unmount /
    """)
    assert "goes on serving" in out.stderr, out.stderr


def test_materialize_then_finalize_runs_without_daemon_or_store(box):
    proj, tmp, snap = box["proj"], box["tmp"], box["snap"]
    copy = tmp / "expected"
    subprocess.run(["cp", "-a", str(proj), str(copy)], check=True)
    in_namespace(box, f"""
        mount -t tmpfs fresh-box {proj.parent}
        {OGREFS} mount {snap} /
        echo "local work" > {proj}/notes.txt
        timeout 60 {OGREFS} status / --wait > {tmp}/status.txt   # returns once everything is local
        {OGREFS} finalize /
        mv {tmp}/repo {tmp}/repo-gone                 # the store is gone: nothing may need it now
        {none_mounted(tmp, FUSE)}     # no FUSE layer, no daemon
        {sys.executable} - <<'PY'
import sys; sys.path.insert(0, {str(REPO_ROOT)!r})
from tests.treegen import compare_trees
diffs = [d for d in compare_trees({str(copy)!r}, {str(proj)!r}) if "notes.txt" not in d]
assert diffs == [], diffs
PY
        test "$(cat {proj}/notes.txt)" = "local work"
        echo more >> {proj}/notes.txt                  # still writable
        {OGREFS} status / | grep -q finalized
        {OGREFS} unmount /
        {none_mounted(proj)}
        mv {tmp}/repo-gone {tmp}/repo
    """)
    text = (tmp / "status.txt").read_text()
    assert "materialized to local disk" in text and "complete" in text


def test_trace_recorded_by_one_mount_is_replayed_by_the_next(box):
    proj, tmp, snap = box["proj"], box["tmp"], box["snap"]
    in_namespace(box, f"""
        mount -t tmpfs fresh-box {proj.parent}
        {OGREFS} mount {snap} / --no-materialize
        cat {proj}/random.bin {proj}/dir/nested/deeper/leaf.py > /dev/null
        {OGREFS} unmount /                              # saves the trace of what was read
        rm -rf {tmp}/state {tmp}/cache                  # a fresh box again
        {OGREFS} mount {snap} / --no-materialize
        sleep 1
        {OGREFS} status / --json > {tmp}/status2.json
        {OGREFS} unmount /
    """)
    st = json.loads((tmp / "status2.json").read_text())
    assert st["trace_replayed"] >= 2
    assert st["materialize"]["classes"]["trace"]["bytes_done"] >= 3 * 1024 * 1024  # random.bin came first
    assert st["bytes_read"] == 0  # nobody read anything: the trace did the fetching


def test_permissions_other_users_see_only_what_the_source_allowed(box):
    """default_permissions: through the overlay at the original path, another user reads what the
    source let them read and nothing else; state and cache directories are private to root."""
    proj, tmp, snap = box["proj"], box["tmp"], box["snap"]
    # pytest's temporary directories are 0700: let the other user walk down to the box for this test
    ancestors = [p for p in [proj, *proj.parents] if p != Path("/")]
    modes = {p: p.stat().st_mode & 0o7777 for p in ancestors}
    try:
        for p in ancestors:
            os.chmod(p, modes[p] | 0o055)
        _check_other_user(box, proj, tmp, snap)
    finally:
        for p, mode in modes.items():
            os.chmod(p, mode)
    assert (tmp / "state-mode").read_text().strip() == "700"
    assert (tmp / "cache").stat().st_mode & 0o077 == 0


def _check_other_user(box, proj, tmp, snap):
    in_namespace(box, f"""
        mount -t tmpfs -o mode=755 fresh-box {proj.parent}
        {OGREFS} mount {snap} /
        # the other user reaches the box through a 0755 path of its own: pytest run by anyone on this machine
        # resets /tmp/pytest-of-root to 0700 at any moment, which would deny the walk there for other reasons
        alias=$(mktemp -d /tmp/ogrefs-perm.XXXXXX); chmod 755 $alias
        mount --rbind {proj.parent} $alias
        setpriv --reuid=65534 --regid=65534 --clear-groups cat $alias/{proj.name}/small.txt > /dev/null   # 0644: readable
        fails setpriv --reuid=65534 --regid=65534 --clear-groups cat $alias/{proj.name}/private 2>/dev/null   # 0600 root: not
        fails setpriv --reuid=65534 --regid=65534 --clear-groups ls {box['env']['OGREFS_STATE_DIR']}/* 2>/dev/null
        stat -c %a {box['env']['OGREFS_STATE_DIR']}/* > {tmp}/state-mode
        umount -l $alias && rmdir $alias
        {OGREFS} unmount /
    """)
