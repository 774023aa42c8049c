"""The mistakes a new user makes, through the real entry point: one line, the right exit code, JSON under --json."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cli_run import assert_one_line_error, env, run  # noqa: F401  (env is a fixture)
from tests.cli_run import run_in

EXIT_USAGE, EXIT_NO_REPOSITORY, EXIT_LOCKED, EXIT_WRONG_PASSWORD = 2, 10, 11, 12


@pytest.mark.parametrize("url, needle", [
    ("http://example.invalid/repo", "unknown repository URL scheme 'http'"),
    ("sftp://host/repo", "unknown repository URL scheme 'sftp'"),
    ("s3://x/repo", "invalid bucket name"),
    ("file://relative/path", "absolute path"),
])
def test_a_repository_url_no_backend_understands_is_one_line(tmp_path, env, url, needle):
    for cmd in (["init"], ["snapshots"]):
        proc = run(["-r", url, *cmd], env, check=False)
        assert_one_line_error(proc, needle)
        assert proc.returncode == EXIT_USAGE


def test_an_s3_url_typo_creates_no_local_directory(tmp_path, env):
    for cmd in (["init"], ["snapshots"], ["snapshot", str(tmp_path)]):
        proc = run_in(tmp_path, ["-r", "s3:/bucket/x", *cmd], env)
        assert_one_line_error(proc, "did you mean s3://bucket/x")
        assert proc.returncode == EXIT_USAGE
    assert not (tmp_path / "s3:").exists()
    proc = run_in(tmp_path, ["-r", "./s3:/bucket/x", "init"], env)  # said plainly, it is a directory
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "s3:" / "bucket" / "x" / "config").exists()


@pytest.mark.parametrize("endpoint", ["localhost:8333", "127.0.0.1", "ftp://127.0.0.1:1"])
def test_an_s3_endpoint_without_http_scheme_is_one_line(env, endpoint):
    proc = run(["--s3-endpoint", endpoint, "-r", "s3://some-bucket/repo", "snapshots"], env, check=False)
    assert_one_line_error(proc, "must be an http:// or https:// URL")
    assert proc.returncode == EXIT_USAGE
    via_env = dict(env, OGREFS_S3_ENDPOINT=endpoint)
    assert_one_line_error(run(["-r", "s3://some-bucket/repo", "init"], via_env, check=False), "http://")


def test_global_options_work_after_the_subcommand(tmp_path, env):
    repo = str(tmp_path / "elsewhere")
    no_repo = {k: v for k, v in env.items() if k != "OGREFS_REPO"}
    assert json.loads(run(["init", "-r", repo, "--json"], no_repo).stdout)["url"] == f"file://{repo}"
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    run(["snapshot", str(src), "--repo", repo, "-q"], no_repo)
    listing = json.loads(run(["snapshots", "-r", repo, "--json"], no_repo).stdout)
    assert [s["paths"] for s in listing] == [[str(src)]]
    proc = run(["check", "-q", "-r", repo], no_repo)
    assert "checking" not in proc.stderr  # -q after the subcommand silences progress
    assert "checking" in run(["check", "-r", repo], no_repo).stderr
    # and the JSON flag given before the subcommand reaches it
    assert json.loads(run(["--json", "-r", repo, "snapshots"], no_repo).stdout)[0]["paths"] == [str(src)]


def test_missing_repository_wrong_password_and_locked_have_their_own_exit_codes(tmp_path, env):
    assert run(["snapshots"], env, check=False).returncode == EXIT_NO_REPOSITORY
    enc = dict(env, OGREFS_PASSWORD="right horse")
    run(["init", "--encrypt"], enc)
    proc = run(["snapshots"], dict(enc, OGREFS_PASSWORD="wrong horse"), check=False)
    assert_one_line_error(proc, "wrong")
    assert proc.returncode == EXIT_WRONG_PASSWORD
    # the repository is encrypted (format version 2): only a lock sealed with its key counts
    code = ("import sys,time; from ogrefs.repo import Repository; from ogrefs.repo.keys import Secret; "
            "repo = Repository.open(sys.argv[1], secret=Secret(b'right horse', 'scrypt')); "
            "lk = repo.lock('prune', 'test').acquire(); print('held', flush=True); "
            "sys.stdin.read(); lk.release()")
    holder = subprocess.Popen([sys.executable, "-c", code, env["OGREFS_REPO"]], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = run(["prune"], enc, check=False)
        assert_one_line_error(proc, "another prune is running")
        assert proc.returncode == EXIT_LOCKED
    finally:
        holder.communicate("", timeout=30)
    assert run(["prune"], enc, check=False).returncode == 0


def test_exit_codes_are_in_the_help(env):
    out = run(["--help"], env).stdout.replace("\n", " ")
    for code in ("2 wrong usage", "3 partial", "10 no repository", "11 the repository is locked",
                 "12 wrong passphrase"):
        assert code in " ".join(out.split()), code


@pytest.mark.parametrize("args", [
    ["snapshots"], ["show", "latest"], ["ls", "latest"], ["key", "add"], ["key", "remove", "abc"],
    ["unlock"], ["-r", "http://x/y", "check"], ["snapshots", "--bogus-option"], ["no-such-command"],
    ["unmount", "/nonexistent-ogrefs-mp"], ["finalize", "/nonexistent-ogrefs-mp"],
    ["mount", "latest", "/nonexistent-ogrefs-mp"],
])
def test_errors_under_json_are_one_json_object_on_stderr(env, args):
    proc = run([*args, "--json"], env, check=False)
    assert proc.returncode != 0 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    err = json.loads(lines[0])
    assert err["message_type"] == "exit_error" and err["code"] == proc.returncode and err["message"]


def test_key_add_and_remove_answer_in_json(tmp_path, env):
    enc = dict(env, OGREFS_PASSWORD="first one")
    run(["init", "--encrypt"], enc)
    added = json.loads(run(["key", "add", "--label", "second", "--json"], dict(enc, OGREFS_NEW_PASSWORD="two")).stdout)
    ids = [k["id"] for k in json.loads(run(["key", "list", "--json"], enc).stdout)]
    assert added["added"] in ids and len(ids) == 2
    removed = json.loads(run(["key", "remove", added["added"], "--json"], enc).stdout)
    assert removed == {"removed": added["added"]}
    assert len(json.loads(run(["key", "list", "--json"], enc).stdout)) == 1


def test_password_command_opens_the_repository(tmp_path, env):
    enc = dict(env, OGREFS_PASSWORD="from a command")
    run(["init", "--encrypt"], enc)
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    run(["snapshot", str(src)], enc)
    plain = {k: v for k, v in env.items() if k != "OGREFS_PASSWORD"}
    by_env = dict(plain, OGREFS_PASSWORD_COMMAND="echo 'from a command'")
    assert len(json.loads(run(["snapshots", "--json"], by_env).stdout)) == 1
    assert len(json.loads(run(["snapshots", "--json", "--password-command", "printf 'from a command'"],
                              plain).stdout)) == 1
    proc = run(["snapshots", "--password-command", "echo nope"], plain, check=False)
    assert proc.returncode == EXIT_WRONG_PASSWORD
    proc = run(["snapshots", "--password-command", "exit 7"], plain, check=False)
    assert_one_line_error(proc, "failed (exit 7)")


def test_ogrefs_alone_shows_its_help_and_exits_2(env):
    proc = run([], env, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("Usage: ogrefs") and "\nCommands:\n" in proc.stderr  # click's help, not one line


def test_content_commands_refuse_json_and_the_others_answer_it(tmp_path, env):
    """run, shell, dump, cat blob/catalog and help print content: --json (after or before the command) is a
    one-line usage error, as JSON, with nothing on stdout; cat's JSON kinds answer JSON either way."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("data")
    run(["init"], env)
    snap = json.loads(run(["snapshot", "--json", str(src)], env).stdout)
    content = [["dump", "latest", str(src / "f")], ["dump", "latest", str(src)], ["cat", "blob", "00" * 32],
               ["cat", "catalog", snap["id"]], ["help"], ["help", "dump"], ["help", "--man"],
               ["run", "latest", "--", "true"], ["shell", "latest"]]
    for args in content:
        for argv in ([*args[:2], "--json", *args[2:]], ["--json", *args]):
            proc = run(argv, env, check=False)
            assert proc.returncode == EXIT_USAGE and proc.stdout == "", (argv, proc.stdout)
            (line,) = proc.stderr.strip().splitlines()
            err = json.loads(line)
            assert err["code"] == EXIT_USAGE and "not JSON" in err["message"] and args[0] in err["message"]
    assert run(["dump", "latest", str(src / "f")], env).stdout == "data"  # without --json: the content
    assert "Usage: ogrefs dump" in run(["help", "dump"], env).stdout
    assert json.loads(run(["cat", "config", "--json"], env).stdout) == json.loads(run(["cat", "config"], env).stdout)
    assert json.loads(run(["cat", "snapshot", "--json", "latest"], env).stdout)["id"] == snap["id"]
    assert "refuse" in run(["--help"], env).stdout and "Refused" in run(["dump", "--help"], env).stdout
