"""Git working trees, made with the git CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from ogrefs.inspect import capture_environment
from ogrefs.inspect import gitrepo
from ogrefs.inspect.deadline import Deadline
from ogrefs.inspect.gitrepo import read_git, sanitize_url

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

GIT_ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
    "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com",
    "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
}


def git(cwd, *args) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env=GIT_ENV, check=True,
                          capture_output=True, text=True).stdout.strip()


def make_repo(path, branch="main") -> str:
    os.makedirs(path)
    git(path, "init", "-q", "-b", branch)
    with open(os.path.join(path, "train.py"), "w") as f:
        f.write("print('hi')\n")
    git(path, "add", "train.py")
    git(path, "commit", "-q", "-m", "first")
    return git(path, "rev-parse", "HEAD")


def test_uncommitted_change_is_dirty(tmp_path):
    repo = tmp_path / "code"
    head = make_repo(repo, branch="exp")
    (repo / "train.py").write_text("print('changed')\n")
    (repo / "scratch.txt").write_text("x")
    info = read_git(str(repo), Deadline(10))
    assert info["head"] == head and len(head) == 40
    assert info["branch"] == "exp" and info["detached"] is False
    assert info["dirty"] is True and info["changed_files"] == 1 and info["untracked"] == 1


def test_clean_and_untracked_only(tmp_path):
    repo = tmp_path / "code"
    make_repo(repo)
    assert read_git(str(repo), Deadline(10))["dirty"] is False
    (repo / "new.txt").write_text("x")
    info = read_git(str(repo), Deadline(10))
    assert info["dirty"] is False and info["untracked"] == 1


def test_packed_refs_detached_and_worktree(tmp_path):
    repo = tmp_path / "code"
    head = make_repo(repo)
    git(repo, "pack-refs", "--all", "--prune")
    assert not (repo / ".git" / "refs" / "heads" / "main").exists()
    assert read_git(str(repo), Deadline(10))["head"] == head

    wt = tmp_path / "wt"
    git(repo, "worktree", "add", "-q", "-b", "side", str(wt))
    info = read_git(str(wt), Deadline(10))
    assert (wt / ".git").is_file()
    assert info["head"] == head and info["branch"] == "side" and info["dirty"] is False

    git(repo, "checkout", "-q", "--detach")
    info = read_git(str(repo), Deadline(10))
    assert info["detached"] is True and info["head"] == head and info["branch"] is None


def test_no_commits_yet(tmp_path):
    repo = tmp_path / "empty"
    os.makedirs(repo)
    git(repo, "init", "-q", "-b", "main")
    info = read_git(str(repo), Deadline(10))
    assert info["head"] is None and info["branch"] == "main" and info["note"] == "branch has no commits yet"


def test_git_missing_records_unknown(tmp_path, monkeypatch):
    repo = tmp_path / "code"
    head = make_repo(repo)
    (repo / "train.py").write_text("changed\n")
    monkeypatch.setattr(gitrepo, "git_executable", lambda: None)
    info = read_git(str(repo), Deadline(10))
    assert info["head"] == head
    assert info["dirty"] is None and info["dirty_unknown_reason"] == "git is not installed"


def test_repository_config_cannot_run_commands(tmp_path):
    repo = tmp_path / "code"
    make_repo(repo)
    fsmon_marker, filter_marker = tmp_path / "fsmonitor-ran", tmp_path / "filter-ran"
    hook = tmp_path / "hook.sh"
    hook.write_text(f"#!/bin/sh\ntouch {fsmon_marker}\nexit 1\n")
    hook.chmod(0o755)
    git(repo, "config", "core.fsmonitor", str(hook))
    git(repo, "config", "filter.evil.clean", f"sh -c 'touch {filter_marker}; cat'")
    (repo / ".gitattributes").write_text("*.py filter=evil\n")
    # Stale stat data makes git re-read train.py through the clean filter.
    os.utime(repo / "train.py", (time.time() + 100, time.time() + 100))

    # Control: plain git status does run both.
    subprocess.run(["git", "status", "--porcelain"], cwd=repo, env=GIT_ENV, capture_output=True)
    assert fsmon_marker.exists() and filter_marker.exists()
    fsmon_marker.unlink()
    filter_marker.unlink()

    info = read_git(str(repo), Deadline(10))
    assert info["dirty"] is False  # content unchanged
    assert not fsmon_marker.exists() and not filter_marker.exists()


def test_config_with_include_is_not_handed_to_git(tmp_path):
    repo = tmp_path / "code"
    make_repo(repo)
    with open(repo / ".git" / "config", "a") as f:
        f.write("[include]\n\tpath = ../../elsewhere.cfg\n")
    info = read_git(str(repo), Deadline(10))
    assert info["dirty"] is None and "includes other files" in info["dirty_unknown_reason"]


def test_slow_git_is_cut_off(tmp_path, monkeypatch):
    repo = tmp_path / "code"
    make_repo(repo)
    fake = tmp_path / "slowgit"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setattr(gitrepo, "git_executable", lambda: str(fake))
    t0 = time.monotonic()
    info = read_git(str(repo), Deadline(0.8))
    assert time.monotonic() - t0 < 5
    assert info["dirty"] is None and "timed out" in info["dirty_unknown_reason"]


def test_remote_credentials_are_dropped(tmp_path):
    repo = tmp_path / "code"
    make_repo(repo)
    git(repo, "remote", "add", "origin", "https://bob:ghp_secret@github.com/acme/model.git")
    info = read_git(str(repo), Deadline(10))
    assert info["remote"] == "https://github.com/acme/model.git"
    assert sanitize_url("git@github.com:acme/model.git") == "git@github.com:acme/model.git"


def test_capture_finds_repos(tmp_path):
    head = make_repo(tmp_path / "a")
    make_repo(tmp_path / "b" / "nested")
    (tmp_path / "a" / "train.py").write_text("edit\n")
    env = capture_environment([str(tmp_path)], deadline_s=20)
    repos = {r["path"]: r for r in env["git"]}
    assert set(repos) == {str(tmp_path / "a"), str(tmp_path / "b" / "nested")}
    assert repos[str(tmp_path / "a")]["dirty"] is True and repos[str(tmp_path / "a")]["head"] == head
    assert repos[str(tmp_path / "b" / "nested")]["dirty"] is False
