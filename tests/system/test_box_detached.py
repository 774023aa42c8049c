"""A remount while processes started on a lazily unmounted tree still run (tier 5).

``ogrefs unmount --lazy /`` (the shipped unit's ExecStop) detaches the
overlays; the processes started on them keep the snapshot's files, served by
the old daemon, which holds the state directory's lock until the last of
them exits. It and its overlays still write the upper directories and the
local copy, so a second mount of the same state directory (``systemctl
start`` again) would be a second writer: it is refused after the bounded
wait, with one line naming those processes and what to do, and nothing
mounted; once they are gone, the mount resumes with every write.
"""

from __future__ import annotations

import shutil

import pytest

from .test_box_mount import OGREFS, _pid, in_namespace, whole  # noqa: F401  (whole is a fixture)
from tests.nsbox import OVERLAY, none_mounted

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.timeout(240),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing"),
]


def test_remount_while_the_old_tree_is_in_use_is_refused_naming_its_users(whole):
    box, tmp, snap = whole["box"], whole["tmp"], whole["snap"]
    in_namespace(whole["env"], f"""
        {OGREFS} mount {snap} / --no-materialize
        echo kept > {box}/var/lib/app/written
        cd {box}/usr
        sleep 300 &                                       # started on the old tree (its cwd is there)
        holder=$!
        cd /
        pid={_pid(tmp)}
        {OGREFS} unmount --lazy / 2> {tmp}/lazy.err       # detached; the daemon goes on serving the holder
        kill -0 "$pid"
        fails {OGREFS} mount {snap} / --no-materialize > {tmp}/remount.out 2> {tmp}/remount.err
        echo "$holder" > {tmp}/holder.txt
        {none_mounted(tmp, OVERLAY)}                       # the refused mount touched nothing
        test "$(cat {box}/usr/marker)" = "host"
        kill "$holder"; wait "$holder" || true            # the old tree's last user leaves ...
        {OGREFS} mount {snap} / --no-materialize          # ... and the mount resumes
        test "$(cat {box}/var/lib/app/written)" = "kept"
        fails kill -0 "$pid" 2>/dev/null                 # the old daemon is gone
        {OGREFS} unmount /
    """)
    err = (tmp / "remount.err").read_text()
    holder = (tmp / "holder.txt").read_text().strip()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "unmounted lazily" in err and f"{holder} sleep (cwd {box}/usr)" in err, err
    assert "stop or restart them, then mount again" in err, err
