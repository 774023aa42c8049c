"""Unmount and finalize of a whole box that fail half way: never half the snapshot's, half the box's (tier 5).

Each test forces a real fault in the middle of the per-directory loop (the
``whole`` fixture's box has three overlays: mnt, usr, var, in that order;
unmount goes in reverse), then checks what a user would: a non-zero exit
with one line naming the cause, every overlay exactly as it was mounted
before (target, layers, options, from mountinfo), ``overlays.json`` (the
state ``ogrefs mounts``, ``snapshot`` and ``finalize`` read) saying the
same, the box's writes still there, and a retry after the fault is removed
succeeding. The faults:

- unmount: this box mounted a disk inside ``/usr`` after the mount, so
  ``umount /usr`` is busy with no process holding it (nothing for the up-front
  holder check to find); ``/var`` was already down and must come back.
- finalize: the local copy of ``/usr`` sits two overlays deep, so the kernel
  refuses the new ``/usr`` overlay (maximum stacking depth) after ``/mnt`` was
  already swapped; ``/mnt`` must go back over the FUSE lower, with the disk
  this box mounted inside it after the mount (detaching the old overlay
  detached it too) still there, as after the retry's finalize.
- finalize: ``chattr +i`` on ``/usr``'s work directory: the kernel would mount
  that overlay read-only (saying so only in dmesg), and the old one could not
  be mounted again from the same work directory either; refused before
  anything is touched.
"""

from __future__ import annotations

import json
import shutil

import pytest

from .test_box_mount import OGREFS, PY, in_namespace, whole  # noqa: F401  (whole is a fixture)
from tests.nsbox import FUSE, OVERLAY, none_mounted

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.timeout(240),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing"),
]

#: Each overlay of this namespace as "target super-options" (lowerdir, upperdir, workdir, rw/ro), sorted;
#: without ``uuid=``, which the kernel picks from what it finds in the upper directory (a remount differs).
OVERLAYS = ("awk '{for (i = 1; i <= NF; i++) if ($i == \"-\" && $(i+1) == \"overlay\") print $5, $(i+3)}' "
            "/proc/self/mountinfo | sed -E 's/,uuid=[a-z]+//' | sort")
#: The mount's state (overlays.json through the accessor `ogrefs snapshot` and `ogrefs mounts` use).
STATE = (f"{PY} -c \"import json; from ogrefs.box.records import registered_mounts, writable_state; "
         f"print(json.dumps([writable_state(i) for i in registered_mounts()]))\"")
#: The state directory of the one mount.
STATE_DIR = f"$({STATE} | {PY} -c \"import json,sys; print(json.load(sys.stdin)[0]['state_dir'])\")"


def _assert_as_before(tmp, box, lower: str) -> None:
    """Mountinfo after the failure equals mountinfo before; overlays.json says the same, over ``lower``."""
    before, after = (tmp / "before.txt").read_text(), (tmp / "after.txt").read_text()
    assert after == before, f"before:\n{before}\nafter:\n{after}"
    targets = [str(box / d) for d in ("mnt", "usr", "var")]
    ours = [line for line in after.splitlines() if line.split()[0] in targets]
    assert len(ours) == 3 and all(" rw," in line for line in ours), after
    [st] = json.loads((tmp / "state.json").read_text())
    assert not st["finalized"]
    assert sorted(o["target"] for o in st["overlays"]) == targets
    assert all(o["lower"].startswith(st["state_dir"] + "/" + lower) for o in st["overlays"]), st["overlays"]
    for o in st["overlays"]:  # the state names the layer the kernel really has under each target
        line = next(ln for ln in ours if ln.startswith(o["target"] + " "))
        assert f"lowerdir={o['lower']}" in line, (o, line)


def _assert_one_line(err: str, *words: str) -> None:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert all(w in err for w in words), err


