"""What a snapshot records of its OS release, and the refusal of another release's box at / (issue 47)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ogrefs.box import overlay
from ogrefs.errors import UsageError
from ogrefs.inspect.machine import machine_info
from ogrefs.inspect.release import glibc_version, openssh_version, release_differences, release_name, system_versions
from ogrefs.inspect.release import systemd_major
from ogrefs.mount.checks import check_release
from ogrefs.mount.options import MountOptions
from ogrefs.repo import codec

from tests.cli_run import assert_one_line_error, env, run  # noqa: F401  (env is a fixture)


def _root(tmp_path: Path, glibc: str, systemd: int, ssh: str, multiarch: bool = True) -> Path:
    """A root with the three files the probes read, as Debian 12 / 13 lay them out (padding around them)."""
    root = tmp_path / f"root-{glibc}"
    libdir = root / ("usr/lib/x86_64-linux-gnu" if multiarch else "usr/lib64")
    libdir.mkdir(parents=True)
    (libdir / "libc.so.6").write_bytes(os.urandom(4096).replace(b"\n", b"x") + b"\x00GNU C Library (Debian GLIBC "
                                       + glibc.encode() + b"-9) stable release version " + glibc.encode()
                                       + b".\n" + os.urandom(4096))
    sd = libdir / "systemd" if multiarch else root / "usr/lib/systemd"
    sd.mkdir(parents=True)
    (sd / f"libsystemd-shared-{systemd}.so").write_bytes(b"\x7fELF")
    (sd / f"libsystemd-core-{systemd}.so").write_bytes(b"\x7fELF")
    (root / "usr/sbin").mkdir(parents=True)
    (root / "usr/sbin/sshd").write_bytes(b"\x7fELF..." + f"OpenSSH_{ssh} Debian-2".encode() + b"\x00...")
    return root


def test_versions_are_read_from_a_roots_files(tmp_path):
    bookworm = _root(tmp_path, "2.36", 252, "9.2p1")
    trixie = _root(tmp_path, "2.41", 257, "10.0p2", multiarch=False)
    assert system_versions(str(bookworm)) == {"glibc": "2.36", "systemd": 252, "openssh": "9.2"}
    assert system_versions(str(trixie)) == {"glibc": "2.41", "systemd": 257, "openssh": "10.0"}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (glibc_version(str(empty)), systemd_major(str(empty)), openssh_version(str(empty))) == (None, None, None)
    os.mkfifo(empty / "libc.so.6")  # never waited on: only regular files are read
    (empty / "lib64").mkdir()
    os.mkfifo(empty / "lib64/libc.so.6")
    assert glibc_version(str(empty)) is None


def test_this_machine_records_its_release():
    m = machine_info()
    assert m["glibc"] == os.confstr("CS_GNU_LIBC_VERSION").split()[1]  # the libc this Python runs on
    assert isinstance(m["systemd"], int) or m["systemd"] is None
    assert release_name(m).startswith((m["os"] or {}).get("pretty_name", "an unknown OS"))


def _machine(version: str, glibc: str | None, systemd: int | None, ssh: str | None = None) -> dict:
    codename = {"12": "bookworm", "13": "trixie"}[version]
    return {"os": {"id": "debian", "version_id": version, "pretty_name": f"Debian GNU/Linux {version} ({codename})"},
            "glibc": glibc, "systemd": systemd, "openssh": ssh}


def test_release_differences_name_each_part_and_skip_what_is_not_recorded():
    a, b = _machine("12", "2.36", 252, "9.2"), _machine("13", "2.41", 257, "10.0")
    assert release_differences(a, b) == ["OS version 12 here 13", "glibc 2.36 here 2.41", "systemd 252 here 257",
                                         "OpenSSH 9.2 here 10.0"]
    assert release_differences(a, dict(a)) == []
    old = _machine("12", None, None)  # a snapshot taken before glibc and systemd were recorded
    assert release_differences(old, a) == []
    assert release_differences(old, b) == ["OS version 12 here 13"]
    assert release_name(a) == "Debian GNU/Linux 12 (bookworm), glibc 2.36, systemd 252"


def _manifest(machine: dict | None, whole_box: bool = True, paths=("/",)) -> dict:
    m = {"id": "ab" * 32, "whole_box": whole_box, "paths": list(paths)}
    if machine is not None:
        m["environment"] = {"machine": machine}
    return m


def _opts(**kw) -> MountOptions:
    return MountOptions(repo_url="file:///nowhere", snapshot="gpu-a:latest", mountpoint=Path("/"), read_only=False,
                        **kw)


def test_check_release_refuses_another_release_at_root_only():
    here = machine_info()
    other = dict(here, os=dict(here["os"], version_id="1" + (here["os"].get("version_id") or "0")), glibc="1.0")
    with pytest.raises(UsageError) as exc:
        check_release(_manifest(other), Path("/"), _opts())
    line = str(exc.value)
    assert "\n" not in line and "refusing to mount snapshot abababababab at /" in line
    assert "glibc 1.0 here" in line
    assert "`ogrefs run abababababab -- CMD`" in line and "`ogrefs mount --data-only gpu-a:latest /`" in line
    check_release(_manifest(here), Path("/"), _opts())  # the same release: no refusal
    check_release(_manifest(other), Path("//"), _opts(data_only=True))  # its data paths only
    check_release(_manifest(other), Path("/mnt/a"), _opts())  # not over this box's system
    check_release(_manifest(other, whole_box=False, paths=["/home/u/proj"]), Path("/"), _opts())  # data only
    with pytest.raises(UsageError, match="refusing to mount"):  # a system path named: checked too
        check_release(_manifest(other, whole_box=False, paths=["/usr/local/lib/x"]), Path("/"), _opts())
    with pytest.raises(UsageError, match="records no OS release"):
        check_release(_manifest(None), Path("/"), _opts())


def test_data_only_leaves_the_system_directories_to_this_box(tmp_path):
    skipped: list[dict] = []
    top = ["bin", "boot", "etc", "home", "lib", "lib64", "opt", "proc", "root", "sbin", "srv", "usr", "var",
           "workspace"]
    plans = overlay.plan(["/"], tmp_path / "lower", Path("/"), tmp_path, top_level=top, skipped=skipped,
                         data_only=True)
    assert [o.target for o in plans] == ["/home", "/opt", "/root", "/srv", "/workspace"]
    assert all(o.keep_existing for o in plans)
    said = {s["path"]: s["reason"] for s in skipped}
    assert said["/usr"] == "the box's own /usr is kept (--data-only)"
    assert set(said) == {"/bin", "/boot", "/etc", "/lib", "/lib64", "/proc", "/sbin", "/usr", "/var"}
    named = overlay.plan(["/usr/local/x", "/opt/p"], tmp_path / "lower", Path("/"), tmp_path, skipped=skipped,
                         data_only=True)
    assert [o.target for o in named] == ["/opt/p"]


@pytest.mark.parametrize("mode", ["fuse", "no-fuse"])
def test_mount_at_root_of_another_release_is_one_line_and_mounts_nothing(tmp_path, env, mode):  # noqa: F811
    """Also written in place (no FUSE: a pod), where another release's /usr would stay for good."""
    if os.geteuid() != 0 or (mode == "fuse" and not os.path.exists("/dev/fuse")):
        pytest.skip("a mount at / needs root (and FUSE)")
    box = tmp_path / "box"
    (box / "etc").mkdir(parents=True)
    (box / "etc/os-release").write_text("ID=debian\n")
    run(["init"], env)
    snap = json.loads(run(["-q", "snapshot", "--json", str(box)], env).stdout)
    key = tmp_path / "repo" / "snapshots" / snap["id"]
    m = json.loads(codec.unwrap(key.read_bytes()))
    m["whole_box"] = True  # as a whole-box snapshot of a box of another release records it
    m["environment"]["machine"].update(os={"id": "debian", "version_id": "11", "pretty_name": "Debian 11"},
                                       glibc="2.31", systemd=247)
    key.write_bytes(codec.wrap(json.dumps(m).encode()))
    env = dict(env, OGREFS_STATE_DIR=str(tmp_path / "state"), OGREFS_RUNTIME_DIR=str(tmp_path / "run"))
    before = set(Path("/proc/self/mountinfo").read_text().splitlines())
    proc = run(["mount", snap["id"], "/"] + (["--no-fuse"] if mode == "no-fuse" else []), env, check=False)
    assert_one_line_error(proc, f"refusing to mount snapshot {snap['id'][:12]} at /: it is Debian 11, glibc 2.31")
    assert "`ogrefs shell" in proc.stderr and "--data-only" in proc.stderr
    # judged by what names this test's paths, or /: anything else on the box may mount meanwhile
    after = set(Path("/proc/self/mountinfo").read_text().splitlines())
    assert not [line for line in after - before if str(tmp_path) in line or line.split()[4] == "/"]
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())


def test_run_merge_is_warned_of_another_release_only():
    from ogrefs.inspect.compat import release_note

    here = machine_info()
    assert release_note(_manifest(here)) is None
    other = dict(here, glibc="1.0")
    assert release_note(_manifest(other)) == release_name(here)
    assert release_note(_manifest(None)) is None  # nothing recorded: nothing to say
