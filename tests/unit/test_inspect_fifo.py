"""A FIFO swapped in for a file the snapshot's probes read (issue 46): never waited on.

Between the walk seeing a regular file and the probe reading it, a local user
can put a FIFO under its name; a plain open() then waits for a writer for
ever. Each reader runs in a child process with a bounded wait, so today's
blocking open fails the test instead of hanging the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

READERS = {
    "checkpoint file": "from ogrefs.inspect.ckptfiles import check_file; r = check_file(P); print(r.ok is not True)",
    "git file": "from ogrefs.inspect.gitrepo import _read_text; print(_read_text(P) is None)",
    "package metadata": "from ogrefs.inspect.pyenv import read_dist_headers; print(read_dist_headers(P) == (None, None))",
    "pyvenv.cfg": "from ogrefs.inspect.pyenv import read_pyvenv_cfg; print(read_pyvenv_cfg(P) == {})",
}


@pytest.mark.parametrize("reader", ["checkpoint file", "git file", "package metadata", "pyvenv.cfg"])
def test_a_fifo_where_a_probe_reads_is_refused_at_once(tmp_path, reader):
    fifo = tmp_path / "trainer_state.json"
    os.mkfifo(fifo)
    code = f"P = {str(fifo)!r}\n" + READERS[reader]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))  # today: blocked in open()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"


def test_a_probe_does_not_follow_a_symlink_to_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "config.json").symlink_to(tmp_path / "fifo")
    code = (f"from ogrefs.inspect.files import open_regular\nimport errno, json\n"
            f"out = []\nfor follow in (False, True):\n"
            f"    try:\n        open_regular({str(tmp_path / 'config.json')!r}, follow=follow)\n"
            f"    except OSError as exc:\n        out.append(errno.errorcode[exc.errno])\n"
            f"print(json.dumps(out))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["ELOOP", "EINVAL"]  # not followed; followed, but no regular file
