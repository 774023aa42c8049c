"""The no-FUSE mount (issue 48): a container without /dev/fuse and without CAP_SYS_ADMIN gets the box back.

Each container here is ``unshare --mount`` with a private ``/dev`` (a tmpfs with null, zero, urandom and no
fuse node) and ``capsh --drop=cap_sys_admin``: what a RunPod pod or a vast.ai instance is.

* ``ogrefs mount`` falls back by itself, says why in one line and which mode it chose; the tree ends byte-
  and metadata-exact (the fidelity tree and the temporary-name tree), a mount point below the target is
  left alone;
* the recorded trace's files are in place when ``mount`` returns, written before everything else;
* ``need PATH`` on the control socket answers once the path is in place (``absent`` / ``host`` at once);
* files the box already has (same bytes by chunk id) are kept, not fetched nor rewritten, even when their
  mtime and mode differ; a file of the same size with other bytes is replaced;
* a kill -9 in the middle of a batch, then the same ``ogrefs mount``: complete and exact, no temporary file left;
* a full disk (a small tmpfs): nothing wrong under a real name, and a rerun with room completes it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from ogrefs.box.records import Registration
from ogrefs.repo import Repository
from ogrefs.repo.traces import store_trace
from tests.daemons import kill_registered_daemons
from tests.system.test_restore_tmpnames import _hostile_tree
from tests.treegen import compare_trees, make_fidelity_tree

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, owners, device nodes)")]

OGREFS = [sys.executable, "-m", "ogrefs"]
#: A private /dev without a fuse node, then CAP_SYS_ADMIN dropped: the shape of a Docker container.
CONTAINER = textwrap.dedent("""\
    eval "$SETUP"
    mount -t tmpfs -o mode=755 nofuse /dev
    mknod -m 666 /dev/null c 1 3; mknod -m 666 /dev/zero c 1 5; mknod -m 666 /dev/urandom c 1 9
    ln -s /proc/self/fd /dev/fd
    if [ -n "${mknod_fuse:-}" ]; then mknod -m 666 /dev/fuse c 10 229; fi
    exec capsh --drop=cap_sys_admin -- -c "$SCRIPT"
