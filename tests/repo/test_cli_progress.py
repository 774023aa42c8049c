"""Signs of life on long waits (issue 51.4): a line per store retry, a final progress line for check
--read-data, copy and prune when stderr is not a terminal; nothing of it under --json or --quiet (tier 5)."""

from __future__ import annotations

import io
import json
import os

from tests.cli_run import env, run  # noqa: F401  (env is a fixture)


def test_an_unreachable_endpoint_prints_each_retry(tmp_path, env):
    env = dict(env, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y")
    args = ["snapshots", "-r", "s3://bucket/p", "--s3-endpoint", "http://127.0.0.1:1"]  # port 1: refused at once
    proc = run(args, env, check=False)
    retries = [line for line in proc.stderr.splitlines() if "get config failed" in line]
    assert proc.returncode == 1 and len(retries) == 5, proc.stderr  # six attempts: five waits, each said
    assert "retry 1 in" in retries[0] and "5 attempts left" in retries[0] and "127.0.0.1:1" in retries[0]
    quiet = run([*args, "--json"], env, check=False)
    assert quiet.returncode == 1 and "retry" not in quiet.stderr and len(quiet.stderr.strip().splitlines()) == 1


def test_check_copy_and_prune_end_with_a_progress_line(tmp_path, env):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(3 << 20))
    run(["init"], env)
    run(["snapshot", str(src)], env)
    assert "1 / 1 packs read, 3.0 MiB / 3.0 MiB" in run(["check", "--read-data"], env).stderr
    assert "packs read" not in run(["check", "--read-data", "--quiet"], env).stderr
    other = str(tmp_path / "other")
    run(["init", "-r", other], env)
    copied = run(["copy", "-r", other, "--from-repo", env["OGREFS_REPO"]], env)
    assert "1 / 1 source packs read" in copied.stderr
    run(["forget", "latest"], env)
    pruned = run(["prune"], env)
    assert "1 / 1 packs repacked or deleted" in pruned.stderr
    assert json.loads(run(["check", "--read-data", "--json", "-r", other], env).stdout)["ok"]


def test_the_work_line_draws_on_a_terminal_and_says_the_eta():
    from ogrefs.cli.progress import WorkLine

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    line = WorkLine("packs", stream=out)
    line.grow(4, 400)
    line.advance(1, 100)
    assert "25% 1 / 4 packs, 100 B / 400 B" in out.getvalue() and "ETA" in out.getvalue()
    line.done()
    assert out.getvalue().endswith("\n") and "ETA" not in out.getvalue().rsplit("\x1b[K", 1)[1]
