"""The autouse log check of tests/conftest.py: an unannounced WARNING fails a test, an announced one must come."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import REPO_ROOT

pytest_plugins = ["pytester"]

CONFTEST = "from tests.conftest import _log_expectations, expect_log, fail_on_unexpected_log  # noqa: F401\n"

INNER = '''
import logging
import threading

import pytest

log = logging.getLogger("ogrefs.some.module")


def test_unannounced_warning():
    log.warning("skipped entry %s", "a/b")


def test_error_from_another_thread():
    t = threading.Thread(target=log.error, args=("boom",))
    t.start()
    t.join()


def test_info_and_announced_warnings(expect_log):
    expect_log(r"skipped entry", logger="ogrefs.some")
    log.info("fine")
    log.warning("skipped entry a/b")
    log.warning("skipped entry c")


def test_announced_but_never_at_that_level(expect_log):
    expect_log(r"disk full", level=logging.ERROR)
    log.warning("disk full")


def test_announced_for_another_logger(expect_log):
    expect_log(r"boom", logger="ogrefs.other")
    log.warning("boom")


@pytest.mark.expect_log(r"skipped entry", logger="ogrefs")
def test_announced_by_a_marker():
    log.warning("skipped entry d")


@pytest.mark.expect_log(r"never logged")
def test_announced_by_a_marker_but_never_logged():
    pass


@pytest.mark.expect_log(r"maybe", required=False)
def test_announced_as_optional_and_never_logged():
    pass


def test_quiet():
    pass
'''


@pytest.fixture(scope="module")
def inner(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each inner test's teardown report: '' when it passed, else the failure text (one pytest subprocess)."""
    d = tmp_path_factory.mktemp("inner")
    (d / "conftest.py").write_text(CONFTEST)
    (d / "test_inner.py").write_text(INNER)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rE", "test_inner.py"],
                          cwd=d, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
    out = proc.stdout
    names = [line.split("def ", 1)[1].split("(")[0] for line in INNER.splitlines() if line.startswith("def test_")]
    reports = {}
    for name in names:
        start = out.find(f"_ ERROR at teardown of {name} _")
        end = out.find("\n_", start + 1)
        reports[name] = "" if start < 0 else out[start:end if end > 0 else None]
    assert "9 passed" in out, out
    return reports


def test_an_unannounced_warning_fails_the_test(inner):
    assert "unexpected log records" in inner["test_unannounced_warning"]
    assert "WARNING ogrefs.some.module: skipped entry a/b" in inner["test_unannounced_warning"]


def test_an_error_from_another_thread_fails_the_test(inner):
    assert "ERROR ogrefs.some.module: boom" in inner["test_error_from_another_thread"]


def test_info_and_announced_warnings_pass(inner):
    assert inner["test_info_and_announced_warnings"] == "" and inner["test_quiet"] == ""
    assert inner["test_announced_by_a_marker"] == "" and inner["test_announced_as_optional_and_never_logged"] == ""


def test_a_marker_announces_too_and_must_come_true(inner):
    assert "expected log records that never came" in inner["test_announced_by_a_marker_but_never_logged"]


def test_an_announced_record_that_never_comes_at_its_level_fails(inner):
    report = inner["test_announced_but_never_at_that_level"]
    assert "expected log records that never came" in report and "ERROR *: /disk full/" in report
    assert "WARNING ogrefs.some.module: disk full" in report


def test_an_expectation_holds_for_its_logger_only(inner):
    report = inner["test_announced_for_another_logger"]
    assert "unexpected log records" in report and "expected log records that never came" in report
