"""Restore's temporary names against a local user and a hostile tree; honest counts (issue 46, 51.7).

* a local user renames their own file over a temporary name in a directory
  they can write while root restores: their inode is never chowned,
  chmodded or put in place (before: a root-owned setuid binary of theirs);
* a tree whose own files are named like temporary names restores whole,
  also when restored twice onto the same target;
* a file put in place and removed before the restore ends is reported;
* the summary's bytes are the logical sizes of the files in place.
"""

from __future__ import annotations

import os
import random
import stat
import subprocess
from pathlib import Path

import pytest

from ogrefs.repo import Repository
from ogrefs.repo.catalog import Catalog
from ogrefs.restore import Restorer
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot
from ogrefs.units import human_bytes
from tests.system.test_restore_safety import _cli, _under, cli_repo  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(180)
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (owners, another user)")
USER = 4321  # the local attacker: no name needed, setpriv takes numbers
MiB = 1024 * 1024


def _repo_with(tmp_path: Path, src: Path) -> tuple[Repository, dict]:
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "cache")
    return repo, take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))


def _restorer(repo: Repository, m: dict, out: Path, **kw) -> Restorer:
    return Restorer(Catalog(repo.catalog_path(m["id"])), kw.pop("read_range", repo.read_pack_range),
                    os.fsencode(out), **{"workers": 1, **kw})


def _as_user_rename_over_tmp(d: Path, size: int) -> int:
    """As uid USER, in ``d`` (entered as root before the privileges drop: its parents are root-only), make a
    file of ``size`` bytes ``E`` with mode 0755 and rename it over every temporary name there; its inode."""
    script = (f"head -c {size} /dev/zero | tr '\\0' E > mine && chmod 755 mine && stat -c %i mine && "
              "for t in .ogrefs-restore-*.tmp; do mv -f mine \"$t\"; done")
    proc = subprocess.run(["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", "sh", "-c", script],
                          cwd=d, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[0])


@root_only
def test_a_users_file_renamed_over_a_temporary_name_is_never_made_roots(tmp_path):
    """The user's file swapped in for ``helper``'s temporary name (after its data was fetched, before it is
    put in place) keeps the user's owner and mode and is not put in place; ``helper`` is reported.
    Before the fix: ``helper`` was the user's inode, owner root, mode 04755."""
    src = tmp_path / "src"
    (src / "home").mkdir(parents=True)
    helper = src / "home" / "helper"
    helper.write_bytes(b"\x7fELF snapshot's helper" * 500)
    os.chmod(helper, 0o4755)  # setuid root, in a directory the user owns
    os.chown(src / "home", USER, USER)
    repo, m = _repo_with(tmp_path, src)
    home = _under(tmp_path / "out", src / "home")
    home.mkdir(parents=True)
    os.chown(home, USER, USER)  # the user's home exists on the box restored over
    swapped: list[int] = []

    def read_range(pack: str, off: int, n: int) -> bytes:
        data = repo.read_pack_range(pack, off, n)
        if not swapped:
            swapped.append(_as_user_rename_over_tmp(home, helper.stat().st_size))
        return data

    r = _restorer(repo, m, tmp_path / "out", read_range=read_range)
    r.run()
    (mine,) = swapped
    placed = home / "helper"
    if placed.exists():  # only ever the snapshot's own file
        assert placed.stat().st_ino != mine
        assert placed.read_bytes() == helper.read_bytes()
    else:
        assert os.fsencode(placed) in r.failed, r.failed
    for p in home.iterdir():
        st = p.lstat()
        if st.st_ino == mine:
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (USER, 0o755), p
            assert p.name != "helper"


def _hostile_tree(src: Path) -> dict[str, bytes]:
    """Files named as restore's temporary files are, all of one size: ``.ogrefs-restore-100.tmp`` to ``-159``
    sort first and get the catalog's first inodes, so each names the temporary file of an ``f*`` file
    restored after it (inodes 100 to 159); and a few of the new pattern."""
    src.mkdir(parents=True)
    want = {}
    names = [f".ogrefs-restore-{k}.tmp" for k in range(100, 160)] + [f"f{i:03}" for i in range(200)] + \
        [f".ogrefs-restore-0123456789abcdef-{k}.tmp" for k in range(1, 20)]
    for name in names:
        want[name] = name.encode().ljust(64, b".") * 16
        (src / name).write_bytes(want[name])
    return want


