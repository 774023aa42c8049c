"""The suite runs every test directory: pyproject's ``testpaths`` orders the tiers (fail fast: quick ones
first), and a directory of tests left out of it would be skipped in silence by ``scripts/test``."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_testpaths_name_every_directory_that_holds_tests():
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    holding = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    assert holding, "no test file found: the walk is wrong"
    missed = sorted(d for d in holding if not any(d == t or d.startswith(t + "/") for t in listed))
    assert not missed, f"test directories missing from pyproject's testpaths: {missed}"
    assert listed[0] == "tests/unit", "the quick tier runs first"
