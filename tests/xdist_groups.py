"""The suite's xdist groups: tests that run one after another on one worker (``--dist loadgroup``).

Why a scheduler of our own and not xdist's ``xdist_group`` marker: xdist 3.8
carries a test's group to its scheduler by appending ``@group`` to the test's
id in the worker, which pytest 9.2's structured ids ignore, so the marker
groups nothing and says nothing (pytest-dev/pytest-xdist#1386). Here the
scheduler, in the controlling process, reads the group from the test's path.

* ``lab``: the booted Debian roots (debootstrap, systemd-nspawn; minutes each,
  much memory and disk), one box at a time as they were written for. It goes
  first, on one worker, while the other worker takes the rest in the tiers'
  order (unit, lazy, repo, system), so a broken quick test still fails early.
* ``ckpt-corpus``: the frameworks' real saves (``ckpt_corpus``, about 45 s),
  built once a session: in one group, once, not once per worker.

Imported by tests/conftest.py only where pytest-xdist is installed.
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadGroupScheduling

#: group -> the path prefixes (of test ids, from the repository root) of its tests, in the order they start
GROUPS: dict[str, tuple[str, ...]] = {
    "lab": ("tests/lab/", "tests/system/test_lab_"),
    "ckpt-corpus": ("tests/unit/test_inspect_corpus.py", "tests/repo/test_environment_cli.py"),
}

#: group -> a fixture that must not be used outside it (a session fixture built once per worker otherwise)
FIXTURES: dict[str, str] = {"ckpt-corpus": "ckpt_corpus"}


def group_of(nodeid: str) -> str | None:
    path = nodeid.split("::", 1)[0]
    return next((name for name, prefixes in GROUPS.items() if path.startswith(prefixes)), None)


def check_fixtures(items: list[pytest.Item]) -> None:
    """A test that uses a group's fixture outside the group: a usage error naming it (not a silent double build)."""
    for item in items:
        for group, fixture in FIXTURES.items():
            if fixture in getattr(item, "fixturenames", ()) and group_of(item.nodeid) != group:
                raise pytest.UsageError(f"{item.nodeid} uses {fixture} outside the xdist group {group}: "
                                        f"add its module to GROUPS in tests/xdist_groups.py")


def lab_first(items: list[pytest.Item]) -> None:
    """The lab's tests first in the collection (stable: the rest keep the tiers' order)."""
    items.sort(key=lambda item: group_of(item.nodeid) != "lab")


class GroupScheduling(LoadGroupScheduling):
    """``--dist loadgroup`` with the groups above; work units go out in collection order, the lab's first."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # not by size: the lab first (lab_first), then the tiers' order

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid) or super()._split_scope(nodeid)


class Plugin:
    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log) -> GroupScheduling | None:
        return GroupScheduling(config, log) if config.getvalue("dist") == "loadgroup" else None
