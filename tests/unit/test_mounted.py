"""Where an entry of a box running from an ogrefs mount comes from (tier 1: a hand-made upper directory).

The overlay itself is the kernel's (tests/system/test_loop.py mounts real ones); here
the upper directory holds what overlayfs writes there: plain copy-ups,
metadata-only copy-ups (``trusted.overlay.metacopy``) and renamed directories
(``trusted.overlay.redirect``), so every rule of ``Layer.origin`` is exercised,
including those an overlay mounted without ``metacopy``/``redirect_dir`` never shows.
"""

from __future__ import annotations

import os

import pytest

from ogrefs.snapshot.mounted import Layer, OwnMount, OwnMounts

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="trusted.* xattrs need root")


def _layer(tmp_path, target=b"/srv", prefix=b"/srv", host_owned=frozenset(), merged=None) -> Layer:
    upper = tmp_path / "upper"
    upper.mkdir(exist_ok=True)
    m = OwnMount("s" * 64, "file:///r", os.fsencode(tmp_path / "state"), False, None, host_owned=host_owned)
    la = Layer(target, os.fsencode(upper), prefix, m, merged)
    m.layers.append(la)
    return la


def test_origin_rules(tmp_path):
    la = _layer(tmp_path)
    up = tmp_path / "upper"
    (up / "box").mkdir()
    (up / "box" / "new.txt").write_text("written on B")
    (up / "box" / "chmodded.bin").write_bytes(b"")
    os.setxattr(up / "box" / "chmodded.bin", "trusted.overlay.metacopy", b"")
    (up / "box" / "moved.bin").write_bytes(b"")
    os.setxattr(up / "box" / "moved.bin", "trusted.overlay.metacopy", b"")
    os.setxattr(up / "box" / "moved.bin", "trusted.overlay.redirect", b"/srv/box/old.bin")
    (up / "renamed").mkdir()
    os.setxattr(up / "renamed", "trusted.overlay.redirect", b"/srv/original")

    untouched = la.origin(b"/srv/box/data.bin")
    assert untouched.cat_path == b"/srv/box/data.bin" and not untouched.in_upper and not untouched.metacopy
    new = la.origin(b"/srv/box/new.txt")
    assert new.in_upper and not new.metacopy
    meta = la.origin(b"/srv/box/chmodded.bin")
    assert meta.in_upper and meta.metacopy  # data still the snapshot's
    assert not la.origin(b"/srv/box/moved.bin").metacopy  # redirected: its data is another path's
    assert la.origin(b"/srv/renamed/child") is None  # below a renamed directory: origin unknown
    assert la.origin(b"/srvx/file") is None  # not below the target


def test_host_paths_and_other_targets(tmp_path):
    merged = tmp_path / "merged"
    (merged / "etc").mkdir(parents=True)
    (merged / "etc" / "resolv.conf").write_text("host")
    la = _layer(tmp_path, target=b"/", prefix=b"", host_owned=frozenset({b"/etc/hostname"}),
                merged=os.fsencode(merged))
    assert la.origin(b"/etc/hostname") is None  # this box's own file shows there
    assert la.origin(b"/etc/resolv.conf") is None  # a host file above the snapshot
    assert la.origin(b"/etc/passwd").cat_path == b"/etc/passwd"
    # a mount at another target shows the whole catalog below it
    (tmp_path / "o").mkdir()
    other = _layer(tmp_path / "o", target=b"/mnt/view", prefix=b"")
    own = OwnMounts([other.mount])
    assert own.origin(b"/mnt/view/srv/box/a").cat_path == b"/srv/box/a"
    assert own.origin(b"/mnt/view").cat_path == b"/"
    assert own.origin(b"/elsewhere") is None and own.targets == frozenset({b"/mnt/view"})