""")


@pytest.fixture
def lab(tmp_path, monkeypatch):
    monkeypatch.setenv("OGREFS_RUNTIME_DIR", str(tmp_path / "run"))  # the registrations this process reads
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"),
               OGREFS_STATE_DIR=str(tmp_path / "state"), OGREFS_RUNTIME_DIR=str(tmp_path / "run"))
    subprocess.run([*OGREFS, "-q", "init"], env=env, check=True, timeout=60)
    yield {"env": env, "tmp": tmp_path}
    kill_registered_daemons(tmp_path / "run")


def _snapshot(lab: dict, src: Path) -> str:
    out = subprocess.run([*OGREFS, "-q", "snapshot", "--json", str(src)], env=lab["env"], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return json.loads(out)["id"]


def in_container(lab: dict, script: str, check: bool = True, setup: str = "") -> subprocess.CompletedProcess:
    """``script`` (bash) in a container of its own: no /dev/fuse, no CAP_SYS_ADMIN; ``setup`` runs before, as
    the container's runtime would (its volumes)."""
    env = dict(lab["env"], SCRIPT="set -euo pipefail\n" + textwrap.dedent(script), OG=" ".join(OGREFS),
               SETUP="set -euo pipefail\n" + textwrap.dedent(setup))
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", CONTAINER], env=env,
                          capture_output=True, text=True, timeout=240)
    if check and proc.returncode != 0:
        raise AssertionError(f"script failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def _under(out: Path, src: Path) -> Path:
    return out / str(src).lstrip("/")


def _leftovers(root: Path) -> list[str]:
    return [str(p) for p in root.rglob(".ogrefs-restore-*") if len(p.name) > 40]


def test_falls_back_by_itself_and_ends_exact(lab):
    """Before: ``ogrefs: FUSE is not available: /dev/fuse is missing`` and exit 1."""
    src = lab["tmp"] / "box" / "proj"
    make_fidelity_tree(src)
    _hostile_tree(src / "tmpnames")
    (src / "mnt").mkdir()
    (src / "mnt" / "data").write_bytes(b"the snapshot's")
    snap = _snapshot(lab, src)
    out = lab["tmp"] / "out"
    out.mkdir()
    mnt = _under(out, src) / "mnt"
    proc = in_container(lab, f"""
        test ! -e /dev/fuse
        mkdir -p {mnt} && mount -t tmpfs vol {mnt} 2>/dev/null && echo "mount allowed" >&2 || true
        unshare -m true 2>/dev/null && echo "unshare allowed" >&2 || true
        $OG mount {snap} {out}
        $OG status {out} --wait --timeout 120 >/dev/null
    """)
    lines = proc.stderr.splitlines()
    assert "mount allowed" not in lines and "unshare allowed" not in lines, "the container is not one"
    assert lines == ["FUSE is not available: /dev/fuse is missing (load the fuse module, or give the container "
                     "the device): writing the snapshot into place at its original paths instead (no-FUSE mode)"]
    assert "is in place at" in proc.stdout
    assert compare_trees(src, _under(out, src)) == []
    assert _leftovers(out) == []


def test_trace_first_need_answers_and_a_mount_point_is_left_alone(lab):
    src = lab["tmp"] / "box" / "proj"
    for i in range(600):  # three batches of the rest, before the trace's files in catalog order
        d = src / f"a{i // 100}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:03}").write_bytes(os.urandom(2048))
    (src / "zz").mkdir()
    traced = [src / "zz" / f"t{i}" for i in range(5)]
    for p in traced:
        p.write_bytes(os.urandom(300_000))
    (src / "vol").mkdir()
    (src / "vol" / "inside").write_bytes(b"snapshot data")
    snap = _snapshot(lab, src)
    repo = Repository.open(lab["env"]["OGREFS_REPO"], cache_root=lab["tmp"] / "cache-test")
    store_trace(repo, snap, [(os.fsencode(p), 0) for p in traced])
    out = lab["tmp"] / "out"
    out.mkdir()
    vol = _under(out, src) / "vol"
    vol.mkdir(parents=True)
    probe = f"{sys.executable} -c 'import os,sys; print(\" \".join(str(os.stat(p).st_ctime_ns) for p in sys.argv[1:]))'"
    proc = in_container(lab, setup=f"mount --bind {vol} {vol}", script=f"""
        $OG mount {snap} {out} --no-fuse
        {probe} {' '.join(str(_under(out, p)) for p in traced)}
        $OG status {out} --wait --timeout 120 >/dev/null
        test -z "$(ls -A {vol})"
    """)
    assert "writing the snapshot into place" not in proc.stderr  # --no-fuse: forced, no reason to give
    traced_ctimes = [int(x) for x in proc.stdout.splitlines()[-1].split()]
    rest_ctimes = [p.stat().st_ctime_ns for p in _under(out, src).glob("a*/f*")]
    assert len(traced_ctimes) == 5 and len(rest_ctimes) == 600
    # A file's ctime comes from the kernel's coarse clock (4 ms ticks here): files written in one tick share
    # it, so the order within a tick cannot be seen; written first means no later tick than any of the rest
    assert max(traced_ctimes) <= min(rest_ctimes), "the trace's files were not written first"
    for p in traced:
        assert _under(out, p).read_bytes() == p.read_bytes()
    assert not (vol / "inside").exists()


def _rest_then_traced(lab: dict, files: dict[Path, bytes], traced: Path) -> list[bool]:
    """``files`` after 600 files of the rest (three batches, before them in catalog order), snapshotted with a
    trace that read ``traced``; mounted without FUSE with every read but the working set's one held: whether each
    of ``files`` was in place when ``mount`` returned."""
    src = lab["tmp"] / "box" / "proj"
    for i in range(600):
        (src / f"a{i // 100}").mkdir(parents=True, exist_ok=True)
        (src / f"a{i // 100}" / f"f{i:03}").write_bytes(os.urandom(2048))
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    snap = _snapshot(lab, src)
    repo = Repository.open(lab["env"]["OGREFS_REPO"], cache_root=lab["tmp"] / "cache-test")
    store_trace(repo, snap, [(os.fsencode(traced), 0)])
    out = lab["tmp"] / "out"
    out.mkdir()
    probe = f"{sys.executable} -c 'import os,sys; print(*[os.path.exists(p) for p in sys.argv[1:]])'"
    gate = lab["tmp"] / "gate"  # the working set's one read comes, the rest's are held until the probe ran
    proc = in_container(lab, script=f"""
        OGREFS_TEST_READS_FREE=1 {sys.executable} -m tests.heldpacks {gate} mount {snap} {out} --no-fuse
        {probe} {" ".join(str(_under(out, p)) for p in [*files, src / "a5" / "f599"])}
        touch {gate}
        $OG status {out} --wait --timeout 120 >/dev/null
    """)
    assert compare_trees(src, _under(out, src)) == []
    answers = [{"True": True, "False": False}[word] for word in proc.stdout.splitlines()[-1].split()]
    assert answers[-1] is False  # (the rest's last file: its read was held)
    return answers[:-1]