def test_a_tree_named_like_temporary_files_restores_whole_twice(tmp_path):
    """Before the fix: files under temporary-like names absent and others holding their bytes, none reported."""
    src = tmp_path / "src"
    want = _hostile_tree(src)
    repo, m = _repo_with(tmp_path, src)
    out = _under(tmp_path / "out", src)
    for run in (1, 2):
        r = _restorer(repo, m, tmp_path / "out", workers=4)
        r.run()
        got = {p.name: p.read_bytes() for p in out.iterdir()}
        wrong = sorted(name for name in want if got.get(name) != want[name])
        assert wrong == [], f"run {run}: {len(wrong)} absent or wrong, e.g. {wrong[:3]}; failed {r.failed}"
        assert got.keys() == want.keys() and r.problems == 0 and r.stats.files_done == len(want)


def test_a_file_removed_after_it_was_put_in_place_is_reported(tmp_path, monkeypatch):
    """What restore did not produce in the end is counted and reported, whoever removed it (before: counted
    as restored, nothing reported, exit 0)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"f{i}").write_bytes(bytes([i]) * 5000)
    repo, m = _repo_with(tmp_path, src)
    out = _under(tmp_path / "out", src)
    complete = Restorer._complete

    def complete_then_removed(self, f) -> None:
        complete(self, f)
        if f.names[0].endswith(b"/f3"):
            (out / "f3").unlink()  # a local user, or a second restore, at that moment

    monkeypatch.setattr(Restorer, "_complete", complete_then_removed)
    r = _restorer(repo, m, tmp_path / "out")
    r.run()
    assert list(r.failed) == [os.fsencode(out / "f3")]
    assert "not in place" in r.failed[os.fsencode(out / "f3")]
    assert (r.stats.files_done, r.stats.restored_bytes, r.problems) == (4, 4 * 5000, 1)


def _summary(proc: subprocess.CompletedProcess) -> str:
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("restored ")]
    return line


def test_a_sparse_file_counts_its_logical_size(cli_repo, tmp_path):
    """Before the fix: ``38.8 KiB of 200.0 MiB`` for a complete restore of a sparse file."""
    env, _src, _sid = cli_repo
    sparse = tmp_path / "sparse"
    sparse.mkdir()
    with open(sparse / "big.img", "wb") as fh:
        fh.truncate(200 * MiB)
        fh.seek(100 * MiB)
        fh.write(os.urandom(40_000))
    proc = _cli(["-q", "snapshot", str(sparse)], env)
    assert proc.returncode == 0, proc.stderr
    proc = _cli(["restore", "latest", str(tmp_path / "out")], env)
    assert proc.returncode == 0, proc.stderr
    assert "restored 1 of 1 files" in _summary(proc) and "200.0 MiB of 200.0 MiB" in _summary(proc)


@root_only
def test_a_full_disk_counts_only_the_files_in_place(cli_repo, tmp_path, small_fs):
    """Before the fix: bytes written to files that then failed were counted (19.5 MiB "restored" on a
    disk holding 22 KB)."""
    env, _src, _sid = cli_repo
    big = tmp_path / "big"
    big.mkdir()
    for i in range(3):
        (big / f"b{i}").write_bytes(random.Random(i).randbytes(6 * MiB))  # fixed chunks of at most 4 MiB
    assert _cli(["-q", "snapshot", str(big)], env).returncode == 0
    disk = small_fs(11 * MiB)  # b0, then b1's first chunk or more, never all of it
    proc = _cli(["restore", "--force", "--workers", "1", "latest", str(disk / "out")], env)
    assert proc.returncode == 3, proc.stderr
    placed = [p for p in (disk / "out").rglob("b*") if p.is_file()]
    assert 0 < len(placed) < 3
    assert _summary(proc).startswith(f"restored {len(placed)} of 3 files")
    assert f", {human_bytes(len(placed) * 6 * MiB)} of {human_bytes(18 * MiB)} " in _summary(proc), _summary(proc)
