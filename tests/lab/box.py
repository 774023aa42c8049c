"""A lab box: a Debian root entered with chroot inside its own private mount namespace.

``Box.start()`` runs a holder process (``unshare --mount --uts --propagation
private``, and a PID namespace of its own so the box sees only its own
processes, as a booted box does) that sets the box's host name, makes its root a mount point
(as / is on a booted box) and mounts what a booted box has — /proc, /sys, /dev, a tmpfs
/run holding the "loaded kernel module" version the fake NVIDIA userspace
checks, a tmpfs /tmp, the provider's second disk at /mnt/scratch (a tmpfs)
and the repository disk at /srv/ogrefs (a bind mount of a host directory,
shared by A and B like a network disk) — and then sleeps.  Every command
(``Box.sh``) enters that namespace with nsenter and chroots into the root, so
a daemon that ``ogrefs mount`` leaves behind lives on between commands, and
every command runs under ``timeout``: a hang fails the step, never the run.

``Box.close()`` SIGKILLs every process in the namespace (the holder, daemons,
stuck readers); the namespace and all its mounts go with the last of them.
The holder owns the namespace; nothing else here holds state.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .providers import Provider

BASE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
            "LANG": "C.UTF-8", "OGREFS_REPO": "file:///srv/ogrefs"}
STEP_TIMEOUT_S = 120
# PID 1 of the box's PID namespace: reaps orphans (a daemon that double-forked and exited) like init.
REAPER = ("python3 -c 'import os, time\nwhile True:\n try: os.wait()\n except ChildProcessError: time.sleep(0.2)'")


class StepFailed(AssertionError):
    """A command in the box exited non-zero or ran past its timeout."""


@dataclass
class Box:
    root: Path
    provider: Provider
    repo_dir: Path
    kmod: Provider | None = None  # whose kernel module is "loaded" (default: the box's own)
    scratch_file: str = ""
    env: dict[str, str] = field(default_factory=dict)
    binds: tuple[str, ...] = ()  # host paths (directories or files) bind-mounted read-only at the same path
    cgroups: bool = False  # bind the host's /sys/fs/cgroup (systemd-nspawn inside the box needs it)
    shared: bool = False  # the box's mounts shared, as systemd (PID 1) makes them on every booted box
    holder: subprocess.Popen | None = None
    init_pid: int | None = None  # the box's PID 1 (the reaper), as the host numbers it

    def _setup_script(self) -> str:
        r = shlex.quote(str(self.root))
        kmod = (self.kmod or self.provider).kmod_line()
        return "\n".join([
            "set -e",
            f"hostname {shlex.quote(self.provider.hostname)}",
            f"mount --bind {r} {r}",  # a box's / is a mount point (a chroot's directory is not)
            f"mount -t proc proc {r}/proc",
            f"mount -t sysfs sysfs {r}/sys",
            *([f"mount --rbind /sys/fs/cgroup {r}/sys/fs/cgroup"] if self.cgroups else []),
            f"mount --rbind /dev {r}/dev",
            f"mount -t tmpfs -o mode=755 tmpfs {r}/run",
            f"mkdir -p {r}/run/nvidia-lab && printf %s {shlex.quote(kmod)} > {r}/run/nvidia-lab/version",
            f"mount -t tmpfs -o mode=1777 tmpfs {r}/tmp",
            f"mount -t tmpfs -o size=64m tmpfs {r}/mnt/scratch",
            f"printf %s {shlex.quote(self.scratch_file)} > {r}/mnt/scratch/{self.provider.hostname}.txt",
            f"mkdir -p {r}/srv/ogrefs && mount --bind {shlex.quote(str(self.repo_dir))} {r}/srv/ogrefs",
            *(f"mkdir -p {r}{shlex.quote(b)} && mount --bind -o ro {shlex.quote(b)} {r}{shlex.quote(b)}"
              if os.path.isdir(b) else  # a file (a program): bound onto a placeholder file
              f"mkdir -p {r}{shlex.quote(os.path.dirname(b))} && touch {r}{shlex.quote(b)} && "
              f"mount --bind -o ro {shlex.quote(b)} {r}{shlex.quote(b)}"
              for b in self.binds),
            *([f"mount --make-rshared {r}"] if self.shared else []),
            "echo ready",
            f"exec {REAPER}",
        ])

    def start(self) -> Box:
        self.repo_dir.mkdir(parents=True, exist_ok=True)
        self.holder = subprocess.Popen(["unshare", "--mount", "--uts", "--pid", "--fork", "--propagation", "private", "sh", "-c",
                                        self._setup_script()], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
        line = self.holder.stdout.readline()  # the holder prints one line, then reaps or exits
        self.init_pid = _first_child(self.holder.pid)
        if line.strip() != "ready" or self.init_pid is None:
            err = self.holder.stderr.read() if self.holder.poll() is not None else ""
            self.close()
            raise RuntimeError(f"box {self.provider.hostname} did not start: {line!r} {err}")
        return self

    def sh(self, script: str, timeout: float = STEP_TIMEOUT_S, check: bool = True,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``script`` with /bin/sh as root in the box; fails (StepFailed) past ``timeout`` seconds."""
        assert self.holder is not None
        cmd = ["nsenter", "-t", str(self.init_pid), "-m", "-u", "-p", "--", "timeout", "-s", "KILL", str(int(timeout)),
               "chroot", str(self.root), "/bin/sh", "-c", script]
        full_env = {**BASE_ENV, **self.env, **(env or {})}
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout + 15,
                                 stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise StepFailed(f"[{self.provider.hostname}] hung for {timeout} s: {script}\n{exc.stderr}") from None
        if res.returncode == 137 or res.returncode == -signal.SIGKILL:
            raise StepFailed(f"[{self.provider.hostname}] hung (killed after {timeout} s): {script}\n"
                             f"stdout: {res.stdout[-2000:]}\nstderr: {res.stderr[-2000:]}")
        if check and res.returncode != 0:
            raise StepFailed(f"[{self.provider.hostname}] exit {res.returncode}: {script}\n"
                             f"stdout: {res.stdout[-2000:]}\nstderr: {res.stderr[-2000:]}")
        return res

    def out(self, script: str, **kw) -> str:
        return self.sh(script, **kw).stdout

    def namespace_pids(self) -> list[int]:
        """Every process of the box: its PID namespace (a daemon in a mount namespace of its own too)."""
        if self.init_pid is None:
            return []
        try:
            ns = os.readlink(f"/proc/{self.init_pid}/ns/pid")
        except OSError:
            return []
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                        pids.append(int(entry))
                except OSError:
                    continue
        return pids

    def fuse_connections(self) -> list[str]:
        """The FUSE connection numbers of the mounts in the box's namespace (from its mountinfo)."""
        if self.holder is None:
            return []
        try:
            lines = Path(f"/proc/{self.init_pid}/mountinfo").read_text().splitlines()
        except OSError:
            return []
        conns = []
        for line in lines:
            fields = line.split()
            fstype = fields[fields.index("-") + 1] if "-" in fields else ""
            if fstype.startswith("fuse") and fields[2].startswith("0:"):
                conns.append(fields[2].split(":")[1])
        return conns

    def close(self) -> None:
        """Kill everything in the namespace; abort its FUSE connections so no reader waits on them."""
        conns = self.fuse_connections()
        for pid in self.namespace_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for conn in conns:
            try:
                Path(f"/sys/fs/fuse/connections/{conn}/abort").write_text("1")
            except OSError:
                pass
        if self.holder is not None:
            try:
                self.holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            self.holder = None


def _first_child(pid: int, timeout: float = 10.0) -> int | None:
    """The child that ``unshare --fork`` started (the box's PID 1)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return None
        if kids:
            return int(kids[0])
        time.sleep(0.05)
    return None