def test_the_source_of_traced_bytecode_comes_with_the_trace(lab):
    """A trace records reads: ``pkg/__pycache__/mod.cpython-311.pyc``, never ``pkg/mod.py``, which Python only
    lists and stats but without which it does not use the bytecode.  The source is in place when ``mount``
    returns."""
    pkg = lab["tmp"] / "box" / "proj" / "zz" / "pkg"
    pyc = pkg / "__pycache__" / "mod.cpython-311.pyc"
    assert _rest_then_traced(lab, {pkg / "mod.py": b"x = 1\n", pyc: os.urandom(3000)}, pyc) == [True, True]


def test_the_directories_python_lists_to_import_a_traced_module_come_with_the_trace(lab):
    """Python's importer lists the directory of each module it imports and, for a package, every directory up to
    its ``sys.path`` entry; a supervised job's listing waits for every file in the directory (a name appears only
    once its file is in place).  Their files come with the trace's; the ``__pycache__`` beside them and what lies
    above the ``sys.path`` entry do not (both failed before: only the traced bytecode's source came)."""
    src = lab["tmp"] / "box" / "proj"
    lib = src / "zz" / "lib"  # a sys.path entry: not a package
    sub = lib / "pkg" / "sub"
    files = {lib / "top.py": b"t = 1\n", lib / "pkg" / "__init__.py": b"p = 1\n", lib / "pkg" / "data.json": b"{}\n",
             sub / "__init__.py": b"s = 1\n", sub / "mod.py": b"x = 1\n", sub / "other.py": b"y = 2\n",
             sub / "__pycache__" / "mod.cpython-311.pyc": os.urandom(3000),
             sub / "__pycache__" / "other.cpython-311.pyc": os.urandom(3000), src / "zz" / "above.txt": b"no\n"}
    expected = [not (path.parent.name == "__pycache__" and "other" in path.name or path.name == "above.txt")
                for path in files]
    assert _rest_then_traced(lab, files, sub / "__pycache__" / "mod.cpython-311.pyc") == expected


def test_need_answers_when_the_path_is_in_place(lab):
    """The control request the supervisor uses: ``ok`` only once the file is there, whole."""
    src = lab["tmp"] / "box" / "proj"
    for i in range(400):
        (src / f"b{i // 100}").mkdir(parents=True, exist_ok=True)
        (src / f"b{i // 100}" / f"g{i:03}").write_bytes(os.urandom(4096))
    os.symlink("b3", src / "latest")
    snap = _snapshot(lab, src)
    out = lab["tmp"] / "out"
    out.mkdir()
    script = f"""
        import os, sys
        from pathlib import Path
        from ogrefs.mount.control import ask
        want = os.fsencode("{_under(out, src)}/latest/g399")
        answer = ask(Path("{out}"), want, timeout=60)
        data = open(want, "rb").read()
        print(answer, data == open("{src}/b3/g399", "rb").read())
    """
    proc = in_container(lab, f"""
        $OG mount {snap} {out} --no-fuse
        {sys.executable} -c '{textwrap.dedent(script)}'
        $OG status {out} --wait --timeout 120 >/dev/null
    """)
    assert proc.stdout.splitlines()[-1] == "ok True"
    assert compare_trees(src, _under(out, src)) == []


