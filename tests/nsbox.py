"""A repository with one snapshot of a fidelity tree, and shell scripts run in a private mount namespace."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap

import pytest

from ogrefs.repo import Repository
from ogrefs.repo.traces import newest_trace
from tests.daemons import kill_registered_daemons
from tests.treegen import make_fidelity_tree

OGREFS = f"{sys.executable} -m ogrefs"

#: What every test script starts with: stop at the first failing command, and ``fails CMD ...``, which fails
#: the script where CMD succeeds. Not ``! CMD``: bash's ``set -e`` ignores a negated command's status (except as
#: a script's last), so such a line in the middle of a script asserted nothing. The message goes to stdout too,
#: as the line's stderr may be sent to a file.
SCRIPT_HEAD = textwrap.dedent("""\
    set -euo pipefail
    fails() {
        if "$@"; then echo "line ${BASH_LINENO[0]}: should have failed, and succeeded: $*" | tee /dev/stderr; exit 1; fi
    }
""")


@pytest.fixture
def box(tmp_path):
    """A repository with one snapshot of tmp_path/box/proj, and the env to use it."""
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"),
               OGREFS_STATE_DIR=str(tmp_path / "state"), OGREFS_RUNTIME_DIR=str(tmp_path / "run"))
    proj = tmp_path / "box" / "proj"
    make_fidelity_tree(proj)
    subprocess.run([sys.executable, "-m", "ogrefs", "-q", "init"], env=env, check=True)
    out = subprocess.run([sys.executable, "-m", "ogrefs", "-q", "snapshot", "--json", str(proj)], env=env,
                         check=True, capture_output=True, text=True).stdout
    yield {"env": env, "proj": proj, "snap": json.loads(out)["id"], "tmp": tmp_path}
    kill_registered_daemons(tmp_path / "run")


def in_namespace(box: dict, script: str, check: bool = True) -> subprocess.CompletedProcess:
    body = SCRIPT_HEAD + textwrap.dedent(script)
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", body], env=box["env"],
                          capture_output=True, text=True, timeout=150)
    if check and proc.returncode != 0:
        raise AssertionError(f"script failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def none_mounted(below: object, kind: str = "", mountinfo: str = "/proc/self/mountinfo") -> str:
    """A script line that fails, printing them, if mounts at or below ``below`` whose mountinfo line matches
    the awk regex ``kind`` (e.g. ``" - overlay "``) are in ``mountinfo``.

    Only the test's own paths are judged: other tests (the other xdist worker) and other users of the box
    mount meanwhile. Not ``! grep -q ...``: bash's ``set -e`` ignores the status of a negated command (except
    as a script's last), so such a line in the middle of a script asserted nothing.
    """
    prefix = shlex.quote(str(below).rstrip("/") + "/")
    return (f"awk -v p={prefix} -v k={shlex.quote(kind)} 'index($5 \"/\", p) == 1 && $0 ~ k "
            f"{{print \"still mounted: \" $0 > \"/dev/stderr\"; bad = 1}} END {{exit bad}}' {mountinfo}")


#: mountinfo's text of what ogrefs mounts: its FUSE file system, and overlays whose source is "ogrefs"
OVERLAY, FUSE, OURS = " - overlay ", " - fuse[.]ogrefs ", " - (fuse[.]ogrefs|overlay ogrefs) "


def traced_files(box: dict) -> set[str]:
    """The paths in the newest trace saved for the box's snapshot (asserts that there is one)."""
    repo = Repository.open(box["env"]["OGREFS_REPO"], cache_root=box["tmp"] / "cache-test")
    found = newest_trace(repo, box["snap"])
    assert found is not None, "no trace was saved"
    return {os.fsdecode(path) for path, _off in found[1]}
