"""``ogrefs mounts`` and mount targets, through the real entry point, in private mount namespaces."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.cli_run import assert_one_line_error, run_in  # noqa: F401
from tests.nsbox import OGREFS, box, in_namespace  # noqa: F401  (box is a fixture)

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not os.path.exists("/dev/fuse") and not os.environ.get("CI"), reason="no /dev/fuse here"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing"),
]


def test_mounts_lists_state_with_sizes_and_removes_only_what_no_mount_uses(box):
    proj, tmp, snap = box["proj"], box["tmp"], box["snap"]
    ro = tmp / "browse"
    ro.mkdir()
    in_namespace(box, f"""
        mount -t tmpfs fresh-box {proj.parent}
        {OGREFS} mount {snap} / --json > {tmp}/mount.json
        {OGREFS} mount --read-only {snap[:10].upper()} {ro} --json > {tmp}/mount-ro.json
        {OGREFS} status / --wait > /dev/null
        {OGREFS} mounts --json > {tmp}/live.json
        {OGREFS} mounts > {tmp}/live.txt
        state=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["state_dir"])' {tmp}/mount.json)
        fails {OGREFS} mounts --remove "$state" 2> {tmp}/refused.txt
        fails {OGREFS} mounts --remove / 2> {tmp}/refused-target.txt
        {OGREFS} unmount {ro} --json > {tmp}/unmount-ro.json
        {OGREFS} unmount /
        {OGREFS} mounts --json > {tmp}/after.json
        {OGREFS} mounts --remove "$state" --json > {tmp}/removed.json
        test ! -e "$state"
        {OGREFS} mounts --json > {tmp}/gone.json
    """)
    mounted = json.loads((tmp / "mount.json").read_text())
    assert mounted["read_only"] is False and mounted["state_dir"]
    mounted_ro = json.loads((tmp / "mount-ro.json").read_text())  # a prefix in capitals: named by its full id
    assert mounted_ro["read_only"] is True and mounted_ro["snapshot"] == snap == mounted["snapshot"]
    assert mounted_ro["selector"] == snap[:10].upper()
    live = {m["target"]: m for m in json.loads((tmp / "live.json").read_text())}
    assert live["/"]["state"] == "mounted" and live["/"]["writable"] and live["/"]["snapshot"] == snap
    assert live["/"]["state_dir"] == mounted["state_dir"]
    assert live["/"]["sizes"]["tree"] > 1_000_000  # the local copy of the snapshot (status --wait: complete)
    assert live[str(ro)]["state"] == "mounted" and not live[str(ro)]["writable"] and live[str(ro)]["state_dir"] is None
    assert "local copy" in (tmp / "live.txt").read_text()
    for name in ("refused.txt", "refused-target.txt"):
        lines = (tmp / name).read_text().strip().splitlines()
        assert len(lines) == 1 and "live mount" in lines[0], lines
    assert json.loads((tmp / "unmount-ro.json").read_text())["unmounted"] == str(ro)
    after = [m for m in json.loads((tmp / "after.json").read_text()) if m["state_dir"] == mounted["state_dir"]]
    assert len(after) == 1 and after[0]["state"] == "unmounted" and after[0]["sizes"]["total"] > 1_000_000
    assert json.loads((tmp / "removed.json").read_text()) == {"removed": mounted["state_dir"]}
    assert not [m for m in json.loads((tmp / "gone.json").read_text()) if m["state_dir"] == mounted["state_dir"]]


def test_writable_and_read_only_mounts_both_refuse_a_missing_target(box):
    tmp, snap = box["tmp"], box["snap"]
    for mode in ([], ["--read-only"]):
        proc = in_namespace(box, f"{OGREFS} mount {snap} {tmp}/missing {' '.join(mode)}", check=False)
        assert proc.returncode == 2 and "does not exist" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        assert not (tmp / "missing").exists()


def test_a_read_only_mount_fetches_only_what_is_read(box):
    tmp = box["tmp"]
    site = tmp / "venv" / "lib" / "python3.11" / "site-packages" / "pkg"
    site.mkdir(parents=True)
    (tmp / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.11.2\n")
    (site / "__init__.py").write_text("x = 1\n" * 50_000)
    out = subprocess.run([sys.executable, "-m", "ogrefs", "snapshot", "--json", str(tmp / "venv")], env=box["env"],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    snap = json.loads(out)["id"]
    hinted = json.loads(subprocess.run([sys.executable, "-m", "ogrefs", "show", "--json", snap], env=box["env"],
                                       check=True, capture_output=True, text=True, timeout=120).stdout)
    assert hinted["environment"]["hint_counts"]["python"] >= 1  # precondition: there is something to prefetch
    (tmp / "ro").mkdir()
    in_namespace(box, f"""
        {OGREFS} mount --read-only {snap} {tmp}/ro
        sleep 1
        {OGREFS} status {tmp}/ro --json > {tmp}/idle.json
        fails {OGREFS} status {tmp}/ro --wait 2> {tmp}/wait.txt
        {OGREFS} unmount {tmp}/ro
        {OGREFS} mount --read-only --prefetch {snap} {tmp}/ro
        {OGREFS} status {tmp}/ro --wait --json > {tmp}/warm.json
        {OGREFS} unmount {tmp}/ro
    """)
    idle = json.loads((tmp / "idle.json").read_text())
    assert idle["bytes_fetched"] == 0 and idle["materialize"]["state"] == "off"
    assert "fetches only what is read" in (tmp / "wait.txt").read_text()
    warm = json.loads((tmp / "warm.json").read_text())
    assert warm["bytes_fetched"] > 0  # asked for: the hints were fetched without a read


def test_status_lines_on_a_terminal_have_no_full_bar_for_an_empty_class_and_keep_words_apart():
    from ogrefs.cli.mount import _prefetch_lines

    m = {"mode": "cache", "state": "done", "complete": False, "bytes_done": 10, "bytes_total": 20, "rate_bps": 0,
         "classes": {"trace": {"bytes_done": 0, "bytes_total": 0}, "hint": {"bytes_done": 10, "bytes_total": 20}}}
    lines = _prefetch_lines(m, tty=True)
    assert "prefetched into the cache done" in " ".join(lines[0].split())
    trace = [line for line in lines if line.strip().startswith("trace")][0]
    assert "#" not in trace and "[" not in trace
    hint = [line for line in lines if line.strip().startswith("hint")][0]
    assert "[############............]" in hint


def test_a_broken_pyfuse3_is_one_line_for_mount_and_run(box):
    """A pyfuse3 that imports but has nothing in it (a directory left without its compiled module, here one
    that shadows the real install) was an AttributeError traceback from `mount` and no word at all from
    `run`, whose child ended with os._exit (seen on a GPU box whose pyfuse3 had failed to link)."""
    tmp = box["tmp"]
    shadow = tmp / "shadow" / "pyfuse3"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    env = dict(box["env"], PYTHONPATH=os.pathsep.join(filter(None, [str(shadow.parent), os.environ.get("PYTHONPATH")])))
    mp = tmp / "ro"
    mp.mkdir()
    for args in (["mount", "--read-only", box["snap"], str(mp)], ["run", box["snap"], "--", "true"]):
        proc = subprocess.run([sys.executable, "-m", "ogrefs", *args], env=env, capture_output=True, text=True,
                              timeout=120)
        assert_one_line_error(proc, f"FUSE support is broken: pyfuse3 in {shadow}")
        assert "AttributeError" in proc.stderr
    assert os.listdir(mp) == []


def test_an_unexpected_error_in_the_child_of_run_is_reported(capfd):
    """The child that enters the box ends with os._exit: an exception no handler names must still be said."""
    from ogrefs.mount.run import run

    def open_repo():
        raise RuntimeError("boom in the child")

    code = run(lambda root: None, open_repo, lambda repo: "x", ["true"])
    err = capfd.readouterr().err
    assert code == 1
    assert "internal error in the child that enters the box" in err and "RuntimeError: boom in the child" in err