def test_files_the_box_has_are_kept_not_fetched(lab):
    src = lab["tmp"] / "box" / "proj"
    src.mkdir(parents=True)
    same = {f"same{i}": os.urandom(1_000_000) for i in range(4)}
    for name, data in same.items():
        (src / name).write_bytes(data)
    (src / "other").write_bytes(os.urandom(500_000))
    snap = _snapshot(lab, src)
    out = lab["tmp"] / "out"
    there = _under(out, src)
    there.mkdir(parents=True)
    for name, data in same.items():  # the pod's image: the same bytes, another mtime and mode
        (there / name).write_bytes(data)
        os.chmod(there / name, 0o600)
    (there / "other").write_bytes(os.urandom(500_000))  # same size, other bytes
    inodes = {name: (there / name).stat().st_ino for name in [*same, "other"]}
    # (pinned to one CPU: its daemon sizes its threads to it, restore.default_workers)
    in_container(lab, f"taskset -c 0 $OG mount {snap} {out} --no-fuse && "
                      f"$OG status {out} --wait --timeout 120 >/dev/null")
    assert compare_trees(src, there) == []
    assert {n: (there / n).stat().st_ino for n in same} == {n: inodes[n] for n in same}, "a kept file was rewritten"
    assert (there / "other").stat().st_ino != inodes["other"]
    final = Registration.for_mountpoint(out).read()["materialize"]
    assert final["kept_files"] == 4 and final["kept_bytes"] == 4_000_000 and final["workers"] == 4
    assert final["fetched_bytes"] < 1_000_000  # "other" (compressed random) only, never the kept bytes
    st = subprocess.run([*OGREFS, "status", str(out)], env=lab["env"], capture_output=True, text=True, timeout=60)
    assert "kept from this box    4 files, 3.8 MiB not fetched" in st.stdout


KILL_RUN = """
import os, sys, threading, time
from pathlib import Path
from ogrefs.box.copyplan import Plan
from ogrefs.inplace.engine import InPlace, Order
from ogrefs.repo import Repository
from ogrefs.repo.catalog import Catalog
repo = Repository.open(sys.argv[1], cache_root=Path(sys.argv[5]))
snap, out, state = sys.argv[2], os.fsencode(sys.argv[3]), Path(sys.argv[4])
state.mkdir(parents=True, exist_ok=True)
plan = Plan(state / "inplace.sqlite")
from ogrefs import restore
restore.MAX_RANGE = 16384  # many reads, one at a time (workers=1): the stream cuts its ranges by restore's rule
cat = Catalog(repo.catalog_path(snap))
many = {n.ino for p, n in cat.walk() if b"/many/" in p}
many_blobs = {(e.pack, e.pack_offset) for ino in many for e in cat.extents(ino)}
read_many = []
def read_range(pack, offset, length):
    if read_many:  # once some of many/ is recorded complete, the others to come: say so, hang until killed
        while not many & plan.complete_inos():
            time.sleep(0.02)
        Path(sys.argv[6]).write_text("half")
        threading.Event().wait()
    read_many.extend(1 for p, o in many_blobs if p == pack and offset <= o < offset + length)
    return repo.read_pack_range(pack, offset, length)
e = InPlace(cat, read_range, out, plan, snapshot_id=snap, skip=lambda *a: False,
            workers=1)
e.prepare(Order())
e.run()
"""


def test_kill_9_half_way_then_the_same_mount_completes_exactly(lab):
    src = lab["tmp"] / "box" / "proj"
    make_fidelity_tree(src)
    for i in range(700):  # reads of 16 KiB: the kill comes once some files are recorded complete
        (src / "many").mkdir(exist_ok=True)
        (src / "many" / f"m{i:03}").write_bytes(os.urandom(1500))
    snap = _snapshot(lab, src)
    out, state, flag = lab["tmp"] / "out", lab["tmp"] / "state" / "st", lab["tmp"] / "half"
    out.mkdir()
    child = subprocess.Popen([sys.executable, "-c", KILL_RUN, lab["env"]["OGREFS_REPO"], snap, str(out), str(state),
                              str(lab["tmp"] / "cache-kill"), str(flag)], env=lab["env"])
    try:
        deadline = time.monotonic() + 120
        while not flag.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert flag.exists(), "the first run never got half way"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    done_before = len([p for p in _under(out, src).rglob("m*") if p.is_file() and not p.name.startswith(".")])
    assert 0 < done_before < 700
    in_container(lab, f"$OG mount {snap} {out} --no-fuse --state-dir {state} && "
                      f"$OG status {out} --wait --timeout 120 >/dev/null")
    assert compare_trees(src, _under(out, src)) == []
    assert _leftovers(out) == []


