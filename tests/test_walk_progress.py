"""Whole-box rules and the progress line (tier 1: units, no store)."""

from __future__ import annotations

import io

from ogrefs.progress import ProgressLine, human_bytes
from ogrefs.snapshot import Stats, normalize_roots
from ogrefs.walk import WHOLE_BOX_SKIP, WalkRules, _unescape_mountinfo, mounts


def test_whole_box_skips_pseudo_and_volatile_but_records_mountpoints():
    rules = WalkRules.for_whole_box([], [], cross_mounts=False)
    for p in (b"/proc", b"/sys", b"/dev", b"/run", b"/tmp"):
        assert not rules.descend(p) and not rules.excluded(p)
    assert rules.descend(b"/usr") and rules.descend(b"/etc")
    # every other mount point is not descended into unless asked
    for point, _fstype in mounts():
        if point != b"/":
            assert not rules.descend(point)
    crossing = WalkRules.for_whole_box([], [], cross_mounts=True)
    assert not crossing.descend(b"/proc")
    assert set(WHOLE_BOX_SKIP) <= crossing.skip_paths


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
