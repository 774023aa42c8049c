"""FUSE passthrough for complete local copies (mount/passthrough.py), through a real writable mount.

Each test mounts the box's snapshot at ``/`` in a private mount namespace, lets
the materializer finish (``status --wait``), and reads a materialized file
(``random.bin``, 3 MiB) through the mount.  With passthrough the kernel reads
the local copy itself: the daemon sees the opens, no READ.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess

import pytest

from tests.nsbox import OGREFS, box, in_namespace  # noqa: F401  (box is a fixture)

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not os.path.exists("/dev/fuse") and not os.environ.get("CI"), reason="no /dev/fuse here"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing"),
]


def _kernel_has_passthrough() -> bool:
    """CONFIG_FUSE_PASSTHROUGH of the running kernel (Linux 6.9+), from its config."""
    for path in ("/proc/config.gz", f"/boot/config-{os.uname().release}"):
        try:
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rt") as f:
                return any(line.strip() == "CONFIG_FUSE_PASSTHROUGH=y" for line in f)
        except OSError:
            continue
    pytest.skip("the running kernel's config cannot be read: whether it has FUSE passthrough is unknown")


def _mount_read(box: dict, reads: str, env: str = "", before: str = "", args: str = "--no-save-trace") -> tuple[dict, dict]:
    """Mount, materialize, run ``before`` (the local copy complete, nothing opened through the mount yet),
    take the status, run ``reads``, take it again, unmount.  Without an access trace recorded, unless ``args``
    says otherwise: while a mount records one (its first minutes) the daemon serves every open, so that the trace
    sees the reads."""
    proj, tmp, snap = box["proj"], box["tmp"], box["snap"]
    subprocess.run(["cp", "-a", str(proj), str(tmp / "expected")], check=True)
    in_namespace(box, f"""
        fresh() {{  # the status the daemon writes after this call (it rewrites its file every 0.5 s)
            local since; since=$(date +%s.%N)
            for _ in $(seq 50); do
                {OGREFS} status / --json > "$1"
                python3 -c 'import json, sys; sys.exit(json.load(open(sys.argv[1]))["time"] <= float(sys.argv[2]))' \
                    "$1" "$since" && return 0
            done
            echo "no status written after $since" >&2; return 1
        }}
        mount -t tmpfs fresh-box {proj.parent}
        {env} {OGREFS} mount {snap} / {args}
        timeout 60 {OGREFS} status / --wait > /dev/null
        {before}
        fresh {tmp}/before.json
        {reads}
        fresh {tmp}/after.json
        {OGREFS} unmount /
    """)
    return json.loads((tmp / "before.json").read_text()), json.loads((tmp / "after.json").read_text())


def test_a_materialized_file_is_read_by_the_kernel_exactly(box):
    """cat, a read while another handle of the file is open, and an mmap of it: exact, and none of it
    was a READ for the daemon; the copy was named once for all three opens."""
    proj, expected = box["proj"], box["tmp"] / "expected"
    wanted = _kernel_has_passthrough()
    before, after = _mount_read(box, f"""
        cmp {proj}/random.bin {expected}/random.bin
        exec 3< {proj}/random.bin          # held open: the next open of the inode must go through too
        cmp {proj}/random.bin {expected}/random.bin
        python3 -c 'import mmap, sys
        a = open(sys.argv[1], "rb"); m = mmap.mmap(a.fileno(), 0, prot=mmap.PROT_READ)
        assert m[:] == open(sys.argv[2], "rb").read(), "mmap differs"' {proj}/random.bin {expected}/random.bin
        exec 3<&-
    """.replace("\n        assert", "\nassert").replace("\n        a =", "\na ="))
    pt = after["passthrough"]
    if not wanted:
        assert pt["state"].startswith("off:") and pt["opens"] == 0, pt
        assert after["local_reads"] > before["local_reads"]  # the daemon served it, as before passthrough
        return
    assert pt["state"] == "on", pt
    assert pt["opens"] - before["passthrough"]["opens"] == 4, pt  # cmp, the held one, cmp, the mmap's
    assert pt["backing_opens"] - before["passthrough"]["backing_opens"] == 2  # one while the held one lived
    assert pt["inodes"] == 0  # every backing file closed with its inode's last handle
    assert after["local_reads"] == before["local_reads"]  # no READ reached the daemon
    # the materializer recorded the copy complete: handed to the kernel as written, not read back and named
    assert after["local_written_whole"] - before["local_written_whole"] == 1
    assert after["local_named_whole"] == before["local_named_whole"] == 0


def test_while_the_access_trace_is_recorded_the_daemon_serves_every_read(box):
    """A mount records what its job reads first, for the next box's resume: a file the kernel read itself would
    be missing from that trace, so no open is passed through while it records (the default: its first minutes)."""
    proj, expected = box["proj"], box["tmp"] / "expected"
    _kernel_has_passthrough()
    before, after = _mount_read(box, f"cmp {proj}/random.bin {expected}/random.bin", args="")
    assert after["passthrough"]["state"] in ("on", "asked"), after["passthrough"]  # asked for, not used
    assert after["passthrough"]["opens"] == 0, after["passthrough"]
    assert after["local_reads"] > before["local_reads"]  # the daemon read the local copy, and the recorder saw it
    assert after["trace_recording"]


def test_a_flipped_byte_in_the_local_copy_is_never_passed_through(box):
    """A byte of the complete local copy changes on disk before the file is opened: the open is not passed
    through, the daemon serves the snapshot's bytes (through the fetcher), the damage is counted (14.18)."""
    proj, tmp, expected = box["proj"], box["tmp"], box["tmp"] / "expected"
    _kernel_has_passthrough()
    flip = (f"local=$(find {tmp}/state -path '*/tree{proj}/random.bin')\n"
            f"        test -f \"$local\"\n"
            f"        printf '\\x5a' | dd of=\"$local\" bs=1 seek=1234567 count=1 conv=notrunc status=none")
    before, after = _mount_read(box, f"cmp {proj}/random.bin {expected}/random.bin", before=flip)
    assert after["passthrough"]["opens"] == before["passthrough"]["opens"], after["passthrough"]
    assert after["local_corrupt"] > before["local_corrupt"]
    fetched = [st["cache_misses"] + st["cache_hits"] for st in (before, after)]
    assert fetched[1] > fetched[0]  # the damaged chunk came through the fetcher, not from the copy


@pytest.mark.parametrize("how", ["--no-passthrough", "OGREFS_PASSTHROUGH=0"])
def test_passthrough_can_be_turned_off(box, how):
    """--no-passthrough (a box that stacks overlays on its own tree), or OGREFS_PASSTHROUGH=0 (comparisons):
    the daemon reads the local copy, as before passthrough."""
    proj, expected = box["proj"], box["tmp"] / "expected"
    before, after = _mount_read(box, f"cmp {proj}/random.bin {expected}/random.bin",
                                **({"args": f"{how} --no-save-trace"} if how.startswith("--") else {"env": how}))
    assert after["passthrough"] is None
    assert after["local_reads"] > before["local_reads"]
