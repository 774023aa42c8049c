"""``ogrefs run``/``shell`` show the snapshot's directories exactly (issue 47; tier 5 and the mask's plan).

Today's bug: a run of an old snapshot showed this box's newer ``ckpt_005000.pt``
and ``data/extra3.bin`` inside the snapshot's project, so a loop that resumes
from the highest-numbered checkpoint resumed from this box's file. The mask
(box/exact.py) hides this box's entries below the snapshot's roots, except
where a host-owned rule keeps them; ``--merge`` shows them as before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

from ogrefs.box import exact
from ogrefs.box.hostpaths import Rule
from ogrefs.repo.catalog import ROOT_INO

from tests.system.test_box_mount import pytestmark  # noqa: F401  (fuse, root, unshare)


def _ogrefs(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ogrefs", *args], env=env, capture_output=True, text=True,
                          timeout=180)


def test_run_shows_the_snapshots_project_exactly_unless_merge(tmp_path):
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "ckpt_001000.pt").write_text("step 1000 of the snapshot\n")
    (proj / "data/a.bin").write_text("a\n")
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"),
               OGREFS_STATE_DIR=str(tmp_path / "state"), OGREFS_RUNTIME_DIR=str(tmp_path / "run"),
               OGREFS_RUN_DIR=str(tmp_path / "runs"))
    assert _ogrefs(["-q", "init"], env).returncode == 0
    snap = _ogrefs(["-q", "snapshot", "--json", str(proj)], env)
    assert snap.returncode == 0, snap.stderr
    sid = __import__("json").loads(snap.stdout)["id"]
    (proj / "ckpt_005000.pt").write_text("this box went on training\n")  # this box, after the snapshot
    (proj / "data/extra3.bin").write_text("more data\n")
    (proj / "ckpt_001000.pt").write_text("changed here\n")
    newest = f"ls {proj}/ckpt_*.pt | sort | tail -n 1; ls {proj}/data; cat {proj}/ckpt_001000.pt; hostname"
    inside = _ogrefs(["run", sid, "--", "sh", "-c", newest], env)  # sh, ls, hostname: this box's userland
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout.splitlines() == [f"{proj}/ckpt_001000.pt", "a.bin", "step 1000 of the snapshot",
                                          os.uname().nodename], inside.stdout
    merged = _ogrefs(["run", "--merge", sid, "--", "sh", "-c", newest], env)
    assert merged.returncode == 0, merged.stderr
    assert merged.stdout.splitlines()[:3] == [f"{proj}/ckpt_005000.pt", "a.bin", "extra3.bin"], merged.stdout


@dataclass
class _Node:
    ino: int
    is_dir: bool


class _Catalog:
    """A catalog's lookups over a dict tree ({name: subtree or None for a file})."""

    def __init__(self, tree: dict) -> None:
        self.nodes = {ROOT_INO: (_Node(ROOT_INO, True), tree)}
        self._n = ROOT_INO
        self._add(tree)

    def _add(self, tree: dict) -> None:
        for name, sub in list(tree.items()):
            self._n += 1
            tree[name] = (self._n, sub)
            self.nodes[self._n] = (_Node(self._n, sub is not None), sub)
            if sub is not None:
                self._add(sub)

    def get(self, ino: int):
        return self.nodes[ino][0]

    def children(self, ino: int):
        return [(name.encode(), self.nodes[i][0]) for name, (i, _) in sorted(self.nodes[ino][1].items())]

    def lookup(self, ino: int, name: bytes):
        found = (self.nodes[ino][1] or {}).get(name.decode())
        return self.nodes[found[0]][0] if found else None


def _this_box(root) -> None:
    for d in ("etc/apt", "etc/ssh", "usr/lib/x86_64-linux-gnu", "opt/proj", "srv/b-data", "home/admin/.ssh"):
        (root / d).mkdir(parents=True)
    for f in ("etc/hostname", "etc/b-only.conf", "etc/apt/b.list", "etc/ssh/ssh_host_ed25519_key",
              "etc/ssh/sshd_config", "usr/lib/x86_64-linux-gnu/libc.so.6", "usr/lib/x86_64-linux-gnu/libnew.so.3",
              "usr/lib/x86_64-linux-gnu/libcuda.so.550", "opt/proj/ckpt_005000.pt", "home/admin/.bashrc",
              "home/admin/.ssh/authorized_keys"):
        (root / f).write_text("this box\n")
    os.symlink("libcuda.so.550", root / "usr/lib/x86_64-linux-gnu/libcuda.so.1")


