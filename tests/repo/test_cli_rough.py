"""Rough edges a first user meets (issue 51.8): keys of an unencrypted repository, key id prefixes, init into a
non-empty directory, forget's groups, diff's labelled values, status while preparing (tier 5 and the CLI's
formatting)."""

from __future__ import annotations

import json

from tests.cli_run import assert_one_line_error, env, run  # noqa: F401  (env is a fixture)


def test_keys_of_an_unencrypted_repository_say_so(tmp_path, env):
    run(["init"], env)
    assert "is not encrypted: it has no keys" in run(["key", "list"], env).stdout
    assert json.loads(run(["key", "list", "--json"], env).stdout) == []
    for args in (["key", "add"], ["key", "passwd"], ["key", "remove", "abc"]):
        proc = run(args, dict(env, OGREFS_NEW_PASSWORD="pw2"), check=False)
        assert_one_line_error(proc, "is not encrypted, so it has no keys")
        assert "init a new repository with --encrypt" in proc.stderr and "--encrypt needs" not in proc.stderr


def test_a_key_is_removed_by_a_unique_prefix(tmp_path, env):
    env = dict(env, OGREFS_PASSWORD="pw1", OGREFS_NEW_PASSWORD="pw2")
    run(["init", "--encrypt"], env)
    added = json.loads(run(["key", "add", "--json"], env).stdout)["added"]
    proc = run(["key", "remove", added[:6].upper()], env)
    assert f"removed key {added}" in proc.stdout
    assert [k["id"] for k in json.loads(run(["key", "list", "--json"], env).stdout)] != [added]
    assert_one_line_error(run(["key", "remove", "zz"], env, check=False), "no key zz")


def test_init_refuses_a_non_empty_directory_and_says_already_a_repository(tmp_path, env):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "notes.txt").write_text("not a repository")
    assert_one_line_error(run(["init"], env, check=False), "not empty and not a repository")
    assert sorted(p.name for p in repo.iterdir()) == ["notes.txt"]  # nothing written beside it
    (repo / "notes.txt").unlink()
    run(["init"], env)
    assert_one_line_error(run(["init"], env, check=False), "already a repository")


def test_forget_shows_each_group_and_why_each_snapshot_is_kept(tmp_path, env):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "f").write_text(d.name)
    run(["init"], env)
    for d in (a, a, b):
        run(["snapshot", str(d)], env)
    out = run(["forget", "--keep-last", "1", "--dry-run"], env).stdout
    assert out.count("snapshots of box [") == 2 and out.count("], host [") == 2  # the box, then --group-by's fields
    assert f"paths [{a}]:" in out and f"paths [{b}]:" in out
    assert out.count("keep 1 snapshots:") == 2 and out.count("would forget 1 snapshots:") == 1
    assert [line.endswith("  last") for line in out.splitlines()].count(True) == 2  # each kept one says why
    groups = json.loads(run(["forget", "--keep-last", "1", "--dry-run", "--json"], env).stdout)["groups"]
    removed = {tuple(g["group"]["paths"]): len(g["removed"]) for g in groups}
    assert removed == {(str(a),): 1, (str(b),): 0}


def test_diff_labels_old_and_new_values():
    from ogrefs.cli.app import _format_env_changes

    lines = _format_env_changes({"machine": {"kernel": ["6.1.0", "6.5.0"]}, "git": {"added": ["/a", "/b"]}})
    assert "  kernel: old 6.1.0, new 6.5.0" in lines and "  added: /a" in lines and "  added: /b" in lines


def _status(**over) -> dict:
    st = {"time": 10.0, "started": 0.0, "snapshot": "ab" * 32, "mountpoint": "/", "pid": 1, "bytes_read": 1,
          "reads": 1, "open_files": 0, "bytes_fetched": 4 << 20, "requests": 1, "chunks_fetched": 1,
          "cache_hits": 0, "cache_hits_memory": 0, "cache_hits_disk": 0, "cache_misses": 1, "chunks_in_flight": 0,
          "chunks_queued": 0, "errors": 0, "read_errors": 0, "corrupt": 0, "retries": 0}
    return st | over


def test_status_says_whether_the_kernel_reads_local_copies(capsys):
    from ogrefs.cli.mount import _report

    on = {"state": "on", "opens": 7, "backing_opens": 2, "declined": 0, "inodes": 1}
    _report(_status(passthrough=on), as_json=False)
    assert "passthrough           on: 7 opens read by the kernel from the local copy\n" in capsys.readouterr().out
    _report(_status(passthrough=on, trace_recording=True), as_json=False)  # the daemon must see the trace's reads
    assert ("passthrough           on: 7 opens read by the kernel from the local copy; none while the access trace"
            " is recorded\n") in capsys.readouterr().out
    why = "off: the local copies lie on a stacked file system (an overlay)"
    _report(_status(passthrough=dict(on, state=why, opens=0)), as_json=False)
    out = capsys.readouterr().out
    assert f"passthrough           {why}\n" in out and "opens" not in out
    _report(_status(passthrough=None), as_json=False)  # a read-only mount, or --no-passthrough
    assert "passthrough" not in capsys.readouterr().out


def test_status_says_preparing_and_never_an_absurd_ratio(capsys):
    from ogrefs.cli.mount import _report

    preparing = {"mode": "materialize", "state": "preparing", "complete": False, "classes": {},
                 "bytes_done": 0, "bytes_total": 0, "rate_bps": 0, "eta_s": None}
    _report(_status(materialize=preparing), as_json=False)
    out = capsys.readouterr().out
    assert "preparing: nothing counted yet" in out and "0 B / 0 B" not in out
    assert "per byte read" not in out  # one byte read, a chunk fetched: no ratio
    _report(_status(bytes_read=64 << 20, bytes_fetched=80 << 20), as_json=False)
    assert "1.25 bytes fetched per byte read" in capsys.readouterr().out
