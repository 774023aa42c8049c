"""What a snapshot leaves out, as restic users write it: through the real entry point."""

from __future__ import annotations

import json

from tests.cli_run import assert_one_line_error, env, run  # noqa: F401  (env is a fixture)


def _tree(tmp_path):
    src = tmp_path / "src"
    (src / "code").mkdir(parents=True)
    (src / "code" / "a.py").write_text("a")
    (src / "code" / "a.pyc").write_text("compiled")
    (src / "pip-cache").mkdir()
    (src / "pip-cache" / "CACHEDIR.TAG").write_bytes(b"Signature: 8a477f597d28d172789f06886806bc55\n# pip\n")
    (src / "pip-cache" / "wheel").write_bytes(b"w" * 1000)
    (src / "fake-cache").mkdir()
    (src / "fake-cache" / "CACHEDIR.TAG").write_text("not the signature\n")
    (src / "build").mkdir()
    (src / "build" / ".nobackup").write_text("")
    (src / "build" / "out.o").write_text("o")
    return src


def _paths(env: dict, snap: str) -> set[str]:
    return set(run(["ls", snap], env).stdout.splitlines())


def test_exclude_everything_is_refused_unless_allowed(tmp_path, env):
    src = _tree(tmp_path)
    run(["init"], env)
    for pattern in ("*", f"{src}/*"):
        proc = run(["snapshot", "--exclude", pattern, str(src)], env, check=False)
        assert_one_line_error(proc, "the snapshot would be empty")
        assert proc.returncode == 2
    assert json.loads(run(["snapshots", "--json"], env).stdout) == []  # nothing became `latest`
    snap = json.loads(run(["snapshot", "--json", "--exclude", "*", "--allow-empty", str(src)], env).stdout)
    assert snap["totals"]["files"] == 0


def test_malformed_patterns_are_errors(tmp_path, env):
    src = _tree(tmp_path)
    run(["init"], env)
    for pattern, needle in (("code/[ab", "never closed"), ("", "empty"), ("x[]", "never closed"),
                            ("x[!]y", "never closed")):
        proc = run(["snapshot", "--exclude", pattern, str(src)], env, check=False)
        assert_one_line_error(proc, needle)
        assert proc.returncode == 2
    ok = json.loads(run(["snapshot", "--json", "--exclude", "[[]x", "--exclude", "[]a]", str(src)], env).stdout)
    assert ok["totals"]["files"] >= 5  # [[] and []a] are sets holding '[' and ']' or 'a'


def test_exclude_file_caches_if_present_and_files_from(tmp_path, env):
    src = _tree(tmp_path)
    run(["init"], env)
    patterns = tmp_path / "excludes"
    patterns.write_text("# compiled python\n*.pyc\n\n")
    snap = json.loads(run(["snapshot", "--json", "--exclude-file", str(patterns), "--exclude-caches",
                           "--exclude-if-present", ".nobackup", str(src)], env).stdout)["id"]
    got = _paths(env, snap)
    assert f"{src}/code/a.py" in got and f"{src}/code/a.pyc" not in got
    assert not any(p.startswith(f"{src}/pip-cache") for p in got)  # a tagged cache directory, all of it
    assert f"{src}/fake-cache/CACHEDIR.TAG" in got  # a tag without the signature is not one
    assert not any(p.startswith(f"{src}/build") for p in got)
    header = json.loads(run(["snapshot", "--json", "--exclude-if-present", "CACHEDIR.TAG:not the", str(src)],
                            env).stdout)["id"]
    got = _paths(env, header)
    assert f"{src}/pip-cache/wheel" in got and not any(p.startswith(f"{src}/fake-cache") for p in got)
    listed = tmp_path / "paths"
    listed.write_text(f"# what to keep\n{src}/code\n{src}/build\n")
    snap = json.loads(run(["snapshot", "--json", "--files-from", str(listed)], env).stdout)
    assert sorted(snap["paths"]) == [f"{src}/build", f"{src}/code"]
    assert_one_line_error(run(["snapshot", "--exclude-file", str(tmp_path / "none"), str(src)], env, check=False),
                          "--exclude-file")


def test_dry_run_counts_and_stores_nothing(tmp_path, env):
    src = _tree(tmp_path)
    run(["init"], env)
    out = json.loads(run(["snapshot", "--dry-run", "--json", "--exclude", "*.pyc", "--exclude-caches", str(src)],
                         env).stdout)
    assert out["dry_run"] and out["files"] == 4 and out["dirs"] == 4  # a.py, the fake tag, build/*; 4 dirs
    assert json.loads(run(["snapshots", "--json"], env).stdout) == []
    assert "would snapshot" in run(["snapshot", "-n", str(src)], env).stdout


def test_the_progress_line_on_a_terminal_has_elapsed_time_and_a_total(tmp_path, env):
    import os
    import pty
    import subprocess
    import sys

    src = _tree(tmp_path)
    run(["init"], env)
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ogrefs", "snapshot", str(src)], env=env, stderr=slave,
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    os.close(slave)
    seen = b""
    while True:
        try:
            piece = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not piece:
            break
        seen += piece
    assert proc.wait(timeout=120) == 0
    os.close(master)
    text = seen.decode(errors="replace")
    assert "[0:0" in text and " files " in text, text  # restic's [m:ss] elapsed prefix
