"""The command line's read-ahead of its own code (ogrefs/cli/preload.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ogrefs.cli import preload
from tests.unit.test_startup_imports import MOUNT_PATH
from tests.pagecache import drop_pages, resident_bytes

TAG = sys.implementation.cache_tag


def _fake_package(root: Path) -> dict[str, Path]:
    pkg = root / "fakepkg"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "sub" / "__pycache__").mkdir(parents=True)
    (pkg / "tests").mkdir()
    (pkg / "data").mkdir()
    files = {
        "init": pkg / "__init__.py", "mod": pkg / "mod.py",
        "init_pyc": pkg / "__pycache__" / f"__init__.{TAG}.pyc", "mod_pyc": pkg / "__pycache__" / f"mod.{TAG}.pyc",
        "other_pyc": pkg / "__pycache__" / "mod.other-99.pyc",
        "sub_pyc": pkg / "sub" / "__pycache__" / f"x.{TAG}.pyc", "sub_py": pkg / "sub" / "x.py",
        "ext": pkg / "ext.cpython-311-x86_64-linux-gnu.so", "cffi": pkg / "_cffi.cpython-311-x86_64-linux-gnu.so",
        "test": pkg / "tests" / "test_mod.py", "data": pkg / "data" / "big.json",
        "single": root / "fakemod.py", "single_pyc": root / "__pycache__" / f"fakemod.{TAG}.pyc",
    }
    files["single_pyc"].parent.mkdir()
    for path in files.values():
        path.write_bytes(b"# x\n")
    return files


@pytest.fixture
def cold(monkeypatch) -> None:
    """Every file counts as not in the page cache (the tests' files were just written: they are)."""
    monkeypatch.setattr(preload, "_resident", lambda path: False)


@pytest.fixture
def advised(monkeypatch, cold) -> list[str]:
    """The paths posix_fadvise(WILLNEED) was called on, by any thread (with a cold page cache)."""
    seen: list[str] = []

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        assert (offset, length, advice) == (0, 0, os.POSIX_FADV_WILLNEED)
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    return seen


def _run(packages: tuple[str, ...], modules: tuple[str, ...]) -> list:
    threads = preload.start(packages, modules, threads=3)
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()
    return threads


def test_packages_are_read_ahead_whole_but_their_tests_data_and_other_interpreters_files(
        tmp_path, monkeypatch, advised):
    f = _fake_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    _run(("fakepkg",), ("fakemod",))
    assert sorted(advised) == sorted(str(f[k]) for k in ("init_pyc", "mod_pyc", "sub_pyc", "ext", "single_pyc"))
    assert "fakepkg" not in sys.modules and "fakemod" not in sys.modules  # found, never imported


def test_a_module_without_its_compiled_twin_is_read_as_source(tmp_path, monkeypatch, advised):
    f = _fake_package(tmp_path)
    f["mod_pyc"].unlink()  # a module imported with PYTHONDONTWRITEBYTECODE, or added since the last compile
    monkeypatch.syspath_prepend(str(tmp_path))
    _run(("fakepkg",), ())
    assert sorted(advised) == sorted(str(f[k]) for k in ("init_pyc", "mod", "sub_pyc", "ext"))


def test_a_package_without_compiled_files_is_read_as_source(tmp_path, monkeypatch, advised):
    f = _fake_package(tmp_path)
    for key in ("init_pyc", "mod_pyc", "other_pyc"):
        f[key].unlink()
    (tmp_path / "fakepkg" / "__pycache__").rmdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    _run(("fakepkg",), ())
    assert sorted(advised) == sorted(str(f[k]) for k in ("init", "mod", "sub_pyc", "ext"))


def test_names_that_do_not_exist_and_files_that_vanish_or_fail_are_passed_over(tmp_path, monkeypatch, cold):
    f = _fake_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    calls: list[int] = []

    def failing(fd: int, *_args) -> None:
        calls.append(fd)
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", failing)
    threads = _run(("no_such_package_xyz", "fakepkg"), ("no_such_module_xyz", "fakemod"))
    assert len(threads) == 4
    assert len(calls) == 5  # init_pyc, mod_pyc, sub_pyc, ext, single_pyc: each tried, each failure ignored


def test_a_warm_page_cache_is_probed_and_nothing_read_ahead(tmp_path, monkeypatch, advised):
    f = _fake_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    probed: list[str] = []
    monkeypatch.setattr(preload, "_resident", lambda path: probed.append(path) or True)
    _run(("fakepkg",), ("fakemod",))
    assert advised == [] and sorted(probed) == sorted([str(f["init_pyc"]), str(f["single_pyc"])])


@pytest.mark.parametrize("cold_one", ["init_pyc", "single_pyc"])
def test_one_probe_not_in_memory_starts_the_read_ahead_of_everything(tmp_path, monkeypatch, advised, cold_one):
    f = _fake_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(preload, "_resident", lambda path: path != str(f[cold_one]))
    _run(("fakepkg",), ("fakemod",))
    assert sorted(advised) == sorted(preload.files(("fakepkg",), ("fakemod",)))


def test_residency_is_what_the_page_cache_holds(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 20))
    assert preload._resident(str(path))  # just written
    # Dropped pages, five times. A probe may start readahead that finishes inside it (tests/pagecache.py) and
    # then answers "resident", harmlessly: the page is in by then. It is never resident while the cache is not.
    for _ in range(5):
        drop_pages(path)
        if preload._resident(str(path)):
            assert resident_bytes(path) > 0, "called resident with nothing cached"
    path.read_bytes()
    assert preload._resident(str(path))