def test_a_rerun_puts_back_what_was_removed_since_and_keeps_what_was_changed(lab):
    """The same mount run again over a finished copy (after a reboot, or to get a deleted file back): the files
    recorded in place that are missing now are written again; a file written since (a job appending to its
    log) is the box's and stays.  Before: "N in place already" from the plan alone, the removed files absent."""
    src = lab["tmp"] / "box" / "proj"
    (src / "sub" / "deep").mkdir(parents=True)
    (src / "sub" / "weights.bin").write_bytes(os.urandom(300_000))
    (src / "sub" / "deep" / "a.py").write_text("print('a')\n")
    (src / "train.log").write_text("step 1\n")
    (src / "keep.txt").write_text("kept")
    os.link(src / "keep.txt", src / "keep-link.txt")
    snap = _snapshot(lab, src)
    out, state = lab["tmp"] / "out", lab["tmp"] / "state" / "st"
    out.mkdir()
    run = (f"$OG mount {snap} {out} --no-fuse --state-dir {state} >/dev/null && "
           f"$OG status {out} --wait --timeout 120 >/dev/null && $OG unmount {out} >/dev/null")
    in_container(lab, run)
    assert compare_trees(src, _under(out, src)) == []
    there = _under(out, src)
    (there / "sub" / "weights.bin").unlink()
    shutil.rmtree(there / "sub" / "deep")
    (there / "keep-link.txt").unlink()  # one name of two
    with open(there / "train.log", "a") as f:
        f.write("step 2, written by the resumed job\n")
    in_container(lab, run)
    assert (there / "sub" / "weights.bin").read_bytes() == (src / "sub" / "weights.bin").read_bytes()
    assert (there / "sub" / "deep" / "a.py").read_text() == "print('a')\n"
    assert os.path.samefile(there / "keep.txt", there / "keep-link.txt")
    assert (there / "train.log").read_text() == "step 1\nstep 2, written by the resumed job\n"
    (there / "train.log").write_text("step 1\n")  # (the job's line taken out again: the rest is the snapshot's)
    os.utime(there / "train.log", ns=((src / "train.log").stat().st_atime_ns, (src / "train.log").stat().st_mtime_ns))
    assert compare_trees(src, there) == []
    assert _leftovers(out) == []


def test_a_full_disk_leaves_nothing_wrong_and_a_rerun_completes(lab):
    src = lab["tmp"] / "box" / "proj"
    src.mkdir(parents=True)
    files = {f"big{i}": os.urandom(3_000_000) for i in range(6)}
    for name, data in files.items():
        (src / name).write_bytes(data)
    snap = _snapshot(lab, src)
    out = lab["tmp"] / "out"
    out.mkdir()
    there = _under(out, src)
    check = f"""
        import os, sys
        there = "{there}"
        want = {{n: open(os.path.join("{src}", n), "rb").read() for n in os.listdir("{src}")}}
        names = os.listdir(there) if os.path.isdir(there) else []
        wrong = [n for n in names if n in want and open(os.path.join(there, n), "rb").read() != want[n]]
        print(len([n for n in names if n in want]), wrong)
    """
    setup = f"mount -t tmpfs -o size=26m small {out} && head -c 16000000 /dev/zero > {out}/ballast"
    proc = in_container(lab, setup=setup, script=f"""
        $OG mount {snap} {out} --no-fuse || echo "first mount: $?"
        $OG status {out} --wait --timeout 120 >/dev/null || echo "first wait: $?"
        {sys.executable} -c '{textwrap.dedent(check)}'
        rm {out}/ballast
        $OG mount {snap} {out} --no-fuse
        $OG status {out} --wait --timeout 120 >/dev/null
        {sys.executable} -c '{textwrap.dedent(check)}'
        find {out} -name '.ogrefs-restore-*' | wc -l
    """)
    lines = proc.stdout.splitlines()
    assert any(line.startswith("first wait: 1") for line in lines), proc.stdout + proc.stderr
    first, second, leftovers = [ln for ln in lines if ln.endswith("]")][0], lines[-2], lines[-1]
    in_place_before = int(first.split()[0])
    assert 0 < in_place_before < 6 and first.endswith(" []"), first  # some in place, none wrong
    assert second == "6 []" and leftovers == "0"


