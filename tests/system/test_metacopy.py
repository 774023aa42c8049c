"""overlayfs metadata-only copy-up on a real writable ogrefs mount (``OGREFS_METACOPY=1``) (tier 5).

A chmod/chown of a file the mount has not fetched copies up its metadata only
(``trusted.overlay.metacopy`` in the upper directory, no data blocks): nothing
is fetched, and the next ``ogrefs snapshot`` takes the file's chunk list from
the mounted snapshot without reading it.  Boxes are private mount namespaces
with a fresh tmpfs at ``/srv`` (see test_loop.py).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.system.test_loop import BOX, OGREFS, PY, _fetched, _fresh_status, box, loop  # noqa: F401  (loop: fixture)
from tests.system.test_loop import pytestmark  # noqa: F401  (fuse, unshare, /srv)


def _json(loop: dict, *args: str) -> dict:
    proc = subprocess.run([PY, "-m", "ogrefs", *args], env=loop["env"], check=True, capture_output=True, text=True,
                          timeout=120)
    return json.loads(proc.stdout)


def test_chmod_and_chown_on_a_metacopy_mount_fetch_nothing_and_the_snapshot_reads_nothing(loop):
    tmp = loop["tmp"]
    big = tmp / "big.bin"
    big.write_bytes(os.urandom(3_000_000))
    box(loop, f"""
        mkdir -p {BOX}/data
        cp {big} {BOX}/data/big.bin
        echo small > {BOX}/data/small.txt
        {OGREFS} -q snapshot {BOX} --json > {tmp}/a.json
    """)
    a = json.loads((tmp / "a.json").read_text())
    loop["env"]["OGREFS_METACOPY"] = "1"
    box(loop, f"""
        {OGREFS} -q mount --no-materialize {a["id"]} /
        {OGREFS} status / --wait --json > /dev/null   # the mount's prefetch has ended
        grep " {BOX} " /proc/self/mountinfo > {tmp}/mountinfo
        {_fresh_status(tmp / "before.json")}
        chmod 0600 {BOX}/data/big.bin
        chown 1234:5678 {BOX}/data/big.bin
        {PY} - <<'PY'
import glob, json, os
(up,) = [p for p in glob.glob({str(tmp / "state")!r} + "/**/upper/*/data/big.bin", recursive=True)]
st = os.lstat(up)
json.dump({{"xattrs": os.listxattr(up), "blocks": st.st_blocks, "size": st.st_size}}, open({str(tmp / "upper.json")!r}, "w"))
PY
        {OGREFS} -q snapshot {BOX} --json > {tmp}/b.json
        {_fresh_status(tmp / "after.json")}
        {OGREFS} unmount /
    """)
    assert "metacopy=on" in (tmp / "mountinfo").read_text()
    upper = json.loads((tmp / "upper.json").read_text())
    # metadata only: the full size, at most one block on disk (ext4 keeps the overlay's xattrs in one)
    assert "trusted.overlay.metacopy" in upper["xattrs"] and upper["blocks"] * 512 <= 4096 \
        and upper["size"] == 3_000_000, upper
    assert _fetched(tmp, "after.json") == _fetched(tmp, "before.json")  # neither the chmod nor the snapshot fetched
    b = json.loads((tmp / "b.json").read_text())
    assert b["parent"] == a["id"]
    assert b["totals"]["read_bytes"] == 0 and b["totals"]["mount_reused_files"] == 2, b["totals"]
    node = [n for n in map(json.loads, subprocess.run(
        [PY, "-m", "ogrefs", "ls", "--json", b["id"], f"{BOX}/data/big.bin"], env=loop["env"], check=True,
        capture_output=True, text=True, timeout=120).stdout.splitlines()) if n.get("struct_type") == "node"]
    assert [(n["mode"] & 0o7777, n["uid"], n["gid"]) for n in node] == [(0o600, 1234, 5678)]
    # the same chunks as A's: the two snapshots together hold no chunk A did not
    assert _json(loop, "stats", "--mode", "raw", "--json", a["id"], b["id"])["total_blob_count"] == \
        _json(loop, "stats", "--mode", "raw", "--json", a["id"])["total_blob_count"]
    dumped = subprocess.run([PY, "-m", "ogrefs", "dump", b["id"], f"{BOX}/data/big.bin"], env=loop["env"],
                            check=True, capture_output=True, timeout=120).stdout
    assert dumped == big.read_bytes()


@pytest.mark.parametrize("store_url", ["file"], indirect=True)
def test_a_state_once_mounted_with_metacopy_keeps_it_without_the_variable(loop):
    """Its upper directory may hold metadata-only files: mounted without metacopy they would not open."""
    tmp = loop["tmp"]
    box(loop, f"""
        mkdir -p {BOX}
        head -c 2000000 /dev/urandom > {BOX}/f.bin
        {OGREFS} -q snapshot {BOX} --json > {tmp}/a.json
    """)
    a = json.loads((tmp / "a.json").read_text())
    first = dict(loop, env=dict(loop["env"], OGREFS_METACOPY="1"))
    box(first, f"""
        {OGREFS} -q mount --no-materialize {a["id"]} /
        chmod 0640 {BOX}/f.bin
        {OGREFS} unmount /
    """)
    box(loop, f"""
        {OGREFS} -q mount --no-materialize {a["id"]} /
        grep " {BOX} " /proc/self/mountinfo > {tmp}/mountinfo
        stat -c %a {BOX}/f.bin > {tmp}/mode
        cmp {BOX}/f.bin <({OGREFS} dump {a["id"]} {BOX}/f.bin)
        {OGREFS} unmount /
    """)
    assert "metacopy=on" in (tmp / "mountinfo").read_text() and (tmp / "mode").read_text().strip() == "640"
