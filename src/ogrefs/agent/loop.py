"""``ogrefs agent``: keep a box protected with incremental snapshots.

Triggers, each a thread that only puts a :class:`Trigger` on the agent's queue:

* the *timer* (``--every`` minutes after the last snapshot started);
* the *checkpoint watch* (:mod:`.watch`): a new coherent checkpoint, complete
  and quiet, in the run directories the last snapshot found (and ``--watch``);
* the *notice poller* (:mod:`.notices`): a preemption notice, once per notice
  (every ``--poll`` seconds; on GCP a hanging GET that the server answers at
  the change); an odd answer is a maybe notice and triggers too (once, and a
  real notice after it once more); no error ends the poller, and it says so if
  anything ever does;
* SIGTERM / SIGINT (the handler only puts a trigger; the main thread acts).

Who owns what: the main thread owns the repository, the queue's consumer side,
the status file and every snapshot, taken one at a time, in the main thread.
Triggers that arrive while a snapshot runs wait in the queue; when it ends,
everything queued is folded into *one* more snapshot (a notice during a
running snapshot lets it finish, then one more saves what changed since it
started).  The trigger threads share nothing with the main thread but the
queue (thread-safe) and ``_stop`` (a threading.Event); the watch thread alone
owns the :class:`~.watch.CheckpointWatch`, and learns the run directories and
the checkpoint of each snapshot taken from ``_taken`` (a queue).

After each snapshot: retention (the ``forget`` policy, applied to this box's
snapshots only; packs are left for ``ogrefs prune``), one log line (or a JSON
event with ``--json``), and the status file that ``ogrefs agent status`` reads.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ogrefs.agent.notices import Notice, NoticeSource
from ogrefs.agent.watch import Checkpoint, CheckpointWatch, run_dirs_of
from ogrefs.box.records import pid_alive, runtime_dir
from ogrefs.errors import OgrefsError, UsageError
from ogrefs.maint.forget import apply_policy
from ogrefs.maint.remove import remove_snapshot
from ogrefs.snapshot.selection import box_of, checkpoint_of, default_box


@dataclass(frozen=True)
class Trigger:
    reason: str  # start, every, checkpoint, notice, sigterm
    at: float = field(default_factory=time.time)
    checkpoint: Checkpoint | None = None
    notice: Notice | None = None


@dataclass
class AgentOptions:
    paths: list[bytes]
    whole_box: bool = False
    excludes: list[str] = field(default_factory=list)
    box: str | None = None
    every_s: float | None = None
    on_checkpoint: bool = True
    watch_dirs: list[str] = field(default_factory=list)
    quiet_s: float = 5.0
    scan_s: float = 2.0
    notices: list[NoticeSource] = field(default_factory=list)
    poll_s: float = 2.0
    policy: Any = None  # forget.Policy or None
    initial: bool = True
    status_path: Path | None = None


def status_path() -> Path:
    return runtime_dir() / "agent.json"


class Agent:
    """``take``: how one snapshot is taken (main thread; the checkpoint it is for -> its manifest):
    :meth:`take_snapshot` of the repository unless a caller stands another in (a test's stand-in snapshot)."""

    def __init__(self, repo, opts: AgentOptions, emit: Callable[[dict], None], *,
                 take: Callable[[Checkpoint | None], dict] | None = None) -> None:
        self.repo = repo
        self.opts = opts
        self.emit = emit
        self._take = take if take is not None else self.take_snapshot
        self._queue: queue.Queue[Trigger] = queue.Queue()
        self._stop = threading.Event()
        #: (run directories, checkpoint held) of each snapshot taken, for the watch thread
        self._taken: queue.Queue[tuple[list[str], Checkpoint | None]] = queue.Queue()
        self._status_path = opts.status_path or status_path()
        self.status: dict[str, Any] = {"pid": os.getpid(), "started": time.time(), "snapshots": 0,
                                       "last": None, "running": None, "errors": 0, "last_error": None,
                                       "box": None, "every_s": opts.every_s,
                                       "notices": [s.provider for s in opts.notices]}
        self._last_start = 0.0
        self._ending = False

    # -- triggers (threads) ----------------------------------------------------------------
    def _timer(self) -> None:
        while not self._stop.wait(1.0 if self.opts.every_s is None else min(1.0, self.opts.every_s / 4)):
            if self.opts.every_s and time.monotonic() - self._last_start >= self.opts.every_s:
                self._last_start = time.monotonic()  # read by this thread, written by both: a float, atomic
                self._queue.put(Trigger("every"))

    def _watch(self, watch: CheckpointWatch) -> None:
        while not self._stop.wait(self.opts.scan_s):
            while not self._taken.empty():
                dirs, held = self._taken.get_nowait()
                watch.set_dirs(dirs)
                watch.baseline(held)
            try:
                ck = watch.scan()
            except Exception as exc:  # noqa: BLE001 - a judgement gone wrong must not end the watch
                self.emit({"event": "watch-error", "error": repr(exc)})
                continue
            if watch.judged_now:
                self.emit({"event": "checkpoints", **(watch.last_verdict or {})})
            if ck is not None:
                self._queue.put(Trigger("checkpoint", checkpoint=ck))

    def _poll(self, source: NoticeSource) -> None:
        """Poll ``source`` until the agent stops; no error ends it, and its end is always said."""
        try:
            self._poll_until_stopped(source)
        finally:
            if not self._stop.is_set():  # only an error past every guard gets here (MemoryError ...)
                self.emit({"event": "notice-error", "provider": source.provider,
                           "error": "the notice watch ended: notices are no longer seen"})

    def _poll_until_stopped(self, source: NoticeSource) -> None:
        """One trigger per notice: a real notice after a maybe one (an odd answer) triggers again."""
        seen: str | None = None  # "maybe", "notice": what the current run of notices has triggered
        errors = 0
        wait = 0.0  # the first poll at once: a notice already given when the agent starts is seen now
        while not self._stop.wait(wait):
            wait = self.opts.poll_s
            try:
                notice = source.poll()
                wait = source.next_wait(self.opts.poll_s)
            except Exception as exc:  # noqa: BLE001 - no answer (OSError) or a bug: said once, polled on
                errors += 1
                if errors == 1:
                    self.emit({"event": "notice-error", "provider": source.provider,
                               "error": str(exc) if isinstance(exc, OSError) else repr(exc)})
                continue
            errors = 0
            kind = None if notice is None else "maybe" if notice.doubt is not None else "notice"
            if notice is not None and (seen is None or seen == "maybe" and kind == "notice"):
                self.emit({"event": "notice", **notice.as_dict()})
                self._queue.put(Trigger("notice", notice=notice))
            seen = kind if kind is None or seen != "notice" else seen

    def _on_signal(self, signum, _frame) -> None:
        self._queue.put(Trigger("sigterm" if signum == signal.SIGTERM else "interrupt"))

    # -- main thread -------------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.status["box"] = self.opts.box or default_box(self.repo)
        watch = CheckpointWatch(self.opts.watch_dirs, self.opts.quiet_s)
        last = self._last_of_box()
        if last is not None:
            watch.set_dirs(run_dirs_of(last))
            ck = checkpoint_of(last)
            if ck is not None:
                watch.baseline(Checkpoint(ck["run"], ck["step"], ck["epoch"], ck["path"]))
        threads = [threading.Thread(target=self._timer, name="ogrefs-agent-timer", daemon=True)]
        if self.opts.on_checkpoint:
            threads.append(threading.Thread(target=self._watch, args=(watch,), name="ogrefs-agent-watch", daemon=True))
        for src in self.opts.notices:
            threads.append(threading.Thread(target=self._poll, args=(src,), name=f"ogrefs-agent-{src.provider}",
                                            daemon=True))
        if self.opts.initial:
            self._queue.put(Trigger("start"))
        self._last_start = time.monotonic()
        for t in threads:
            t.start()
        self.emit({"event": "started", "pid": os.getpid(), "box": self.status["box"],
                   "watching": watch.dirs, "notices": self.status["notices"]})
        self._write_status()
        try:
            while not self._ending:
                try:
                    first = self._queue.get(timeout=1.0)
                except queue.Empty:
                    continue
                self._snapshot_for(self._fold(first))
        finally:
            self._stop.set()
            self.status["running"] = None
            self.status["stopped"] = time.time()
            self._write_status()
        return 1 if self.status["last_error"] and not self.status["last"] else 0

    def _fold(self, first: Trigger) -> list[Trigger]:
        """``first`` and every trigger queued behind it: one snapshot serves them all."""
        got = [first]
        while True:
            try:
                got.append(self._queue.get_nowait())
            except queue.Empty:
                return got

    def _snapshot_for(self, triggers: list[Trigger]) -> None:
        reasons = sorted({t.reason for t in triggers})
        if any(t.reason in ("sigterm", "interrupt") for t in triggers):
            self._ending = True
        notice = next((t.notice for t in triggers if t.notice is not None), None)
        ck = max((t.checkpoint for t in triggers if t.checkpoint is not None), key=Checkpoint.key, default=None)
        started = time.time()
        self._last_start = time.monotonic()
        self.status["running"] = {"since": started, "reasons": reasons}
        self._write_status()
        try:
            manifest = self._take(ck)
        except (OgrefsError, OSError) as exc:
            self.status["errors"] += 1
            self.status["last_error"] = {"time": time.time(), "error": str(exc), "reasons": reasons}
            self.emit({"event": "error", "reasons": reasons, "error": str(exc)})
            self.status["running"] = None
            self._write_status()
            return
        ended = time.time()
        event = {"event": "snapshot", "id": manifest["id"], "reasons": reasons, "seconds": round(ended - started, 3),
                 "files": manifest["totals"]["files"], "new_stored_bytes": manifest["totals"]["new_stored_bytes"],
                 "read_bytes": manifest["totals"]["read_bytes"], "tags": manifest["tags"]}
        if notice is not None:
            event["notice"] = notice.as_dict()
            event["after_notice_s"] = round(ended - notice.seen, 3)
            if notice.deadline is not None:
                event["before_deadline_s"] = round(notice.deadline - ended, 3)
        if ck is not None:
            event["checkpoint"] = ck.as_dict()
        held = checkpoint_of(manifest)
        self._taken.put((run_dirs_of(manifest), held and Checkpoint(held["run"], held["step"], held["epoch"],
                                                                    held["path"])))
        self.status["snapshots"] += 1
        self.status["last"] = {"id": manifest["id"], "time": ended, "reasons": reasons,
                               "seconds": event["seconds"], **({"notice": event["notice"]} if notice else {})}
        self.status["running"] = None
        event["forgotten"] = self._retain()
        self.emit(event)
        self._write_status()

    def take_snapshot(self, ck: Checkpoint | None) -> dict:
        """One snapshot of the box, tagged ``agent`` (and the checkpoint it holds); its manifest."""
        from ogrefs.snapshot.pipeline import take_snapshot
        from ogrefs.snapshot.setup import snapshot_options

        tags = ["agent"] + ([ck.tag()] if ck is not None else [])
        opts = snapshot_options(self.repo, list(self.opts.paths), whole_box=self.opts.whole_box, tags=tags,
                                excludes=self.opts.excludes, box=self.status["box"])
        return take_snapshot(self.repo, opts)

    def _last_of_box(self) -> dict | None:
        mine = [m for m in self.repo.list_snapshots(on_error=lambda *_: None) if box_of(m) == self.status["box"]]
        return mine[-1] if mine else None

    def _retain(self) -> list[str]:
        """Forget this box's snapshots the policy does not keep (manifests, catalogs, access traces; prune frees packs)."""
        if self.opts.policy is None or self.opts.policy.empty():
            return []
        mine = [m for m in self.repo.list_snapshots(on_error=lambda *_: None) if box_of(m) == self.status["box"]]
        _kept, removed = apply_policy(mine, self.opts.policy)
        for m in removed:
            remove_snapshot(self.repo, m["id"])
        return [m["id"] for m in removed]

    def _write_status(self) -> None:
        path = self._status_path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps({**self.status, "time": time.time()}, sort_keys=True))
            os.replace(tmp, path)
        except OSError:
            pass  # the status file is for people; the snapshots go on


def read_status(path: Path | None = None) -> dict:
    p = path or status_path()
    try:
        st = json.loads(p.read_text())
    except (OSError, ValueError):
        raise UsageError(f"no agent status at {p} (is `ogrefs agent` running?)") from None
    st["alive"] = bool(pid_alive(int(st.get("pid") or 0))) and not st.get("stopped")
    return st
