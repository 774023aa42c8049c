"""Whole-box rules and the progress line (tier 1: units, no store)."""

from __future__ import annotations

import io

from ogrefs.cli.progress import ProgressLine
from ogrefs.units import human_bytes
from ogrefs.snapshot.pipeline import Stats, normalize_roots
from ogrefs.snapshot.walk import WHOLE_BOX_SKIP, MountPoint, WalkRules, _unescape_mountinfo, mounts


def test_whole_box_skips_pseudo_and_volatile_but_records_mountpoints():
    rules = WalkRules.for_whole_box([], [], cross_mounts=False)
    for p in (b"/proc", b"/sys", b"/dev", b"/run", b"/tmp"):
        assert not rules.descend(p) and not rules.excluded(p)
    assert rules.descend(b"/usr") and rules.descend(b"/etc")
    # --one-file-system: every other mount point is not descended into
    for point, _fstype in mounts():
        if point != b"/":
            assert not rules.descend(point)
    crossing = WalkRules.for_whole_box([], [], cross_mounts=True)
    assert not crossing.descend(b"/proc")
    assert set(WHOLE_BOX_SKIP) <= crossing.skip_paths


def test_whole_box_takes_local_disks_and_own_overlays_and_says_why_it_skips_the_rest():
    table = {m.path: m for m in (
        MountPoint(b"/data", "xfs", "/dev/nvme1n1"), MountPoint(b"/workspace", "ext4", "/dev/nvme2n1p1"),
        MountPoint(b"/scratch", "btrfs", "/dev/sdb"), MountPoint(b"/odd", "weirdfs", "/dev/sdc"),
        MountPoint(b"/nfs", "nfs4", "srv:/x"), MountPoint(b"/s3", "fuse.s3fs", "s3fs"),
        MountPoint(b"/fz", "fuse.other", "x"), MountPoint(b"/shm", "tmpfs", "tmpfs"),
        MountPoint(b"/var/lib/docker/m", "overlay", "overlay"), MountPoint(b"/home", "overlay", "ogrefs"),
        MountPoint(b"/ro", "fuse.ogrefs", "ogrefs"), MountPoint(b"/virt", "unknownfs", "none"))}
    rules = WalkRules(whole_box=True, table=table, own_layers=frozenset({b"/home"}))
    got = {p: rules.not_descended(p, is_root=False, dev=1, root_dev=1) for p in table}
    for p in (b"/data", b"/workspace", b"/scratch", b"/odd", b"/home"):
        assert got[p] is None, p
    reasons = {p: v["reason"] for p, v in got.items() if v}
    assert "network" in reasons[b"/nfs"] and "network" in reasons[b"/s3"]
    assert "FUSE" in reasons[b"/fz"] and "memory" in reasons[b"/shm"]
    assert "not made by ogrefs" in reasons[b"/var/lib/docker/m"] and "ogrefs mount" in reasons[b"/ro"]
    assert "not known" in reasons[b"/virt"] and got[b"/nfs"]["type"] == "nfs4"
    # named paths: everything below them but kernel views and ogrefs' lazy lowers
    paths = WalkRules(table=table)
    assert paths.not_descended(b"/nfs", is_root=False, dev=1, root_dev=1) is None
    assert paths.not_descended(b"/ro", is_root=False, dev=1, root_dev=1) is not None
    # a root is always walked; --one-file-system stops at a mount point and at a change of device
    one = WalkRules(table=table, cross_mounts=False)
    assert one.not_descended(b"/data", is_root=True, dev=5, root_dev=5) is None
    assert one.not_descended(b"/data", is_root=False, dev=1, root_dev=1)["reason"].startswith("another")
    assert one.not_descended(b"/plain/dir", is_root=False, dev=2, root_dev=1) is not None
    assert one.not_descended(b"/plain/dir", is_root=False, dev=1, root_dev=1) is None


def test_excludes_match_full_paths_and_basenames():
    rules = WalkRules(excludes=["*.pyc", "/data/cache", "__pycache__"])
    assert rules.excluded(b"/a/b/x.pyc")
    assert rules.excluded(b"/data/cache")
    assert rules.excluded(b"/srv/__pycache__")
    assert not rules.excluded(b"/data/cache2/file.py")


def test_mountinfo_unescape():
    assert _unescape_mountinfo(r"/mnt/with\040space") == b"/mnt/with space"


def test_normalize_roots_drops_nested_and_duplicates():
    assert normalize_roots([b"/a/b", b"/a", b"/a/", b"/c/../d"]) == [b"/a", b"/d"]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_only_on_tty():
    tty = _Tty()
    line = ProgressLine(stream=tty)
    s = Stats(files=3, dirs=1, read_bytes=5 * 1024 * 1024)
    line.snapshot(s)
    line.done()
    assert "3 files" in tty.getvalue() and "5.0 MiB read" in tty.getvalue()
    pipe = io.StringIO()
    quiet = ProgressLine(stream=pipe)
    quiet.snapshot(s)
    assert pipe.getvalue() == ""
    assert human_bytes(1536) == "1.5 KiB"


def test_progress_lines_show_elapsed_percent_total_and_eta_as_restic():
    from types import SimpleNamespace

    from ogrefs.cli.progress import restore_line, snapshot_line

    s = Stats(files=120, dirs=3, bytes=450 * 1024 * 1024, read_bytes=300 * 1024 * 1024, started=100.0)
    counting = snapshot_line(s, None, now=103.0)
    assert counting.startswith("[0:03] 120 files 450.0 MiB") and "counting the total" in counting
    line = snapshot_line(s, (400, 1000 * 1024 * 1024), now=103.0)
    assert line.startswith("[0:03]  45% 120 / 400 files 450.0 MiB / 1000.0 MiB") and line.endswith("ETA 0:03")
    r = SimpleNamespace(files=2144, files_done=120, total_bytes=400, written_bytes=100, started=0.0)
    assert restore_line(r, now=65.0).startswith("[1:05]  25% 120 / 2144 files")
    assert restore_line(r, now=65.0).endswith("ETA 3:15")
