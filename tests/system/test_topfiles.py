"""Top-level files of a whole-box snapshot at / (topfiles.py), on a stand-in root in a private namespace."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

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
