"""Git working trees: HEAD commit, branch, and whether there were changes.

HEAD, loose refs and ``packed-refs`` are read as files, so commit and
branch need no git binary.  Dirtiness needs ``git status``, which is run
with a timeout and defused so that nothing configured inside the
snapshotted repository executes:

* ``GIT_CONFIG_NOSYSTEM=1`` and ``GIT_CONFIG_GLOBAL=/dev/null`` drop the
  system and user configuration; command-line ``-c`` settings (which
  outrank the repository's own config) turn off ``core.fsmonitor`` (a
  command git would run), point ``core.hooksPath`` at ``/dev/null``, and
  blank the ``clean`` / ``smudge`` / ``process`` commands of every filter
  driver the repository config declares;
* a repository whose config uses ``include`` / ``includeIf`` is not handed
  to git at all (its included files could declare more filters), and
  dirtiness is recorded as unknown;
* ``GIT_OPTIONAL_LOCKS=0`` keeps status from rewriting the index, and
  ``safe.directory=*`` lets git read a tree owned by another user.

Submodules are not examined (``--ignore-submodules=all``).  ``dirty``
counts changes to tracked files only; untracked files are counted
separately in ``untracked``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from ogrefs.inspect.deadline import Deadline
from ogrefs.inspect.files import open_regular

__all__ = ["read_git", "git_executable", "parse_git_config", "sanitize_url"]

_SHA_RE = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")
_SECTION_RE = re.compile(r'^\s*\[\s*([A-Za-z0-9.-]+)(?:\s+"((?:[^"\\]|\\.)*)")?\s*\]')
_STATUS_TIMEOUT_S = 10.0


def git_executable() -> str | None:
    """The git binary to use, or None; a seam tests can patch."""
    return shutil.which("git")


def _read_text(path: str, limit: int = 1 << 20) -> str | None:
    try:
        with open_regular(path) as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


def parse_git_config(text: str) -> list[tuple[str, str | None, str, str]]:
    """(section, subsection, key, value) entries of a git config file."""
    entries = []
    section, sub = "", None
    for line in text.splitlines():
        s = line.strip()
        if not s or s[0] in "#;":
            continue
        m = _SECTION_RE.match(s)
        if m:
            section, sub = m.group(1).lower(), m.group(2)
            if "." in section and sub is None:  # [section.sub] old syntax
                section, sub = section.split(".", 1)
            s = s[m.end():].strip()
            if not s:
                continue
        key, sep, value = s.partition("=")
        entries.append((section, sub, key.strip().lower(), value.strip().strip('"') if sep else "true"))
    return entries


def sanitize_url(url: str) -> str:
    """Drop credentials from ``scheme://user:token@host/...`` URLs."""
    m = re.match(r"^([a-z][a-z0-9+.-]*://)([^/@]*@)(.*)$", url, re.I)
    return m.group(1) + m.group(3) if m else url


def _git_dirs(worktree: str) -> tuple[str, str] | None:
    """(git dir, common dir) of a working tree, or None."""
    dotgit = os.path.join(worktree, ".git")
    if os.path.isdir(dotgit):
        gitdir = dotgit
    else:
        text = _read_text(dotgit, 4096)
        if not text or not text.startswith("gitdir:"):
            return None
        gitdir = os.path.normpath(os.path.join(worktree, text[len("gitdir:"):].strip()))
    common = gitdir
    cd = _read_text(os.path.join(gitdir, "commondir"), 4096)
    if cd:
        common = os.path.normpath(os.path.join(gitdir, cd.strip()))
    return gitdir, common


def _resolve_ref(gitdir: str, common: str, ref: str, depth: int = 0) -> str | None:
    if depth > 5:
        return None
    for base in (gitdir, common):
        text = _read_text(os.path.join(base, ref), 4096)
        if text is not None:
            text = text.strip()
            if text.startswith("ref:"):
                return _resolve_ref(gitdir, common, text[4:].strip(), depth + 1)
            return text if _SHA_RE.match(text) else None
    packed = _read_text(os.path.join(common, "packed-refs"), 64 << 20) or ""
    for line in packed.splitlines():
        if not line or line[0] in "#^":
            continue
        sha, _, name = line.partition(" ")
        if name.strip() == ref and _SHA_RE.match(sha):
            return sha
    return None


