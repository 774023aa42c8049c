"""The rescue script (box/rescue.py): detach overlays with this box's umount through its own loader."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from ogrefs.box import rescue

pytestmark = [pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                 reason="needs root and unshare (bind mounts, overlayfs)")]

SCRIPT = textwrap.dedent('''
    import os, subprocess, sys
    from pathlib import Path
    from ogrefs.box import mountsys, overlay, rescue
    t = sys.argv[1]
    for d in ("l", "u", "w", "m", "run"):
        os.makedirs(f"{t}/{d}", exist_ok=True)
    r = rescue.prepare(Path(f"{t}/run/rescue/k"))
    assert r is not None
    mountsys.overlay(f"{t}/m", f"lowerdir={t}/l,upperdir={t}/u,workdir={t}/w")
    o = overlay.Overlay(f"{t}/m", f"{t}/l", f"{t}/u", f"{t}/w", True)
    rescue.write_script(r, "/", [o], [], f"{t}/no-lower", f"{t}/no-host")
    # PATH empty: the script may start no program by name, only the loader by its path in the bind
    res = subprocess.run(["/bin/sh", "-c", f". {t}/run/rescue/k/detach.sh"], env={"PATH": "/nonexistent"},
                         capture_output=True, text=True)
    print(res.stdout.strip())
    print(f" {t}/m " in open("/proc/self/mounts").read())
    rescue.remove(Path(r.directory))
    print(os.path.exists(r.directory))
''')


def test_the_rescue_script_detaches_an_overlay_using_only_the_bind_of_usr(tmp_path):
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", SCRIPT,
                          str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["ogrefs: detached; now run: ogrefs unmount /", "False", "False"]
    assert os.path.exists("/usr/bin/umount") or os.path.exists("/bin/umount")  # the box's own /usr untouched


def test_elf_interpreter_of_this_box_umount():
    umount = next(u for u in rescue.UMOUNTS if os.path.isfile(u))
    interp = rescue.elf_interpreter(umount)
    assert interp and interp.startswith("/") and "ld-linux" in interp
    assert rescue.elf_interpreter(__file__) is None