def test_a_path_asked_for_goes_first_and_what_the_box_keeps_is_answered_at_once(tmp_path):
    """The engine alone: ``need`` before the run puts the catalog's last file in the first batch."""
    from ogrefs.box.copyplan import Plan
    from ogrefs.inplace.engine import InPlace, Order
    from ogrefs.repo.catalog import Catalog
    from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot

    src = tmp_path / "src"
    for i in range(600):
        (src / f"a{i // 100}").mkdir(parents=True, exist_ok=True)
        (src / f"a{i // 100}" / f"f{i:03}").write_bytes(os.urandom(1024))
    (src / "vol").mkdir()
    (src / "vol" / "x").write_bytes(b"x")
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    out = tmp_path / "out"
    out.mkdir()
    engine = InPlace(Catalog(repo.catalog_path(m["id"])), repo.read_pack_range, os.fsencode(out),
                     Plan(tmp_path / "plan.sqlite"), snapshot_id=m["id"], skip=lambda path, _p, name: name == b"vol")
    engine.prepare(Order())
    last = _under(out, src) / "a5" / "f599"
    need = engine.need(os.fsencode(last))
    assert not need.event.is_set()
    assert engine.need(os.fsencode(_under(out, src) / "vol" / "x")).answer == "host"
    assert engine.need(os.fsencode(_under(out, src) / "nowhere")).answer == "absent"
    engine.run()
    assert need.event.is_set() and need.answer == "ok"
    others = [p.stat().st_ctime_ns for p in _under(out, src).glob("a*/f*") if p.name != "f599"]
    assert len(others) == 599 and last.stat().st_ctime_ns <= min(others)  # (ctime: coarse ticks, as above)
    assert compare_trees(src / "a0", _under(out, src) / "a0") == []


def test_the_engine_finds_the_hinted_files_as_hint_files_walks_them(tmp_path):
    """The mount command hands the daemon the hinted files and directories; the engine finds the files below
    each in its own walk: the same files in the same order as hint_files (first hint first, each in walk order,
    a file under two hints with the first), less what this box keeps. The mount command walked each hinted
    tree before the daemon could start (0.25 s on bench_resume's classic box)."""
    from ogrefs.box.copyplan import Plan
    from ogrefs.inplace.engine import InPlace
    from ogrefs.lazy.background.materialize.build import hint_files
    from ogrefs.repo.catalog import Catalog
    from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot

    src = tmp_path / "src"
    for d in ("venv/lib/pkg", "venv/lib/kept", "venv/bin", "cuda/lib", "other", "ckpt"):
        (src / d).mkdir(parents=True)
    for i, rel in enumerate(("venv/lib/pkg/b.py", "venv/lib/pkg/a.py", "venv/lib/kept/x", "venv/bin/tool",
                             "cuda/lib/libcudart.so", "other/o", "ckpt/model.pt", "venv/top.txt")):
        (src / rel).write_bytes(os.urandom(100 + i))
    os.link(src / "other" / "o", src / "venv" / "lib" / "o-link")
    (src / "venv" / "bin" / "python").symlink_to("/usr/bin/python3")
    (src / "venv" / "empty").write_bytes(b"")
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    cat = Catalog(repo.catalog_path(m["id"]))
    ino = lambda rel: cat.resolve(os.fsencode(src / rel)).ino  # noqa: E731
    kept = os.fsencode(src / "venv" / "lib" / "kept")
    engine = InPlace(cat, repo.read_pack_range, os.fsencode(tmp_path / "out"), Plan(tmp_path / "plan.sqlite"),
                     snapshot_id=m["id"], skip=lambda path, _parent, _name: path == kept)
    walk_order = engine._walk()
    placed = set(walk_order)
    for hints in [(ino("ckpt/model.pt"), ino("venv/lib"), ino("cuda"), ino("venv")),
                  (ino("venv"), ino("venv/lib")), (ino("venv/lib/kept"),), (1,)]:
        expected = [f for f in dict.fromkeys(f for h in hints for f in hint_files(cat, h)) if f in placed]
        got = engine._hinted(hints, walk_order)
        linked = ino("other/o")  # (a hard link comes where the walk first meets it: here under other/)
        assert sorted(got) == sorted(expected) and [f for f in got if f != linked] == [
            f for f in expected if f != linked]
    first = engine._hinted((ino("ckpt/model.pt"), ino("venv/lib"), ino("cuda"), ino("venv")), walk_order)
    assert first[0] == ino("ckpt/model.pt") and ino("other/o") in first and ino("venv/lib/kept/x") not in first
    assert first.index(ino("venv/lib/o-link")) < first.index(ino("cuda/lib/libcudart.so")) < first.index(
        ino("venv/top.txt"))