RULES = [Rule("host", "/etc/hostname"), Rule("host", "/etc/ssh/ssh_host_*"),
         Rule("host", "/usr/lib/x86_64-linux-gnu/libcuda.so*"), Rule("merge", "/home/*/.ssh/authorized_keys")]


def test_the_mask_hides_this_boxs_entries_but_the_host_owned_ones(tmp_path):
    host = tmp_path / "b"
    _this_box(host)
    snap = _Catalog({"etc": {"apt": {"a.list": None}, "ssh": {"sshd_config": None}, "hostname": None},
                     "usr": {"lib": {"x86_64-linux-gnu": {"libc.so.6": None}}},
                     "opt": {"proj": {"ckpt_001000.pt": None}}, "home": {"ubuntu": {}}})
    got = {(e.path, e.kind) for e in exact.plan(snap, RULES, ["/"], str(host))}
    assert got == {("/", "dir"), ("/etc", "dir"), ("/etc/apt", "opaque"), ("/etc/b-only.conf", "whiteout"),
                   ("/etc/ssh", "dir"), ("/usr", "dir"), ("/usr/lib", "dir"), ("/usr/lib/x86_64-linux-gnu", "dir"),
                   ("/usr/lib/x86_64-linux-gnu/libnew.so.3", "whiteout"), ("/opt", "opaque"), ("/srv", "whiteout"),
                   # this box's login user keeps its key (a merge rule), nothing else of its home
                   ("/home", "dir"), ("/home/admin", "dir"), ("/home/admin/.bashrc", "whiteout"),
                   ("/home/admin/.ssh", "dir")}, sorted(got)
    named = {(e.path, e.kind) for e in exact.plan(snap, RULES, ["/opt/proj"], str(host))}
    assert named == {("/opt/proj", "opaque")}  # above a named root everything still merges


def test_overlayfs_reads_the_mask_as_the_plan_means(tmp_path):
    """The kernel's side: a whiteout and an opaque directory in a middle lower layer hide the layer below."""
    host = tmp_path / "b"
    _this_box(host)
    snap = tmp_path / "snap"
    for f in ("etc/apt/a.list", "etc/ssh/sshd_config", "usr/lib/x86_64-linux-gnu/libc.so.6", "opt/proj/ckpt_001000.pt"):
        (snap / f).parent.mkdir(parents=True, exist_ok=True)
        (snap / f).write_text("snapshot\n")
    cat = _Catalog({"etc": {"apt": {"a.list": None}, "ssh": {"sshd_config": None}},
                    "usr": {"lib": {"x86_64-linux-gnu": {"libc.so.6": None}}}, "opt": {"proj": {"ckpt_001000.pt": None}}})
    script = textwrap.dedent(f"""
        import os, subprocess, sys
        from pathlib import Path
        from ogrefs.box import exact
        from tests.system.test_run_exact import RULES
        import pickle
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "{tmp_path}/t"], check=True)
        exact.write(pickle.loads(bytes.fromhex(sys.argv[1])), Path("{tmp_path}/t/mask"))
        os.makedirs("{tmp_path}/t/u"); os.makedirs("{tmp_path}/t/w"); os.makedirs("{tmp_path}/m")
        subprocess.run(["mount", "-t", "overlay", "ovl", "-o",
                        "lowerdir={snap}:{tmp_path}/t/mask:{host},upperdir={tmp_path}/t/u,workdir={tmp_path}/t/w",
                        "{tmp_path}/m"], check=True)
        for d in ("etc", "etc/apt", "etc/ssh", "usr/lib/x86_64-linux-gnu", "opt/proj"):
            print(d, sorted(os.listdir("{tmp_path}/m/" + d)))
    """)
    (tmp_path / "t").mkdir()
    mask = __import__("pickle").dumps(exact.plan(cat, RULES, ["/"], str(host))).hex()
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", script, mask],
                          capture_output=True, text=True, timeout=60, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "etc ['apt', 'hostname', 'ssh']",
        "etc/apt ['a.list']",
        "etc/ssh ['ssh_host_ed25519_key', 'sshd_config']",
        "usr/lib/x86_64-linux-gnu ['libc.so.6', 'libcuda.so.1', 'libcuda.so.550']",
        "opt/proj ['ckpt_001000.pt']",
    ], proc.stdout


