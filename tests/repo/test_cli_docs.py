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


def test_the_directories_ogrefs_keeps_are_documented_with_their_defaults():
    """README, --help and the man page name every directory variable the code reads, and --whole-box's skips."""
    from ogrefs.snapshot.walk import WHOLE_BOX_SKIP

    src = "\n".join(p.read_text() for p in (REPO_ROOT / "src" / "ogrefs").rglob("*.py"))
    dirs = sorted(set(re.findall(r"OGREFS_[A-Z]+_DIR\b", src)))
    assert {"OGREFS_CACHE_DIR", "OGREFS_STATE_DIR", "OGREFS_RUNTIME_DIR"} <= set(dirs)
    readme, top, page = README.read_text(), " ".join(ogrefs("--help").split()), ogrefs("help", "--man")
    for name in dirs:
        assert f"| `{name}` |" in readme and name in top and name in page, name
    assert "default /var/lib/ogrefs/mounts" in top and "/var/lib/ogrefs/mounts" in readme
    whole_box = " ".join(ogrefs("snapshot", "--help").split())
    for path in WHOLE_BOX_SKIP:
        assert os.fsdecode(path) in whole_box, path
    assert "/tmp, /var/tmp" in readme


def test_the_readme_opens_with_what_a_user_does_and_names_the_two_scripts():
    readme = README.read_text()
    heads = re.findall(r"^## (.+)$", readme, re.M)
    assert heads[:4] == ["Bring a box back on a new box", "Protect a box", "Look inside", "Install"], heads
    assert heads.index("Install") < heads.index("Commands")
    assert "scripts/demo" in readme.split("## ")[0] and "scripts/test" in readme.split("## ")[0]
    assert "Tests, by tier" not in readme and "expect_log" not in readme  # developer material: docs/development.md
    assert "Tests, by tier" in (REPO_ROOT / "docs" / "development.md").read_text()


def test_the_units_install_lines_work_on_an_empty_root(tmp_path):
    """Each `#   install ...` / `test ... || install ...` line of contrib/*.service, run with / moved to a fresh
    directory: none may assume /etc/ogrefs or /etc/systemd/system exists."""
    for unit in sorted((REPO_ROOT / "contrib").glob("*.service")):
        root = tmp_path / unit.stem
        root.mkdir()
        lines = [line[1:].split(" # ")[0].strip() for line in unit.read_text().splitlines()
                 if re.match(r"#\s+(install|test) ", line)]
        assert len(lines) >= 2, unit.name
        script = "\n".join(line.replace(" /etc/", f" {root}/etc/") for line in lines)
        proc = subprocess.run(["bash", "-euc", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, (unit.name, proc.stderr)
        assert (root / "etc/systemd/system" / unit.name).is_file()
        assert (root / "etc/ogrefs/env").stat().st_mode & 0o777 == 0o600
