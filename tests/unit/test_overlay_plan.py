"""overlay.plan and normalized protected paths (unit tier: nothing is mounted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ogrefs.box import overlay
from ogrefs.errors import UsageError


@pytest.mark.parametrize("root", ["//boot", "/tmp/../proc", "/./sys/kernel", "/run//user", "/usr/../boot/efi"])
def test_protected_roots_are_refused_however_they_are_spelled(root, tmp_path):
    with pytest.raises(UsageError, match="refusing to cover"):
        overlay.plan([root], tmp_path / "lower", Path("/"), tmp_path)


@pytest.mark.parametrize("target", ["//boot", "/tmp/../proc", "/dev/./shm"])
def test_protected_targets_are_refused_however_they_are_spelled(target, tmp_path):
    with pytest.raises(UsageError, match="refusing to cover"):
        overlay.plan(["/x"], tmp_path / "lower", Path(target), tmp_path)


def test_normalized_roots_overlay_the_path_the_kernel_resolves(tmp_path):
    plans = overlay.plan(["//opt/app", "/srv/./data/../data"], tmp_path / "lower", Path("/"), tmp_path)
    assert [o.target for o in plans] == ["/opt/app", "/srv/data"]


def test_whole_box_reports_every_top_level_directory_it_leaves_alone(tmp_path):
    skipped: list[dict] = []
    plans = overlay.plan(["/"], tmp_path / "lower", Path("/"), tmp_path,
                         top_level=["usr", "proc", "boot", "tmp", "etc"], skipped=skipped)
    assert [o.target for o in plans] == ["/etc", "/usr"]
    assert sorted(s["path"] for s in skipped) == ["/boot", "/proc", "/tmp"]


def test_a_snapshot_of_a_mounted_box_never_takes_entries_below_a_host_owned_directory():
    from ogrefs.snapshot.mounted import Layer, OwnMount

    m = OwnMount("snap", "file:///r", b"/state", False, None, host_owned=frozenset({b"/lib/modules", b"/etc/hostname"}))
    layer = Layer(b"/lib", b"/nonexistent-upper", b"/lib", m)
    assert layer.origin(b"/lib/modules/6.1.0/kernel/x.ko") is None  # this box's modules, not the snapshot's
    assert layer.origin(b"/lib/modules") is None
    assert layer.origin(b"/lib/x86_64-linux-gnu/libc.so.6").cat_path == b"/lib/x86_64-linux-gnu/libc.so.6"
