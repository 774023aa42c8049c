"""Host-owned merges (box/hostpaths.py): accounts with clashing ids, the dpkg status file."""

from __future__ import annotations

from pathlib import Path

from ogrefs.box import hostpaths

SNAP_PASSWD = ("root:x:0:0:root:/root:/bin/bash\n_apt:x:42:65534::/nonexistent:/usr/sbin/nologin\n"
               "ubuntu:x:1000:1000:Ubuntu:/home/ubuntu:/bin/bash\nalice:x:1001:1001::/home/alice:/bin/bash\n")
SNAP_GROUP = "root:x:0:\nsudo:x:27:ubuntu,alice\nubuntu:x:1000:\nalice:x:1001:\n"
SNAP_SHADOW = "root:*:19000:0:99999:7:::\nubuntu:!:19000:0:99999:7:::\nalice:!:19000:0:99999:7:::\n"
HOST_PASSWD = "root:x:0:0:root:/root:/bin/bash\nadmin:x:1000:1000:Debian:/home/admin:/bin/bash\n"
HOST_GROUP = "root:x:0:\nsudo:x:27:admin\nadmin:x:1000:\n"
HOST_SHADOW = "root:*:19500:0:99999:7:::\nadmin:!:19500:0:99999:7:::\n"


def boxes(tmp_path: Path) -> tuple[Path, Path]:
    snap, host = tmp_path / "snap", tmp_path / "host"
    for d, files in ((snap, (SNAP_PASSWD, SNAP_GROUP, SNAP_SHADOW)), (host, (HOST_PASSWD, HOST_GROUP, HOST_SHADOW))):
        d.mkdir(exist_ok=True)
        for name, text in zip(("passwd", "group", "shadow"), files):
            (d / name).write_text(text)
    return snap, host


def merged(tmp_path: Path, name: str) -> list[list[str]]:
    snap, host = boxes(tmp_path)
    text = hostpaths.merge_accounts(f"{host}/{name}", (snap / name).read_text(), (host / name).read_text(),
                                    host_dir=str(host), snap_dir=str(snap))
    return [line.split(":") for line in text.splitlines()]


def test_a_login_uid_held_by_this_box_is_this_box_users_only(tmp_path):
    rows = merged(tmp_path, "passwd")
    assert [r[0] for r in rows if r[2] == "1000"] == ["admin"]
    assert [r[0] for r in rows] == ["root", "_apt", "alice", "admin"]  # the snapshot's others stay
    assert [r for r in rows if r[0] == "admin"] == [HOST_PASSWD.splitlines()[1].split(":")]


def test_groups_and_shadow_follow(tmp_path):
    groups = {r[0]: r for r in merged(tmp_path, "group")}
    assert [n for n, r in groups.items() if r[2] == "1000"] == ["admin"]
    assert groups["sudo"][3].split(",") == ["alice", "admin"]  # ubuntu is gone, admin stays in sudo
    shadow = [r[0] for r in merged(tmp_path, "shadow")]
    assert shadow == ["root", "alice", "admin"]


def test_clashes_are_named(tmp_path):
    snap, host = boxes(tmp_path)
    clash = hostpaths.account_clashes(str(snap), str(host))
    assert (clash.users, clash.groups) == ({"ubuntu": "admin"}, {"ubuntu": "admin"})


STATUS_SNAP = ("Package: libc6\nStatus: install ok installed\nVersion: 2.36-9\n\n"
               "Package: nvidia-driver-lab\nStatus: install ok installed\nVersion: 535.104.05-1\n\n"
               "Package: nvidia-cuda-toolkit\nStatus: install ok installed\nVersion: 12.0.140~12.0.1-4\n\n"
               "Package: libnvidia-ml1\nStatus: install ok installed\nVersion: 535.104.05-1\n")
STATUS_HOST = ("Package: libc6\nStatus: install ok installed\nVersion: 2.36-9+deb12u4\n\n"
               "Package: nvidia-driver-lab\nStatus: install ok installed\nVersion: 550.54.15-1\n")


def test_dpkg_status_takes_this_boxs_driver_records_and_the_snapshots_others():
    text = hostpaths.merge_dpkg_status(STATUS_SNAP, STATUS_HOST)
    stanzas = [dict(ln.split(": ", 1) for ln in block.splitlines()) for block in text.strip().split("\n\n")]
    assert [(s["Package"], s["Version"]) for s in stanzas] == [
        ("libc6", "2.36-9"), ("nvidia-cuda-toolkit", "12.0.140~12.0.1-4"), ("nvidia-driver-lab", "550.54.15-1")]
    assert text.endswith("\n\n") and "\n\n\n" not in text


def test_dpkg_status_keeps_this_boxs_own_packages_the_snapshot_does_not_have():
    """Issue 47: their files still show (this box's own directory is the overlays' lowest layer), so dpkg
    must know them; a package both sides have is the snapshot's (its files cover this box's)."""
    host = STATUS_HOST + ("\nPackage: provider-agent\nStatus: install ok installed\nArchitecture: amd64\n"
                          "Version: 3.1\nDescription: the provider's agent\n more lines: of text\n\n"
                          "Package: libc6\nStatus: install ok installed\nArchitecture: i386\nVersion: 2.36-9+deb12u4\n")
    snap = STATUS_SNAP.replace("Package: libc6\n", "Package: libc6\nArchitecture: amd64\n", 1)
    host = host.replace("Package: libc6\n", "Package: libc6\nArchitecture: amd64\n", 1)
    text = hostpaths.merge_dpkg_status(snap, host)
    stanzas = [dict(ln.split(": ", 1) for ln in block.splitlines() if not ln.startswith(" "))
               for block in text.strip().split("\n\n")]
    assert [(s["Package"], s.get("Architecture"), s["Version"]) for s in stanzas] == [
        ("libc6", "amd64", "2.36-9"), ("nvidia-cuda-toolkit", None, "12.0.140~12.0.1-4"),
        ("nvidia-driver-lab", None, "550.54.15-1"), ("provider-agent", "amd64", "3.1"),
        ("libc6", "i386", "2.36-9+deb12u4")]  # another architecture is another package
    assert " more lines: of text\n" in text


def test_dpkg_rule_is_a_default_and_parses():
    assert hostpaths.Rule("dpkg", "/var/lib/dpkg/status") in hostpaths.load_rules()
    rules, _ = hostpaths.parse_rules("dpkg /var/lib/dpkg/status\n", "f")
    assert rules == [hostpaths.Rule("dpkg", "/var/lib/dpkg/status")]
