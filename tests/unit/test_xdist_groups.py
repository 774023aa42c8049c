"""The suite in parallel (tests/xdist_groups.py, tests/conftest.py): the groups hold the tests they must, the
scheduler keeps each group on one worker, the lab's first, and a worker mounts in a namespace of its own."""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

xdist_groups = pytest.importorskip("tests.xdist_groups", reason="pytest-xdist is not installed")

ROOT = Path(__file__).resolve().parents[2]


def _modules(pattern: str) -> list[str]:
    """Test modules (ids from the repository root) whose source matches ``pattern``."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if re.search(pattern, p.read_text()))


def test_every_module_that_boots_lab_boxes_is_in_the_lab_group():
    booting = _modules(r"from tests\.lab\b|import tests\.lab\b")
    assert "tests/system/test_lab_run.py" in booting, "the search is wrong"
    assert [m for m in booting if xdist_groups.group_of(f"{m}::test_x") != "lab"] == []


def test_every_module_that_uses_the_checkpoint_corpus_is_in_its_group():
    using = _modules(r"\bckpt_corpus\b")
    assert "tests/unit/test_inspect_corpus.py" in using, "the search is wrong"
    assert [m for m in using if xdist_groups.group_of(f"{m}::test_x") != "ckpt-corpus"] == []


class _Config:
    """What the scheduler reads of pytest's config: two workers, ``-x``."""

    def __init__(self) -> None:
        self.option = SimpleNamespace(tx=["2*popen"], loadscopereorder=True, maxfail=1)

    def getvalue(self, name):
        return getattr(self.option, name, None)


def test_the_scheduler_keeps_a_group_in_one_unit_and_the_rest_by_test():
    config = _Config()
    sched = xdist_groups.GroupScheduling(config)
    assert sched._split_scope("tests/system/test_lab_run.py::test_a[x]") == "lab"
    assert sched._split_scope("tests/system/test_lab_nspawn.py::test_b") == "lab"
    assert sched._split_scope("tests/repo/test_environment_cli.py::test_c") == "ckpt-corpus"
    assert sched._split_scope("tests/system/test_mount.py::test_d") == "tests/system/test_mount.py::test_d"
    assert config.option.loadscopereorder is False  # collection order (the lab's first), not by size


def test_a_worker_mounts_in_a_namespace_of_its_own():
    """What one worker mounts, the other neither sees nor copies into the namespaces it makes."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or os.geteuid() != 0:
        pytest.skip("judged in an xdist worker run as root (scripts/test)")
    assert os.readlink("/proc/self/ns/mnt") != os.readlink(f"/proc/{os.getppid()}/ns/mnt")
    root = next(line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()
                if line.split()[4] == "/")
    assert not [f for f in root[6:root.index("-")] if f.startswith(("shared:", "master:"))], root
