"""Top-level files of a whole-box snapshot at / (topfiles.py), on a stand-in root in a private namespace."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.nsbox import SCRIPT_HEAD

from ..killsteps import KILLER

pytestmark = [pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                 reason="needs root and unshare (bind mounts)")]


def test_files_this_box_lacks_appear_and_go_and_its_own_stay(tmp_path):
    lower, root, state = tmp_path / "lower", tmp_path / "root", tmp_path / "state"
    for d in (lower, root, state):
        d.mkdir()
    (lower / "README").write_text("from the snapshot\n")
    (lower / "swapfile").write_text("A's swap\n")
    (root / "swapfile").write_text("B's swap\n")
    (root / "vmlinuz").symlink_to("boot/vmlinuz-B")
    script = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from ogrefs.box import topfiles
        entries = [{{"name": "README", "kind": "file", "target": ""}},
                   {{"name": "swapfile", "kind": "file", "target": ""}},
                   {{"name": "lib64", "kind": "symlink", "target": "usr/lib64"}},
                   {{"name": "vmlinuz", "kind": "symlink", "target": "boot/vmlinuz-A"}}]
        shown = topfiles.show(entries, Path({str(lower)!r}), Path({str(state)!r}), root={str(root)!r})
        assert sorted(shown) == [{str(root / "README")!r}, {str(root / "lib64")!r}], shown
        assert open({str(root / "README")!r}).read() == "from the snapshot\\n"
        assert open({str(root / "swapfile")!r}).read() == "B's swap\\n"
        assert os.readlink({str(root / "lib64")!r}) == "usr/lib64"
        assert os.readlink({str(root / "vmlinuz")!r}) == "boot/vmlinuz-B"
        try:
            open({str(root / "README")!r}, "w")
            raise SystemExit("the shown file is writable")
        except OSError:
            pass
        topfiles.hide(Path({str(state)!r}))
        assert sorted(os.listdir({str(root)!r})) == ["swapfile", "vmlinuz"], os.listdir({str(root)!r})
        print("ok")
    """)
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert (root / "swapfile").read_text() == "B's swap\n"


def test_finalize_rebinds_each_file_showing_its_bytes_at_every_kill_point(tmp_path):
    """``finalize`` binds the local copy's files in place of the FUSE lower's: killed before any step
    (tests/killsteps.py), each file still shows the snapshot's bytes, read-only; run again, each shows
    the local copy's; hidden, nothing is left. Before: killed between the unmount and the bind, the
    file was the empty placeholder until finalize was run again (issue 46)."""
    lower, tree, root, state = (tmp_path / d for d in ("lower", "tree", "root", "state"))
    for d in (lower, tree, root, state):
        d.mkdir()
    for name, text in (("README", "from the snapshot\n"), ("notes.txt", "notes\n")):
        (lower / name).write_text(text)  # stands for the FUSE lower
        (tree / name).write_text(text)   # the local copy
    (tmp_path / "killer.py").write_text(KILLER)
    entries = [{"name": "README", "kind": "file", "target": ""}, {"name": "notes.txt", "kind": "file", "target": ""}]
    call = f"from pathlib import Path; from ogrefs.box import topfiles; topfiles.%s"
    show = call % f"show({entries!r}, Path({str(lower)!r}), Path({str(state)!r}), root={str(root)!r})"
    rebind = call % f"rebind(Path({str(state)!r}), Path({str(tree)!r}))"
    shown = f"""test "$(cat {root}/README)" = "from the snapshot" && test "$(cat {root}/notes.txt)" = notes \
        && ! sh -c 'echo x >> {root}/README' 2> /dev/null"""
    def killed_at(k: int) -> list[str]:
        steps = tmp_path / f"steps-{k}.txt"
        script = SCRIPT_HEAD + f"""
            {sys.executable} -c {shlex.quote(show)}
            rc=0; KILL_AT={k} KILL_LOG={steps} {sys.executable} {tmp_path}/killer.py -c {shlex.quote(rebind)} || rc=$?
            test $rc = {137 if k else 0}
            {shown} || {{ echo "killed before step {k}: a file does not show the snapshot's bytes" >&2; exit 1; }}
            {sys.executable} -c {shlex.quote(rebind)}
            {shown} || {{ echo "rebound: a file does not show the snapshot's bytes, read-only" >&2; exit 1; }}
            test "$(stat -c %d:%i {root}/README)" = "$(stat -c %d:%i {tree}/README)"
            test "$(stat -c %d:%i {root}/notes.txt)" = "$(stat -c %d:%i {tree}/notes.txt)"
            {sys.executable} -c {shlex.quote(call % f"hide(Path({str(state)!r}))")}
            test -z "$(ls -A {root})"
            fails grep -F " {root}/" /proc/self/mountinfo
        """
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", script],
                              capture_output=True, text=True, timeout=60)
        done = steps.read_text().splitlines()
        assert proc.returncode == 0, (k, done[k - 1:k], proc.stderr)
        return done

    steps = killed_at(0)  # a whole run: counts the steps
    assert len(steps) >= 4, steps  # each file: the local copy's put in place, the old one detached
    for k in range(1, len(steps) + 1):
        killed_at(k)
