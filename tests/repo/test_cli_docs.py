"""The README's command table, the man page and shell completion match the commands (through the entry point)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from tests import REPO_ROOT

README = REPO_ROOT / "README.md"


def ogrefs(*args: str, env: dict | None = None) -> str:
    proc = subprocess.run([sys.executable, "-m", "ogrefs", *args], capture_output=True, text=True, timeout=60,
                          env=env or dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _help_commands(*words: str) -> dict[str, str]:
    """Subcommand -> its one-line summary, as `ogrefs WORDS --help` lists them."""
    text = ogrefs(*words, "--help")
    block = text.split("Commands:\n", 1)[1] if "Commands:\n" in text else ""
    out = {}
    for line in block.split("\n\n", 1)[0].splitlines():
        m = re.match(r"  (\S+)\s+(.*)", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def test_the_readme_command_table_matches_help():
    rows = dict(re.findall(r"^\| `(ogrefs [^`]+)` \| (.+) \|$", README.read_text(), re.M))
    listed = {}
    for name, summary in _help_commands().items():
        listed[f"ogrefs {name}"] = summary
        for sub, sub_summary in _help_commands(name).items():
            listed[f"ogrefs {name} {sub}"] = sub_summary
    assert sorted(rows) == sorted(listed)  # every command, and no command that is gone
    for path, summary in listed.items():
        shown = summary.removesuffix("...").rstrip()
        assert rows[path].startswith(shown), (path, rows[path], summary)  # --help truncates long summaries


def test_help_man_covers_every_command_and_the_exit_codes():
    page = ogrefs("help", "--man")
    assert page.startswith(".TH OGREFS 1")
    for name in _help_commands():
        assert f".SS ogrefs {name}" in page, name
    assert ".SH EXIT STATUS" in page and "10 no repository" in " ".join(page.split())
    assert "ogrefs key add" in ogrefs("help", "key", "add")


def test_shell_completion_completes_commands_and_options():
    env = dict(os.environ, _OGREFS_COMPLETE="bash_complete", COMP_WORDS="ogrefs snaps", COMP_CWORD="1")
    assert "plain,snapshots" in ogrefs(env=env).splitlines()
    env.update(COMP_WORDS="ogrefs ls --lo", COMP_CWORD="2")
    assert "plain,--long" in ogrefs(env=env).splitlines()
    assert "_ogrefs_completion" in ogrefs(env=dict(os.environ, _OGREFS_COMPLETE="bash_source"))
    assert "_OGREFS_COMPLETE" in README.read_text() and "help --man" in README.read_text()