def test_links_and_empty_files_come_with_the_working_set(tmp_path):
    """A job started once ``mount`` returns execs ``venv/bin/python`` (a link) and imports packages whose
    ``__init__.py`` is empty: the hints (and a trace) name only files with bytes, so the links and the empty
    files on the job's way join the working set, ahead of its files (bench_resume's step failed without)."""
    from ogrefs.box.copyplan import Plan
    from ogrefs.inplace.engine import InPlace, Order
    from ogrefs.repo.catalog import Catalog
    from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot

    src = tmp_path / "src"
    for i in range(600):  # the rest: three batches, all before the venv in catalog order
        (src / f"a{i // 100}").mkdir(parents=True, exist_ok=True)
        (src / f"a{i // 100}" / f"f{i:03}").write_bytes(os.urandom(1024))
    (src / "venv" / "bin").mkdir(parents=True)
    (src / "venv" / "lib" / "pkg").mkdir(parents=True)
    (src / "venv" / "lib" / "pkg" / "mod.py").write_bytes(b"x = 1\n")
    (src / "venv" / "lib" / "pkg" / "__init__.py").write_bytes(b"")
    (src / "venv" / "bin" / "python").symlink_to("/usr/bin/python3")
    (src / "venv" / "lib64").symlink_to("lib")
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    cat = Catalog(repo.catalog_path(m["id"]))
    hinted = cat.resolve(os.fsencode(src / "venv" / "lib" / "pkg" / "mod.py")).ino
    out = tmp_path / "out"
    out.mkdir()
    last = {(e.pack, e.pack_offset) for e in cat.extents(cat.resolve(os.fsencode(src / "a5" / "f599")).ino)}
    signalled = threading.Event()

    def read_range(pack, offset, length):  # the rest's last file waits for the working set (at most a minute)
        if any(p == pack and offset <= o < offset + length for p, o in last):
            signalled.wait(60)
        return repo.read_pack_range(pack, offset, length)

    engine = InPlace(cat, read_range, os.fsencode(out), Plan(tmp_path / "plan.sqlite"),
                     snapshot_id=m["id"], skip=lambda *_a: False)
    engine.prepare(Order(hints=(hinted,)))
    venv = _under(out, src) / "venv"
    seen: dict[str, bool] = {}

    def working_set_in_place() -> None:
        seen.update({rel: os.path.lexists(venv / rel) for rel in
                     ("lib/pkg/mod.py", "lib/pkg/__init__.py", "bin/python", "lib64", "../a5/f599")})
        signalled.set()

    engine.run(on_working_set=working_set_in_place)
    assert seen == {"lib/pkg/mod.py": True, "lib/pkg/__init__.py": True, "bin/python": True, "lib64": True,
                    "../a5/f599": False}
    assert compare_trees(src, _under(out, src)) == []


def test_at_root_the_container_files_and_mount_points_are_the_boxs(tmp_path):
    """At ``/``: Docker's /etc/hostname, /etc/hosts, /etc/resolv.conf stay this box's even with no host-path rule;
    an ``accounts`` path keeps this box's file; every mount point (``/proc``) is left alone."""
    from ogrefs.box.hostpaths import Rule
    from ogrefs.mount.inplace import _kept_by_box
    from ogrefs.mount.options import MountOptions
    from ogrefs.repo.catalog import ROOT_INO, Catalog
    from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot

    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    paths = [b"/etc/hostname", b"/etc/hosts", b"/etc/resolv.conf", b"/etc/passwd", b"/etc/os-release"]
    m = take_snapshot(repo, SnapshotOptions(paths=[p for p in paths if os.path.lexists(p)], no_parent=True))
    catalog = Catalog(repo.catalog_path(m["id"]))
    etc = catalog.lookup(ROOT_INO, b"etc")
    opts = MountOptions(repo_url="", snapshot="x", mountpoint=Path("/"),
                        host_rules=(Rule("accounts", "/etc/passwd"),))
    hidden, kept, merges = _kept_by_box(opts, catalog, Path("/"))
    names = {b"hostname", b"hosts", b"resolv.conf"} & {os.path.basename(p) for p in paths if os.path.lexists(p)}
    assert names and hidden[etc.ino] == frozenset(names)
    assert b"/etc/passwd" in kept and b"/proc" in kept and b"/etc/os-release" not in kept
    assert merges == (("accounts", "/etc/passwd"),)


