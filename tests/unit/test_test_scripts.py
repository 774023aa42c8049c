"""The shell scripts the system tests run assert what they say (tests/nsbox.py's ``SCRIPT_HEAD``).

A ``! CMD`` line in the middle of a ``set -e`` script asserts nothing: bash ignores the status of a negated
command unless it is the script's last or its status is used (``! CMD || { ...; exit 1; }``). The scripts
say ``fails CMD`` instead.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.nsbox import SCRIPT_HEAD

ROOT = Path(__file__).resolve().parents[2]
#: A script line that negates a command and uses its status neither on the line (``||``) nor on the next (``\``).
BARE_NEGATION = re.compile(r"^\s+! (?!.*\|\|)(?!.*\\$).*$")


def test_no_test_script_negates_a_command_without_using_its_status():
    files = sorted((ROOT / "tests").rglob("*.py"))
    assert len(files) > 50, "the walk found too few test files: it is wrong"
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in files
             for n, line in enumerate(p.read_text().splitlines(), 1) if BARE_NEGATION.match(line)]
    assert not found, "say `fails CMD` (tests/nsbox.py), not `! CMD`:\n" + "\n".join(found)


def test_the_rule_finds_a_bare_negation_and_lets_a_used_one_be():
    assert BARE_NEGATION.match('        ! kill -0 "$pid" 2>/dev/null')
    assert not BARE_NEGATION.match('        ! grep -q x f || { echo left >&2; exit 1; }')
    assert not BARE_NEGATION.match('        ! grep x f | grep y >&2 \\')
    assert not BARE_NEGATION.match('        fails kill -0 "$pid"')


def _script(body: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", SCRIPT_HEAD + body], capture_output=True, text=True, timeout=10)


def test_fails_stops_the_script_where_its_command_succeeds_and_says_which():
    proc = _script("fails true 2>/dev/null\necho after\n")
    assert proc.returncode == 1
    assert "after" not in proc.stdout
    assert "should have failed, and succeeded: true" in proc.stdout  # on stdout too: stderr went to /dev/null


def test_fails_lets_the_script_go_on_where_its_command_fails():
    proc = _script("fails false\nfails test -e /nonexistent/x\necho after\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "after\n"


def test_a_bare_negation_in_the_middle_asserts_nothing():
    """Why ``fails`` exists: the same check as ``! true`` lets the script go on and succeed."""
    proc = _script("! true\necho after\n")
    assert proc.returncode == 0 and proc.stdout == "after\n"
