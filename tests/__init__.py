"""The test suite, a package so that helpers import as ``tests.<module>`` from every tier."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