def test_ogrefs_own_directories_are_never_written_into(lab):
    """A snapshot holding a directory where this mount keeps its state: the plan there is never overwritten."""
    src = lab["tmp"] / "box" / "proj"
    (src / "ogstate").mkdir(parents=True)
    (src / "ogstate" / "inplace.sqlite").write_bytes(b"the snapshot's junk")
    (src / "data").write_bytes(os.urandom(10_000))
    snap = _snapshot(lab, src)
    out = lab["tmp"] / "out"
    state = _under(out, src) / "ogstate"
    state.mkdir(parents=True)
    in_container(lab, f"$OG mount {snap} {out} --no-fuse --state-dir {state} && "
                      f"$OG status {out} --wait --timeout 120 >/dev/null")
    assert (state / "inplace.sqlite").read_bytes()[:15] == b"SQLite format 3"
    assert (_under(out, src) / "data").read_bytes() == (src / "data").read_bytes()


def test_with_dev_fuse_but_no_cap_sys_admin_it_says_so_and_falls_back(lab):
    """A container given the device but not the capability (mount(2) would fail with EPERM)."""
    src = lab["tmp"] / "box" / "proj"
    src.mkdir(parents=True)
    (src / "f").write_bytes(b"data")
    snap = _snapshot(lab, src)
    out = lab["tmp"] / "out"
    out.mkdir()
    proc = in_container(lab, f"""
        test -c /dev/fuse
        $OG mount {snap} {out}
        $OG status {out} --wait --timeout 120 >/dev/null
    """, setup="mknod_fuse=1")
    assert proc.stderr.splitlines() == ["mounting is not allowed here: no CAP_SYS_ADMIN (an unprivileged container): "
                                        "writing the snapshot into place at its original paths instead (no-FUSE mode)"]
    assert (_under(out, src) / "f").read_bytes() == b"data"


def test_at_root_the_tree_comes_back_and_accounts_are_merged(lab):
    """``ogrefs mount SNAP / --no-fuse``: the snapshot's files at their original paths; an ``accounts`` file gets
    the snapshot's entries and this box's login accounts, as the whole-box mount merges them."""
    root = lab["tmp"] / "boxroot"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n"
                                         "trainer:x:1001:1001::/home/trainer:/bin/bash\n")
    (root / "app").mkdir()
    (root / "app" / "train.py").write_text("print('step')\n")
    snap = _snapshot(lab, root)
    os.rename(root, lab["tmp"] / "boxroot.old")  # the new box: the same path, its own passwd with its login user
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\nalice:x:1000:1000::/home/alice:/bin/sh\n")
    passwd = root / "etc" / "passwd"
    in_container(lab, f"$OG mount {snap} / --no-fuse --host-path accounts:{passwd} --state-dir {lab['tmp']}/st && "
                      "$OG status / --wait --timeout 120 >/dev/null")
    assert (root / "app" / "train.py").read_text() == "print('step')\n"
    assert passwd.read_text() == ("root:x:0:0:root:/root:/bin/bash\ntrainer:x:1001:1001::/home/trainer:/bin/bash\n"
                                  "alice:x:1000:1000::/home/alice:/bin/sh\n")
    assert "(merged)" in " ".join(Registration.for_mountpoint(Path("/")).read()["merged"])


def test_a_file_someone_writes_during_its_batch_is_theirs(tmp_path):
    """A job on the box writes a path of the snapshot while the copy fetches it: the job's file stays (the
    snapshot's is not renamed over it) and the path is reported; every other file is put in place."""
    from ogrefs.box.copyplan import Plan
    from ogrefs.inplace.engine import InPlace, Order
    from ogrefs.repo.catalog import Catalog
    from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot

    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"f{i}").write_bytes(os.urandom(5000))
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    out = tmp_path / "out"
    theirs = _under(out, src) / "f3"

    def read_range(pack, offset, length):  # the batch is planned: its names' state was taken before this
        if not theirs.exists():
            theirs.write_bytes(b"the job's checkpoint")
        return repo.read_pack_range(pack, offset, length)

    engine = InPlace(Catalog(repo.catalog_path(m["id"])), read_range, os.fsencode(out),
                     Plan(tmp_path / "plan.sqlite"), snapshot_id=m["id"], skip=lambda *a: False)
    engine.prepare(Order())
    engine.run()
    assert theirs.read_bytes() == b"the job's checkpoint"
    assert list(engine.failed) == [os.fsencode(theirs)] and "this box's version is kept" in engine.failed[
        os.fsencode(theirs)]
    for i in (0, 1, 2, 4):
        assert (_under(out, src) / f"f{i}").read_bytes() == (src / f"f{i}").read_bytes()
    assert _leftovers(out) == []