def test_unmount_busy_half_way_puts_back_what_went_down(whole):
    box, tmp, snap = whole["box"], whole["tmp"], whole["snap"]
    in_namespace(whole["env"], f"""
        {OGREFS} mount {snap} / --no-materialize
        echo kept > {box}/var/lib/app/written
        mkdir -p {box}/usr/disk && mount -t tmpfs later-disk {box}/usr/disk   # mounted after the mount
        {OVERLAYS} > {tmp}/before.txt
        fails {OGREFS} unmount / 2> {tmp}/unmount.err     # var goes first, then usr is busy
        {OVERLAYS} > {tmp}/after.txt
        {STATE} > {tmp}/state.json
        test "$(cat {box}/usr/marker)" = "snap"
        test "$(cat {box}/var/lib/app/written)" = "kept"    # var is back, with the box's writes
        {OGREFS} status / > {tmp}/status.txt                # the daemon still serves
        umount {box}/usr/disk                               # the fault removed: the retry works
        {OGREFS} unmount /
        {none_mounted(tmp, OVERLAY)}
        test "$(cat {box}/usr/marker)" = "host"
        {OGREFS} mount {snap} / --no-materialize
        test "$(cat {box}/var/lib/app/written)" = "kept"
        {OGREFS} unmount /
    """)
    _assert_one_line((tmp / "unmount.err").read_text(), f"{box}/usr: target is busy",
                     f"{box}/usr/disk was mounted inside it", "nothing was unmounted")
    _assert_as_before(tmp, box, "lower")
    assert "finalized" not in (tmp / "status.txt").read_text()


def test_finalize_refused_by_the_kernel_half_way_swaps_back_what_it_swapped(whole):
    box, tmp, snap = whole["box"], whole["tmp"], whole["snap"]
    in_namespace(whole["env"], f"""
        {OGREFS} mount {snap} /
        timeout 60 {OGREFS} status / --wait > /dev/null
        echo kept > {box}/var/lib/app/written
        mkdir -p {box}/mnt/later && mount -t tmpfs later-disk {box}/mnt/later   # a disk mounted after the mount
        echo on the disk > {box}/mnt/later/f
        state={STATE_DIR}
        copy="$state/tree{box}/usr"                         # the local copy of usr, two overlays deep
        mkdir -p {tmp}/fault/{{u1,w1,u2,w2}}
        mount -t overlay fault1 -o lowerdir="$copy",upperdir={tmp}/fault/u1,workdir={tmp}/fault/w1 "$copy"
        mount -t overlay fault2 -o lowerdir="$copy",upperdir={tmp}/fault/u2,workdir={tmp}/fault/w2 "$copy"
        {OVERLAYS} > {tmp}/before.txt
        fails {OGREFS} finalize / 2> {tmp}/finalize.err    # mnt swapped, then usr refused
        {OVERLAYS} > {tmp}/after.txt
        cat {tmp}/finalize.err {tmp}/after.txt >&2          # shown if a later step fails
        {STATE} > {tmp}/state.json
        {OGREFS} status / > {tmp}/status.txt
        test "$(cat {box}/var/lib/app/written)" = "kept"
        test "$(cat {box}/mnt/later/f)" = "on the disk"     # mnt went back with the disk inside it
        echo still writable > {box}/mnt/after-failure
        umount "$copy" && umount "$copy"                    # the fault removed: the retry works
        {OGREFS} finalize /
        {none_mounted(tmp, FUSE)}
        test "$(cat {box}/mnt/after-failure)" = "still writable"
        test "$(cat {box}/usr/marker)" = "snap"
        test "$(cat {box}/mnt/later/f)" = "on the disk"     # the finalized mnt keeps the disk too
        fails {OGREFS} unmount / 2> {tmp}/unmount.err      # it is the box's: unmount names it, takes nothing
        umount {box}/mnt/later
        {OGREFS} unmount /
    """)
    _assert_one_line((tmp / "finalize.err").read_text(), f"cannot finalize: overlay at {box}/usr failed",
                     "nothing was changed")
    _assert_one_line((tmp / "unmount.err").read_text(), f"{box}/mnt/later was mounted inside it",
                     "nothing was unmounted")
    _assert_as_before(tmp, box, "lower")
    assert "finalized" not in (tmp / "status.txt").read_text()


