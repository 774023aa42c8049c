"""Local SQLite state shared by processes: a process's second connection does not cost its first its locks."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys

import pytest

from ogrefs.repo.localdb import wal_connect


def test_another_process_closing_does_not_take_the_wal_from_under_a_process_with_two_connections(tmp_path):
    """Opening a second connection used to open and close the database file (to fix its mode), which drops
    every POSIX lock the process held on it, SQLite's included; another process closing its own connection
    then saw no reader, checkpointed and deleted the WAL, and the first connection's next write failed
    ("disk I/O error", seen when the materializer's tree build became a child process)."""
    path = tmp_path / "state.sqlite"
    first = wal_connect(path)
    first.execute("CREATE TABLE t (x)")
    first.execute("INSERT INTO t VALUES (1)")
    second = wal_connect(path)  # (another thread's connection, as every local database has)
    assert second.execute("SELECT count(*) FROM t").fetchone() == (1,)
    other = ("import sqlite3, sys; db = sqlite3.connect(sys.argv[1], isolation_level=None); "
             "db.execute('PRAGMA journal_mode=WAL'); db.execute('INSERT INTO t VALUES (2)'); db.close()")
    subprocess.run([sys.executable, "-c", other, str(path)], check=True, timeout=60)
    first.execute("INSERT INTO t VALUES (3)")  # raised sqlite3.OperationalError: disk I/O error
    assert sorted(r[0] for r in second.execute("SELECT x FROM t")) == [1, 2, 3]
    assert os.path.exists(f"{path}-wal")  # still this process's WAL: nobody took the file over


def test_state_files_are_private_whoever_made_them(tmp_path):
    path = tmp_path / "state.sqlite"
    db = wal_connect(path)
    db.execute("CREATE TABLE t (x)")
    for name in (path, f"{path}-wal", f"{path}-shm"):
        os.chmod(name, 0o644)  # (made by another tool, or before the rule)
    wal_connect(path).execute("SELECT count(*) FROM t").fetchone()
    for name in (path, f"{path}-wal", f"{path}-shm"):
        assert stat.S_IMODE(os.stat(name).st_mode) == 0o600, name
    fresh = tmp_path / "fresh.sqlite"
    wal_connect(fresh).execute("CREATE TABLE t (x)")
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o600


def test_a_state_file_that_is_a_directory_is_an_error_not_a_crash_later(tmp_path):
    (tmp_path / "state.sqlite").mkdir()
    with pytest.raises((OSError, sqlite3.Error)):
        wal_connect(tmp_path / "state.sqlite").execute("CREATE TABLE t (x)")
