"""A mount's start-up imports only what a mount runs.

Imports are most of the time between ``ogrefs mount`` and a listable
mount point (docs/benchmarks.md, "Mount until listed"): sqlite_utils alone
was a third of it, and the snapshot walk's readers (Python envs, git,
checkpoints) came in through ``ogrefs.inspect``'s package imports.  These
modules must stay out of the mount path; a fresh interpreter shows it.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

MOUNT_PATH = ("ogrefs.cli.app", "ogrefs.cli.mount", "ogrefs.mount.client", "ogrefs.mount.launch",
              "ogrefs.mount.fuse_ops", "ogrefs.inspect.compat", "ogrefs.inspect.here", "ogrefs.inspect.compare",
              "ogrefs.snapshot.selection", "ogrefs.store.s3")
NOT_ON_IT = ("sqlite_utils", "ogrefs.inspect.probe", "ogrefs.inspect.pyenv", "ogrefs.inspect.gitrepo",
             "ogrefs.inspect.checkpoints", "ogrefs.snapshot.pipeline",
             "boto3", "s3transfer")  # the S3 client is botocore's (store/s3.py): boto3's session imported s3transfer


def _modules_after_importing(names: tuple[str, ...]) -> set[str]:
    code = ("import importlib, json, sys\n"
            f"for n in {list(names)!r}: importlib.import_module(n)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return set(json.loads(out.stdout))


def test_the_mount_path_leaves_the_walks_readers_andsqlite_utils_module_unimported():
    loaded = _modules_after_importing(MOUNT_PATH)
    assert set(MOUNT_PATH) <= loaded
    assert loaded.isdisjoint(NOT_ON_IT), sorted(loaded & set(NOT_ON_IT))


def test_the_inspect_package_still_offers_its_names_on_first_use():
    import ogrefs.inspect as inspect_pkg
    from ogrefs.inspect import here, probe

    assert inspect_pkg.probe_local_machine is here.probe_local_machine
    assert inspect_pkg.EnvironmentProbe is probe.EnvironmentProbe
    assert sorted(inspect_pkg.__all__) == inspect_pkg.__all__


def test_a_catalog_gets_sqlite_utils_schema_without_importing_it(tmp_path):
    """The plain DDL a snapshot runs creates, statement for statement, what sqlite-utils' definition of the
    catalog creates; and creating a catalog imports no sqlite_utils (100 ms and a plugin scan a snapshot)."""
    from ogrefs.repo.catalog.schema import reference_schema

    code = ("import sys, pathlib\n"
            "from ogrefs.repo.catalog import create_schema\n"
            f"create_schema(pathlib.Path({str(tmp_path / 'plain.sqlite')!r}))\n"
            "print('sqlite_utils' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
    reference_schema(tmp_path / "reference.sqlite")
    q = "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY rowid"
    plain = sqlite3.connect(tmp_path / "plain.sqlite").execute(q).fetchall()
    reference = sqlite3.connect(tmp_path / "reference.sqlite").execute(q).fetchall()
    assert len(plain) == 18 and plain == reference  # 11 tables, 3 indexes, 4 of primary keys


def test_a_catalog_writer_never_imports_the_pandas_and_numpy_of_a_training_venv(tmp_path):
    """sqlite_utils imports pandas and numpy whenever they are installed; a snapshot at a notice must not pay for them.

    Stand-ins that record their import sit first on the path, as the real
    ones would in a training venv; a process that imported numpy itself
    keeps its numpy.
    """
    for name in ("numpy", "pandas"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"import os\nopen(os.path.join({str(tmp_path)!r}, 'imported-{name}'), 'w').close()\n")
    code = ("import sys\n"
            "from ogrefs.repo.catalog import sqlite_utils_module\n"
            "db = sqlite_utils_module().Database(memory=True)\n"
            "print(sorted(n for n in ('numpy', 'pandas') if n in sys.modules))\n"
            "import numpy  # the process's own import still works\n")
    env = {"PYTHONPATH": str(tmp_path) + ":" + ":".join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert not (tmp_path / "imported-pandas").exists()
    assert (tmp_path / "imported-numpy").exists()  # the stand-in is importable: the test can fail

    code_first = "import numpy, sys\nfrom ogrefs.repo.catalog import sqlite_utils_module\nsqlite_utils_module()\nprint(sys.modules['numpy'] is numpy)\n"
    out = subprocess.run([sys.executable, "-c", code_first], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
