"""Running the real entry point (``python -m ogrefs``) from tests, and what its one-line errors look like."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run(args: list[str], env: dict, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "ogrefs", *args], env=env, capture_output=True, text=True,
                          timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"ogrefs {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
    return proc


@pytest.fixture
def env(tmp_path) -> dict:
    e = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"))
    e.pop("OGREFS_S3_ENDPOINT", None)
    return e


def assert_one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert needle in lines[0], lines[0]


def run_in(cwd, args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ogrefs", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=cwd)
