"""box/safepath.py: which symlinks root follows on its way to a mount target (issue 46)."""

from __future__ import annotations

import os

import pytest

from ogrefs.box import safepath

USER = 4321


def _ino(fd: int) -> int:
    try:
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


@pytest.fixture
def tree(tmp_path):
    """root-only/dir, a user's home with a symlink of its own, a root-owned sticky directory."""
    (tmp_path / "root-only/dir").mkdir(parents=True)
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, USER, USER)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    return tmp_path


def test_a_users_symlink_is_refused_and_roots_own_is_followed(tree):
    (tree / "home/proj").symlink_to(tree / "root-only/dir")
    os.lchown(tree / "home/proj", USER, USER)
    with pytest.raises(safepath.Untrusted, match=f"home/proj is a symlink that user {USER} can change"):
        safepath.open_dir(str(tree / "home/proj/sub"), create=True)
    assert not (tree / "root-only/dir/sub").exists()  # nothing made through it either
    (tree / "link").symlink_to("root-only/dir")  # root's, in a directory only root writes
    fd, trusted = safepath.open_dir(str(tree / "link"))
    assert _ino(fd) == (tree / "root-only/dir").stat().st_ino and trusted


def test_a_root_symlink_in_a_users_directory_is_refused(tree):
    """The user can rename root's link away and put its own under the name: not root's to trust."""
    (tree / "home/proj").symlink_to(tree / "root-only/dir")
    with pytest.raises(safepath.Untrusted, match=f"user {USER} can change"):
        safepath.open_dir(str(tree / "home/proj"))


def test_sticky_directory_trusts_only_roots_entries(tree):
    (tree / "sticky/roots").symlink_to(tree / "root-only/dir")
    assert _ino(safepath.open_dir(str(tree / "sticky/roots"))[0]) == (tree / "root-only/dir").stat().st_ino
    (tree / "sticky/users").symlink_to(tree / "root-only/dir")
    os.lchown(tree / "sticky/users", USER, USER)
    with pytest.raises(safepath.Untrusted):
        safepath.open_dir(str(tree / "sticky/users"))


def test_a_users_real_directory_is_reached_but_not_trusted_by_name(tree):
    (tree / "home/proj").mkdir()
    fd, trusted = safepath.open_dir(str(tree / "home/proj"))
    assert _ino(fd) == (tree / "home/proj").stat().st_ino and not trusted
    fd, trusted = safepath.open_dir(str(tree / "root-only/dir"))
    assert _ino(fd) == (tree / "root-only/dir").stat().st_ino and trusted


def test_inside_a_snapshot_no_symlink_is_followed(tree):
    (tree / "link").symlink_to("root-only/dir")
    top = os.open(str(tree), os.O_PATH | os.O_DIRECTORY)
    try:
        with pytest.raises(safepath.Untrusted, match="not followed there"):
            safepath.open_dir("link/x", create=True, start=top, follow=False)
        fd, _ = safepath.open_dir("made/here", create=True, start=top, follow=False)
        os.close(fd)
    finally:
        os.close(top)
    assert (tree / "made/here").is_dir() and not (tree / "root-only/dir/x").exists()