def test_off_switch(tmp_path, monkeypatch, advised):
    _fake_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("OGREFS_PRELOAD", "0")
    assert preload.start(("fakepkg",), ()) == []
    assert advised == []


#: What a snapshot (the notice's command), a restore and the agent import besides the mount path.
SNAPSHOT_PATH = ("ogrefs.cli.app", "ogrefs.snapshot.pipeline", "ogrefs.snapshot.setup", "ogrefs.inspect.probe",
                 "ogrefs.inspect.pyenv", "ogrefs.inspect.gitrepo", "ogrefs.inspect.checkpoints",
                 "ogrefs.repo.catalog", "ogrefs.restore", "ogrefs.agent.loop")


@pytest.mark.parametrize("path", [MOUNT_PATH, SNAPSHOT_PATH], ids=["mount", "snapshot"])
def test_every_module_a_command_loads_after_the_interpreters_start_is_read_ahead(path):
    """The lists stay complete: each file a command's imports read (and the S3 client's data) is named."""
    code = (
        "import sys\n"
        "at_start = set(sys.modules)\n"
        "import importlib, json\n"
        f"for n in {list(path)!r}: importlib.import_module(n)\n"
        "from ogrefs.repo.catalog import CatalogWriter\n"
        "import pathlib, tempfile\n"
        "CatalogWriter(pathlib.Path(tempfile.mkdtemp()) / 'c.sqlite').close()  # as a snapshot writes one\n"
        "from ogrefs.store.s3 import S3Store\n"
        "S3Store('b', endpoint_url='http://127.0.0.1:9')\n"
        "from ogrefs.cli import preload\n"
        "listed = set(preload.files())\n"
        "missing = []\n"
        "for name, m in list(sys.modules.items()):\n"
        "    path = getattr(m, '__file__', None)\n"
        "    frozen = getattr(getattr(m, '__spec__', None), 'origin', None) == 'frozen'  # not read from disk\n"
        "    if name in at_start or not path or frozen:\n"
        "        continue\n"
        "    twins = {path, getattr(m, '__cached__', None) or path}\n"
        "    if not twins & listed:\n"
        "        missing.append(name)\n"
        "print(json.dumps(sorted(missing)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(out.stdout) == [], out.stdout


def test_the_command_starts_the_read_ahead_before_it_imports_the_command_line(monkeypatch):
    code = ("import sys\n"
            "from ogrefs.cli import preload\n"
            "started = []\n"
            "preload.start = lambda: started.append(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('click', 'botocore', 'trio', 'pyfuse3'))) or []\n"
            "from ogrefs.cli import entry\n"
            "try:\n"
            "    entry.main(['--version'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(started)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "[[]]"
