"""Shared helpers for the benchmark scripts: timing, medians, cache dropping, sizes."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = ROOT / ".venv" / "bin"


def run_in_venv() -> None:
    """Re-run this script under the checkout's virtualenv when started by another Python.

    The scripts start with ``#!/usr/bin/env python3`` (Debian's own Python on
    a fresh box); the ones that import ogrefs in-process need its
    dependencies (blake3, zstandard, pyfastcdc), which scripts/setup installs
    in .venv only.
    """
    venv = ROOT / ".venv"
    if Path(sys.prefix).resolve() == venv.resolve():
        return
    python = VENV_BIN / "python"
    if not python.exists():
        raise SystemExit(f"{sys.argv[0]}: no virtualenv at {venv}: run scripts/setup first")
    os.execv(str(python), [str(python), sys.argv[0], *sys.argv[1:]])


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache (root only); False if not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(cmd: list[str], env: dict | None = None, cwd: str | None = None, check: bool = True) -> float:
    t = time.perf_counter()
    res = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    dt = time.perf_counter() - t
    if check and res.returncode != 0:
        raise SystemExit(f"benchmark command failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr.decode()[-2000:]}")
    return dt


def du_bytes(path: Path) -> int:
    """Bytes allocated under path (what the repository costs on disk)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except OSError:
                pass
    return total


def apparent_bytes(path: Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, _dirs, names in os.walk(path):
        for f in names:
            st = os.lstat(os.path.join(dirpath, f))
            files += 1
            size += st.st_size
    return files, size


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def source_trees(given: list[str], script: str) -> list[str]:
    """The ``--tree`` src directories (default: this checkout's ``src``), checked and byte-compiled.

    Each runs through ``PYTHONPATH``; compiled first, as an installed package
    is, so that no tree pays for writing its ``.pyc`` files in a timed run.
    """
    trees = [str(Path(t).resolve()) for t in given] or [str(ROOT / "src")]
    for t in trees:
        if not (Path(t) / "ogrefs" / "__init__.py").is_file():
            raise SystemExit(f"{script}: {t} is not a src directory (no ogrefs/__init__.py)")
        subprocess.run([str(VENV_BIN / "python"), "-m", "compileall", "-q", t], check=True)
    return trees


def print_tree_medians(times: dict[str, list[float]]) -> None:
    """Each tree's median, its ratio to the first tree's, and its runs."""
    first = median(next(iter(times.values())))
    print(f"{'tree':<40} {'median s':>9} {'vs first':>9}  runs")
    for t, runs in times.items():
        m = median(runs)
        print(f"{t:<40} {m:9.2f} {m / first:8.2f}x  {' '.join(f'{x:.2f}' for x in runs)}")


def fresh_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def fmt_s(x: float) -> str:
    return f"{x:.2f} s"


def fmt_mb(x: float) -> str:
    return f"{x / 1e6:.1f} MB"
