"""The shipped systemd units (contrib/): what they order, wait for and tell the user (issue 47)."""

from __future__ import annotations

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
    # a getty forked before the unit but not yet exec'd is waited for by `mount /` itself (holders.unstarted),
    # beside the daemon's start, not by a step before it that guessed from process names
    assert "Service.ExecStartPre" not in u


def test_the_unit_names_the_box_to_bring_back_not_this_machine():
    text = (REPO / "contrib/ogrefs-resume.service").read_text()
    assert "<name of this box>" not in text
    assert "OGREFS_BOX=<the box to bring back>" in text and "`ogrefs snapshots` lists it" in text
    assert unit("ogrefs-resume.service")["Service.ExecStart"] == ["/usr/local/bin/ogrefs -q mount ${OGREFS_BOX}:latest /"]