def test_finalize_with_an_unusable_work_directory_is_refused_before_anything_changes(whole):
    box, tmp, snap = whole["box"], whole["tmp"], whole["snap"]
    if shutil.which("chattr") is None:
        pytest.skip("e2fsprogs chattr missing")
    in_namespace(whole["env"], f"""
        {OGREFS} mount {snap} /
        timeout 60 {OGREFS} status / --wait > /dev/null
        work=$({STATE} | {PY} -c "import json,sys; print(next(o['work'] for o in json.load(sys.stdin)[0]['overlays'] \
if o['target'].endswith('/usr')))")
        trap 'chattr -i "$work" 2>/dev/null || true' EXIT   # never leave an immutable directory behind
        chattr +i "$work"
        {OVERLAYS} > {tmp}/before.txt
        fails {OGREFS} finalize / 2> {tmp}/finalize.err
        {OVERLAYS} > {tmp}/after.txt
        {STATE} > {tmp}/state.json
        echo still writable > {box}/usr/after-failure
        chattr -i "$work"                                   # the fault removed: the retry works
        {OGREFS} finalize /
        {none_mounted(tmp, FUSE)}
        if {OVERLAYS} | grep -v " rw,"; then echo "an overlay is read-only" >&2; exit 1; fi  # none silently ro
        echo written > {box}/usr/after-finalize
        test "$(cat {box}/usr/after-failure)" = "still writable"
        {OGREFS} unmount /
    """)
    _assert_one_line((tmp / "finalize.err").read_text(), f"cannot finalize: {box}/usr: its work directory",
                     "not usable", "nothing was changed")
    _assert_as_before(tmp, box, "lower")


def test_finalize_is_recorded_while_the_daemon_still_serves(whole):
    """swap_lowers hands the new overlays to its caller while the FUSE lower still serves.

    Detaching the lower ends the daemon; its keeper then takes down every
    overlay of a mount whose registration does not say finalized. finalize
    recorded that only after swap_lowers returned (which had detached the
    lower), so under load the keeper sometimes won: the finalized box lost
    its overlays (and showed the box's own directories) right after
    "finalized" was printed. The callback is where finalize records it;
    this checks it runs while the lower is still mounted and the daemon
    still lives, every time; the lower is detached only after swap_lowers
    returns (finalize's last steps, after the record).
    """
    box, tmp, snap = whole["box"], whole["tmp"], whole["snap"]
    in_namespace(whole["env"], f"""
        {OGREFS} mount {snap} /
        timeout 60 {OGREFS} status / --wait > /dev/null
        state={STATE_DIR}
        timeout 60 {PY} - "$state" > {tmp}/seen.json <<'PY'
import json, os, sys
from pathlib import Path
from ogrefs.box.records import load_overlays, registered_mounts
from ogrefs.box import swap
from ogrefs.box.mountsys import mounted_fstype

state = Path(sys.argv[1])
info = registered_mounts()[0]
seen = []
def swapped_all(new):
    seen.append({{"lower": mounted_fstype(state / "lower"), "daemon": os.path.exists(f"/proc/{{info['pid']}}"),
                  "targets": sorted(o.target for o in new)}})
swap.swap_lowers(state, load_overlays(state), info.get("own_directories") or [], stage=state.parent / "stage",
                 swapped_all=swapped_all)
seen.append({{"lower_after": mounted_fstype(state / "lower")}})
print(json.dumps(seen))
PY
    """)
    seen = json.loads((tmp / "seen.json").read_text())
    assert len(seen) == 2, seen
    assert (seen[0]["lower"] or "").startswith("fuse") and seen[0]["daemon"], seen
    assert seen[0]["targets"] == sorted(str(box / d) for d in ("mnt", "usr", "var")), seen
    assert (seen[1]["lower_after"] or "").startswith("fuse"), seen  # detached by finalize, after the record