def read_git(worktree: str, deadline: Deadline, check_dirty: bool = True) -> dict:
    """Describe the working tree at ``worktree`` (which has a ``.git`` entry)."""
    out: dict = {
        "path": worktree, "head": None, "branch": None, "detached": False,
        "dirty": None, "untracked": None, "remote": None,
    }
    dirs = _git_dirs(worktree)
    if dirs is None:
        out["error"] = "unreadable .git"
        return out
    gitdir, common = dirs
    head = (_read_text(os.path.join(gitdir, "HEAD"), 4096) or "").strip()
    if head.startswith("ref:"):
        ref = head[4:].strip()
        out["branch"] = ref[len("refs/heads/"):] if ref.startswith("refs/heads/") else ref
        out["head"] = _resolve_ref(gitdir, common, ref)
        if out["head"] is None:
            out["note"] = "branch has no commits yet"
    elif _SHA_RE.match(head):
        out["head"], out["detached"] = head, True
    else:
        out["error"] = "HEAD unreadable"

    cfg_text = _read_text(os.path.join(common, "config")) or ""
    wt_cfg = _read_text(os.path.join(gitdir, "config.worktree")) or ""
    entries = parse_git_config(cfg_text) + parse_git_config(wt_cfg)
    for section, sub, key, value in entries:
        if section == "remote" and sub == "origin" and key == "url":
            out["remote"] = sanitize_url(value)
    if check_dirty:
        _status(worktree, entries, deadline, out)
    else:
        out["dirty_unknown_reason"] = "not checked"
    return out


def _status(worktree: str, entries, deadline: Deadline, out: dict) -> None:
    git = git_executable()
    if git is None:
        out["dirty_unknown_reason"] = "git is not installed"
        return
    if any(section in ("include", "includeif") for section, _s, _k, _v in entries):
        out["dirty_unknown_reason"] = "repository config includes other files; git not run on it"
        return
    timeout = min(_STATUS_TIMEOUT_S, deadline.remaining())
    if timeout < 0.2:
        out["dirty_unknown_reason"] = "deadline reached before git status"
        return
    args = [
        git,
        "-c", "safe.directory=*",
        "-c", "core.fsmonitor=false",
        "-c", "core.hooksPath=/dev/null",
        "-c", "core.untrackedCache=false",
    ]
    filters = sorted({sub for section, sub, _k, _v in entries if section == "filter" and sub})
    for name in filters:
        for key in ("clean", "smudge", "process"):
            args += ["-c", f"filter.{name}.{key}="]
        args += ["-c", f"filter.{name}.required=false"]
    args += ["-C", worktree, "status", "--porcelain=v1", "-z", "--ignore-submodules=all"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_OPTIONAL_LOCKS="0",
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_TERMINAL_PROMPT="0",
        LC_ALL="C",
    )
    try:
        proc = subprocess.run(
            args, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, env=env,
        )
    except subprocess.TimeoutExpired:
        out["dirty_unknown_reason"] = f"git status timed out after {timeout:.1f} s"
        return
    except OSError as exc:
        out["dirty_unknown_reason"] = f"git could not run: {exc}"
        return
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        out["dirty_unknown_reason"] = f"git status failed: {err[-1] if err else proc.returncode}"
        return
    records = [r for r in proc.stdout.split(b"\0") if r]
    tracked = untracked = 0
    skip_next = False
    for r in records:
        if skip_next:  # the source path of a rename/copy
            skip_next = False
            continue
        if r.startswith(b"??"):
            untracked += 1
        elif r.startswith(b"!!"):
            continue
        else:
            tracked += 1
            if r[:1] in (b"R", b"C") or r[1:2] in (b"R", b"C"):
                skip_next = True
    out["dirty"] = tracked > 0
    out["changed_files"] = tracked
    out["untracked"] = untracked
