"""``ogrefs agent``: preemption notices from fake metadata servers on loopback, new checkpoints, SIGTERM (tier 4).

Every metadata server here is a real HTTP server on 127.0.0.1 speaking the
provider's protocol; the agent is told its address.  Nothing ever contacts a
real metadata address.  Every wait has a deadline: a hang fails the test.
"""

from __future__ import annotations

import http.server
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)
PY = sys.executable


class _Metadata(http.server.ThreadingHTTPServer):
    """AWS IMDSv2, GCP and Azure metadata, as far as preemption notices go."""

    def __init__(self, provider: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.provider = provider
        self._notice = False
        self.changed = threading.Condition()
        self.token = "tok-" + os.urandom(4).hex()
        self.requests: list[tuple[str, str, dict]] = []
        self.deadline = time.time() + 120

    @property
    def notice(self) -> bool:
        return self._notice

    @notice.setter
    def notice(self, value: bool) -> None:
        with self.changed:
            self._notice = value
            self.changed.notify_all()

    @property
    def etag(self) -> str:
        return "etag-true" if self._notice else "etag-false"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Metadata

    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, body: bytes = b"", etag: str | None = None) -> None:
        self.send_response(code)
        if etag is not None:
            self.send_header("ETag", etag)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        s = self.server
        s.requests.append(("PUT", self.path, {k.lower(): v for k, v in self.headers.items()}))
        if s.provider == "aws" and self.path == "/latest/api/token" and \
                self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            self._send(200, s.token.encode())
        else:
            self._send(400)

    def do_GET(self) -> None:
        s = self.server
        s.requests.append(("GET", self.path, {k.lower(): v for k, v in self.headers.items()}))
        if s.provider == "aws" and self.path == "/latest/meta-data/spot/instance-action":
            if self.headers.get("X-aws-ec2-metadata-token") != s.token:
                return self._send(401)
            if not s.notice:
                return self._send(404)
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s.deadline))
            return self._send(200, json.dumps({"action": "terminate", "time": when}).encode())
        url = urllib.parse.urlsplit(self.path)
        if s.provider == "gcp" and url.path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._send(403)
            query = urllib.parse.parse_qs(url.query)
            if query.get("wait_for_change") == ["true"]:  # GCP's hanging GET: answer when the value changes
                last = (query.get("last_etag") or [None])[0]
                with s.changed:
                    s.changed.wait_for(lambda: s.etag != last, timeout=float((query.get("timeout_sec") or [5])[0]))
            return self._send(200, b"TRUE" if s.notice else b"FALSE", etag=s.etag)
        if s.provider == "azure" and self.path.startswith("/metadata/scheduledevents?api-version="):
            if self.headers.get("Metadata") != "true":
                return self._send(400)
            events = [{"EventId": "e1", "EventType": "Preempt", "ResourceType": "VirtualMachine",
                       "NotBefore": time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(s.deadline))}] \
                if s.notice else []
            return self._send(200, json.dumps({"DocumentIncarnation": 1, "Events": events}).encode())
        self._send(404)


@pytest.fixture
def metadata(request):
    server = _Metadata(request.param)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