def test_mount_at_root_shows_a_project_snapshot_exactly(tmp_path):
    """At /, a snapshot of a data path (not a whole box, not a system directory) is exact too."""
    from tests.system.test_box_mount import OGREFS, in_namespace

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "ckpt_001000.pt").write_text("snapshot\n")
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"),
               OGREFS_STATE_DIR=str(tmp_path / "state"), OGREFS_RUNTIME_DIR=str(tmp_path / "run"))
    assert _ogrefs(["-q", "init"], env).returncode == 0
    sid = __import__("json").loads(_ogrefs(["-q", "snapshot", "--json", str(proj)], env).stdout)["id"]
    (proj / "ckpt_005000.pt").write_text("this box\n")
    out = in_namespace(env, f"""
        {OGREFS} -q mount {sid} / --no-materialize
        ls {proj} > {tmp_path}/seen.txt
        {OGREFS} unmount /
    """)
    assert (tmp_path / "seen.txt").read_text() == "ckpt_001000.pt\n", out.stderr


def test_mount_of_a_whole_box_at_root_shows_the_directories_it_owns_exactly(tmp_path):
    """A whole-box snapshot (its root is /) mounted at / over a box that went on: the project it recorded as a
    git work tree is exact (this box's newer checkpoint and data hidden), this box's own directories beside it
    and its login user's home still show; ``--merge`` shows this box's files in the project again. Before:
    no mask at all for a whole box, and the resume loop took this box's ``ckpt_005000.pt``.

    A stand-in box in a private namespace: tmpfs on /opt and /home, a snapshot of / that leaves out every
    other top-level entry (so its root is /, as a whole box's), mounted at / over them.
    """
    from tests.system.test_box_mount import OGREFS, PY, in_namespace

    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"),
               OGREFS_STATE_DIR=str(tmp_path / "state"), OGREFS_RUNTIME_DIR=str(tmp_path / "run"))
    others = " ".join(f"--exclude /{n}" for n in sorted(os.listdir("/")) if n not in ("opt", "home"))
    newest = "ls /opt/project/ckpts | sort | tail -n 1; ls /opt/project/data; cat /home/bob/notes.txt; ls /opt"
    out = in_namespace(env, f"""
        mount -t tmpfs box-opt /opt && mount -t tmpfs box-home /home
        mkdir -p /opt/project/ckpts /opt/project/data /home/alice
        git init -q /opt/project
        printf 'step 1000\\n' > /opt/project/ckpts/ckpt_001000.pt && printf a > /opt/project/data/a.bin
        printf "A's profile\\n" > /home/alice/.profile
        {OGREFS} -q init
        {OGREFS} -q snapshot --json / {others} > {tmp_path}/snap.json
        sid=$({PY} -c 'import json, sys; print(json.load(open(sys.argv[1]))["id"])' {tmp_path}/snap.json)
        # this box went on training, and has its own user and tools beside the project
        printf 'step 5000 of this box\\n' > /opt/project/ckpts/ckpt_005000.pt && printf b > /opt/project/data/extra3.bin
        mkdir -p /home/bob /opt/b-tool && printf "bob's notes\\n" > /home/bob/notes.txt
        {OGREFS} mount "$sid" / --no-materialize > {tmp_path}/mount.txt
        {{ {newest}; }} > {tmp_path}/exact.txt
        {OGREFS} status / > {tmp_path}/status.txt
        {OGREFS} unmount /
        {OGREFS} mount --merge "$sid" / --no-materialize > {tmp_path}/merge.txt
        {{ {newest}; }} > {tmp_path}/merged.txt
        {OGREFS} unmount /
    """)
    manifest = __import__("json").loads((tmp_path / "snap.json").read_text())
    assert manifest["paths"] == ["/"] and [g["path"] for g in manifest["environment"]["git"]] == ["/opt/project"]
    assert (tmp_path / "exact.txt").read_text().splitlines() == [
        "ckpt_001000.pt", "a.bin", "bob's notes", "b-tool", "project"], out.stderr
    assert (tmp_path / "merged.txt").read_text().splitlines() == [
        "ckpt_005000.pt", "a.bin", "extra3.bin", "bob's notes", "b-tool", "project"]
    said = "exact: /opt/project (this box's entries hidden; --merge to show them)"
    assert said in (tmp_path / "mount.txt").read_text() and said in (tmp_path / "status.txt").read_text()
    assert "exact:" not in (tmp_path / "merge.txt").read_text()
