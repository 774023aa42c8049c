"""The shipped systemd units (contrib/): what they order, wait for and tell the user (issue 47)."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def unit(name: str) -> dict[str, list[str]]:
    """``Section.Key`` -> every value given (systemd keys repeat and accumulate), comments left out."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in (REPO / "contrib" / name).read_text().splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out.setdefault(f"{section}.{key}", []).append(value)
    return out


def words(values: list[str]) -> set[str]:
    return {w for v in values for w in v.split()}


def test_sshd_and_the_gettys_start_from_this_box_own_tree_before_the_mount():
    """Started during or after the mount they ran the snapshot's programs and held the old tree, so a restart of
    the unit was refused (3 boots in 4): the unit comes after them, and never before them."""
    u = unit("ogrefs-resume.service")
    after, before = words(u["Unit.After"]), words(u["Unit.Before"])
    assert {"ssh.service", "ssh.socket", "sshd.service", "getty.target"} <= after
    assert not before & {"ssh.service", "sshd.service", "getty.target", "systemd-user-sessions.service"}
    wait = [c for c in u["Service.ExecStartPre"] if "(agetty)" in c]
    assert len(wait) == 1 and wait[0].startswith("-")  # a failed wait never stops the mount


def test_the_getty_wait_returns_at_once_without_a_pending_getty():
    u = unit("ogrefs-resume.service")
    cmd = next(c for c in u["Service.ExecStartPre"] if "(agetty)" in c).lstrip("-")
    script = cmd.split(" -c ", 1)[1].strip("'").replace("$$", "$")  # systemd's escaping of a literal $
    assert subprocess.run(["/bin/sh", "-c", script], timeout=30).returncode == 0


def test_the_unit_names_the_box_to_bring_back_not_this_machine():
    text = (REPO / "contrib/ogrefs-resume.service").read_text()
    assert "<name of this box>" not in text
    assert "OGREFS_BOX=<the box to bring back>" in text and "`ogrefs snapshots` lists it" in text
    assert unit("ogrefs-resume.service")["Service.ExecStart"] == ["/usr/local/bin/ogrefs -q mount ${OGREFS_BOX}:latest /"]