class _Agent:
    def __init__(self, env: dict, args: list[str], argv: list[str] | None = None) -> None:
        self.proc = subprocess.Popen(argv or [PY, "-m", "ogrefs", "agent", "--json", *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.events: list[dict] = []
        self._buf = ""

    def next(self, want, timeout: float = 60.0, unwanted=None) -> dict:
        """The next event for which ``want(ev)`` holds; fails on ``unwanted(ev)`` or when none comes in time."""
        deadline = time.monotonic() + timeout
        while True:
            while "\n" in self._buf:
                line, self._buf = self._buf.split("\n", 1)
                ev = json.loads(line)
                self.events.append(ev)
                if unwanted is not None and unwanted(ev):
                    raise AssertionError(f"unexpected event {ev}")
                if want(ev):
                    return ev
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None and not select.select([self.proc.stdout], [], [], 0)[0]:
                raise AssertionError(f"no such event within {timeout} s; got {self.events}; "
                                     f"stderr {self.stderr_tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536).decode()
                if not chunk and self.proc.poll() is not None:
                    continue
                self._buf += chunk

    def stderr_tail(self) -> str:
        if self.proc.poll() is None:
            return "(running)"
        return self.proc.stderr.read()[-2000:]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        ev = self.next(lambda e: e["event"] == "snapshot" and "sigterm" in e["reasons"])
        assert ev["id"]
        return self.proc.wait(timeout=60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ, OGREFS_REPO=f"file://{tmp_path}/repo", OGREFS_CACHE_DIR=str(tmp_path / "cache"),
             OGREFS_RUNTIME_DIR=str(tmp_path / "run"), OGREFS_BOX="spot-box")
    subprocess.run([PY, "-m", "ogrefs", "-q", "init"], env=e, check=True, timeout=60)
    (tmp_path / "box").mkdir()
    (tmp_path / "box" / "data.bin").write_bytes(os.urandom(200_000))
    return e


@pytest.mark.parametrize("metadata", ["aws", "gcp", "azure"], indirect=True)
def test_preemption_notice_snapshots_at_once_and_sigterm_once_more(env, tmp_path, metadata):
    agent = _Agent(env, ["--path", str(tmp_path / "box"), "--no-on-checkpoint", "--preemption", metadata.provider,
                         "--metadata-endpoint", metadata.url, "--poll", "0.1"])
    try:
        agent.next(lambda e: e["event"] == "snapshot" and e["reasons"] == ["start"])
        (tmp_path / "box" / "written-before-the-notice").write_text("new work")
        metadata.notice = True
        notice = agent.next(lambda e: e["event"] == "notice")
        assert notice["provider"] == metadata.provider and notice["deadline"] is not None
        snap = agent.next(lambda e: e["event"] == "snapshot" and "notice" in e["reasons"])
        assert snap["files"] == 2 and snap["after_notice_s"] >= 0
        assert snap["before_deadline_s"] == pytest.approx(notice["deadline"] - notice["seen"] - snap["after_notice_s"],
                                                           abs=0.01)
        status = json.loads(subprocess.run([PY, "-m", "ogrefs", "agent", "status", "--json"], env=env, check=True,
                                           capture_output=True, text=True, timeout=60).stdout)
        assert status["alive"] and status["snapshots"] == 2 and status["last"]["id"] == snap["id"]
        assert agent.stop() == 0
    finally:
        agent.kill()
    gets = [r for r in metadata.requests if r[0] == "GET"]
    assert gets, "the agent never asked"
    if metadata.provider == "aws":  # IMDSv2: a token first, then the token on every read
        assert metadata.requests[0][:2] == ("PUT", "/latest/api/token")
        assert all(r[2].get("x-aws-ec2-metadata-token") == metadata.token for r in gets)
    elif metadata.provider == "gcp":
        assert all(r[2].get("metadata-flavor") == "Google" for r in gets)
    else:
        assert all(r[2].get("metadata") == "true" for r in gets)
    listed = json.loads(subprocess.run([PY, "-m", "ogrefs", "snapshots", "--json"], env=env, check=True,
                                       capture_output=True, text=True, timeout=60).stdout)
    assert len(listed) == 3 and {m["box"] for m in listed} == {"spot-box"}
    dead = subprocess.run([PY, "-m", "ogrefs", "agent", "status"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert dead.returncode == 1 and "not running" in dead.stdout


@pytest.mark.parametrize("metadata", ["gcp"], indirect=True)
def test_gcp_notice_is_seen_through_a_hanging_get_not_the_next_poll(env, tmp_path, metadata):
    """GCP answers ``wait_for_change`` at the change: with an hour between polls, the notice is still seen."""
    agent = _Agent(env, ["--path", str(tmp_path / "box"), "--no-on-checkpoint", "--no-initial",
                         "--preemption", "gcp", "--metadata-endpoint", metadata.url, "--poll", "3600"])
    try:
        agent.next(lambda e: e["event"] == "started")
        deadline = time.monotonic() + 30
        while not any("wait_for_change=true" in r[1] for r in metadata.requests):  # the agent now waits
            assert time.monotonic() < deadline, f"no hanging GET: {metadata.requests}"
            time.sleep(0.05)
        metadata.notice = True
        snap = agent.next(lambda e: e["event"] == "snapshot" and "notice" in e["reasons"], timeout=60)
        assert snap["files"] == 1
        assert agent.stop() == 0
    finally:
        agent.kill()
    first, hanging = metadata.requests[0][1], metadata.requests[1][1]
    assert "?" not in first  # a plain GET first: it gives the ETag the next one waits on
    assert urllib.parse.parse_qs(urllib.parse.urlsplit(hanging).query)["last_etag"] == ["etag-false"]


class _IgnoresWaiting(_Handler):
    """A metadata server (or proxy) that answers a hanging GET at once: GCP's value with an ETag, no wait."""

    def do_GET(self) -> None:
        self.server.requests.append(("GET", self.path, {}))
        self._send(200, b"FALSE", etag="etag-false")


def test_a_server_that_does_not_hold_the_get_is_polled_not_hammered():
    from ogrefs.agent.notices import GcpPreempted

    server = _Metadata("gcp")
    server.RequestHandlerClass = _IgnoresWaiting
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        src = GcpPreempted(server.url)
        assert src.poll() is None and src.next_wait(2.0) == 0.0  # an ETag: the next request may wait
        assert src.poll() is None and src.next_wait(2.0) == 2.0  # it did not wait: poll every 2 s
        assert "wait_for_change=true" in server.requests[1][1]
    finally:
        server.shutdown()
        server.server_close()


def _torch_save(path: Path, step: int, what: str = "w") -> bytes:
    import io

    import torch

    buf = io.BytesIO()
    torch.save({"step": step, what: torch.full((64, 64), float(step))}, buf)
    return buf.getvalue()


def test_new_coherent_checkpoint_triggers_a_torn_one_does_not(env, tmp_path):
    run = tmp_path / "box" / "run"
    for step in (100,):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "model.pt").write_bytes(_torch_save(run, step))
        (run / f"checkpoint-{step}" / "optimizer.pt").write_bytes(_torch_save(run, step, "exp_avg"))
    agent = _Agent(env, ["--path", str(tmp_path / "box"), "--scan", "0.1", "--quiet-for", "0.3", "--keep-last", "2"])
    triggered = lambda e: e["event"] == "snapshot" and "checkpoint" in e["reasons"]  # noqa: E731
    try:
        start = agent.next(lambda e: e["event"] == "snapshot" and e["reasons"] == ["start"])
        assert start["tags"] == ["agent"]
        # torn: the model file of step 200 ends half-way (a writer killed mid-save)
        (run / "checkpoint-200").mkdir()
        (run / "checkpoint-200" / "optimizer.pt").write_bytes(_torch_save(run, 200, "exp_avg"))
        whole = _torch_save(run, 200)
        (run / "checkpoint-200" / "model.pt").write_bytes(whole[: len(whole) // 2])
        seen = agent.next(lambda e: e["event"] == "checkpoints" and any("checkpoint-200" in p for p in e["incomplete"]),
                          unwanted=triggered)
        assert not any("checkpoint-100" in p for p in seen["incomplete"])
        # the next one is complete: it triggers once it is quiet, tagged with its run and step
        (run / "checkpoint-300").mkdir()
        (run / "checkpoint-300" / "model.pt").write_bytes(_torch_save(run, 300))
        (run / "checkpoint-300" / "optimizer.pt").write_bytes(_torch_save(run, 300, "exp_avg"))
        snap = agent.next(triggered)
        assert snap["checkpoint"]["step"] == 300 and "checkpoint:run@step-300" in snap["tags"]
        assert agent.stop() == 0
    finally:
        agent.kill()
    listed = json.loads(subprocess.run([PY, "-m", "ogrefs", "snapshots", "--json"], env=env, check=True,
                                       capture_output=True, text=True, timeout=60).stdout)
    assert len(listed) == 2  # --keep-last 2: the start snapshot was forgotten
    assert listed[0]["checkpoint"]["step"] == 300
    # the box's most advanced coherent checkpoint is in the snapshot the trigger took
    show = subprocess.run([PY, "-m", "ogrefs", "show", "--json", "latest-checkpoint"], env=env, check=True,
                          capture_output=True, text=True, timeout=60)
    assert json.loads(show.stdout)["id"] in {m["id"] for m in listed}


def test_triggers_during_a_snapshot_wait_and_become_one_more_snapshot(tmp_path):
    """One snapshot at a time: a notice (and a checkpoint) during a running snapshot let it finish,
    then exactly one more snapshot serves them all (the agent's own queue and loop, a stand-in snapshot)."""
    from ogrefs.agent.loop import Agent, AgentOptions, Trigger
    from ogrefs.agent.notices import Notice
    from ogrefs.agent.watch import Checkpoint

    events: list[dict] = []
    running, release, taken = threading.Event(), threading.Event(), []

    def take(ck):
        taken.append(ck)
        if len(taken) == 1:
            running.set()
            assert release.wait(30)
        return {"id": f"{len(taken):064x}", "tags": [], "totals": {"files": 1, "new_stored_bytes": 0, "read_bytes": 0}}

    agent = Agent(None, AgentOptions(paths=[b"/x"], status_path=tmp_path / "agent.json"), events.append, take=take)
    agent.status["box"] = "b"
    agent._queue.put(Trigger("start"))
    first = threading.Thread(target=lambda: agent._snapshot_for(agent._fold(agent._queue.get(timeout=10))))
    first.start()
    assert running.wait(30)
    notice = Notice("gcp", "preempted", time.time(), time.time() + 30)
    agent._queue.put(Trigger("notice", notice=notice))
    agent._queue.put(Trigger("checkpoint", checkpoint=Checkpoint("/r", 7, None, "/r/checkpoint-7")))
    assert len(taken) == 1  # still the first snapshot: nothing else started
    release.set()
    first.join(timeout=30)
    agent._snapshot_for(agent._fold(agent._queue.get(timeout=10)))
    assert agent._queue.empty() and len(taken) == 2 and taken[1].step == 7
    snaps = [e for e in events if e["event"] == "snapshot"]
    assert [s["reasons"] for s in snaps] == [["start"], ["checkpoint", "notice"]]
    assert snaps[1]["before_deadline_s"] > 0 and json.loads((tmp_path / "agent.json").read_text())["snapshots"] == 2


#: The agent as `ogrefs agent --path BOX --no-on-checkpoint --json` builds it, over a store that holds the
#: snapshot's first pack upload until the test creates GATE/release: a signal sent after GATE/entered
#: appears is delivered in the middle of that snapshot, for certain (no sleep decides it).
_GATED_AGENT = r"""
import json, os, sys, time
from pathlib import Path
from ogrefs.agent.loop import Agent, AgentOptions
from ogrefs.repo import Repository
from ogrefs.store import FaultyStore, open_store

url, gate, box = sys.argv[1], Path(sys.argv[2]), sys.argv[3]

class GatedStore(FaultyStore):
    held = False

    def put(self, key, data):
        if key.startswith("packs/") and not self.held:
            self.held = True
            (gate / "entered").write_text(key)
            deadline = time.monotonic() + 120
            while not (gate / "release").exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("the test never released the gate")
                time.sleep(0.01)
        super().put(key, data)

def emit(ev):
    print(json.dumps({"time": time.time(), **ev}, sort_keys=True, default=str), flush=True)

repo = Repository.open(url, store=GatedStore(open_store(url)))
opts = AgentOptions(paths=[os.fsencode(box)], on_checkpoint=False, status_path=gate / "agent.json")
sys.exit(Agent(repo, opts, emit).run())
"""


def test_sigterm_in_the_middle_of_a_snapshot_lets_it_finish_takes_one_more_and_exits_0(env, tmp_path):
    """As documented (README, contrib/ogrefs-agent.service): the running snapshot completes (whole and
    verifiable), one more saves what changed meanwhile, the lock goes, exit 0."""
    gate, box = tmp_path / "gate", tmp_path / "box"
    gate.mkdir()
    agent = _Agent(env, [], argv=[PY, "-c", _GATED_AGENT, env["OGREFS_REPO"], str(gate), str(box)])
    try:
        deadline = time.monotonic() + 60
        while not (gate / "entered").exists():
            assert agent.proc.poll() is None and time.monotonic() < deadline, agent.stderr_tail()
            time.sleep(0.02)
        running = json.loads((gate / "agent.json").read_text())["running"]
        assert running["reasons"] == ["start"]  # the agent's own word: mid-snapshot
        (box / "written-during-the-snapshot").write_text("new")
        agent.proc.send_signal(signal.SIGTERM)
        (gate / "release").write_text("")
        first = agent.next(lambda e: e["event"] == "snapshot", unwanted=lambda e: e["event"] == "error")
        assert first["reasons"] == ["start"] and first["files"] >= 1
        last = agent.next(lambda e: e["event"] == "snapshot", unwanted=lambda e: e["event"] == "error")
        assert last["reasons"] == ["sigterm"]
        assert agent.proc.wait(timeout=60) == 0
    finally:
        agent.kill()

    def ogrefs(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([PY, "-m", "ogrefs", *args], env=env, capture_output=True, text=True, timeout=120)

    listed = json.loads(ogrefs("snapshots", "--json").stdout)
    assert [m["id"] for m in listed] == [first["id"], last["id"]]
    check = ogrefs("check", "--read-data")
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"{box}/written-during-the-snapshot" in ogrefs("ls", last["id"]).stdout.splitlines()
    assert os.listdir(tmp_path / "repo" / "locks") == []  # the snapshots' locks are gone
    status = json.loads((gate / "agent.json").read_text())
    assert status["running"] is None and status["stopped"] and status["snapshots"] == 2
