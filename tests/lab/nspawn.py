"""Boot a lab root with ``systemd-nspawn --boot`` and run commands in it.

Flags found on the project's machines (PID 1 there is not systemd, so
machined and scopes are unavailable): ``--register=no --keep-unit`` (no
machined, no transient scope); ``--private-network`` (the box's sshd and
network config never touch the host's; the repository is file://);
``--console=read-only`` (the container's /dev/console is a pty whose output
nspawn forwards to the console log, no tty needed here: the box's console
getty runs on it, as a cloud VM's serial getty does, and ordering tests see
a real agetty); ``--bind=/dev/fuse`` (nspawn's /dev has
no fuse node).  The box's second disk, the repository disk and the "loaded
kernel module" version file are bind mounts like in the chroot lab.
Commands run with ``nsenter --all`` into the container's PID 1, each under a
timeout.  ``NspawnBox`` owns the nspawn process; nothing else holds state.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .box import StepFailed
from .providers import Provider

BOOT_TIMEOUT_S = 120
POWEROFF_TIMEOUT_S = 120


def nspawn_missing() -> str | None:
    if shutil.which("systemd-nspawn") is None:
        return "systemd-nspawn not found (apt-get install systemd-container)"
    if not Path("/dev/fuse").exists():
        return "/dev/fuse missing"
    return None


@dataclass
class NspawnBox:
    root: Path
    provider: Provider
    binds: dict[str, str]  # host path -> path in the box
    workdir: Path
    proc: subprocess.Popen | None = None
    leader: int | None = None

    def boot(self) -> NspawnBox:
        args = ["systemd-nspawn", "-q", "-D", str(self.root), "--boot", "--register=no", "--keep-unit",
                "--private-network", "--console=read-only", "--bind=/dev/fuse",
                *(f"--bind={host}:{inside}" for host, inside in self.binds.items())]
        self.console = open(self.workdir / "console.log", "w")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self.console, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while self.leader is None and time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StepFailed(f"systemd-nspawn exited {self.proc.returncode}: {self.console_log()}")
            self.leader = _child_named(self.proc.pid, "systemd")
            time.sleep(0.2)
        if self.leader is None:
            raise StepFailed(f"no systemd in the container after {BOOT_TIMEOUT_S} s: {self.console_log()}")
        self.state = ""
        while time.monotonic() < deadline:  # "starting" until every start job ended: a hung unit keeps it so
            self.state = self.sh("systemctl is-system-running", check=False, timeout=30).stdout.strip()
            if self.state in ("running", "degraded", "maintenance"):
                return self
            time.sleep(1)
        jobs = self.sh("systemctl list-jobs --no-pager", check=False, timeout=30).stdout
        raise StepFailed(f"boot did not finish within {BOOT_TIMEOUT_S} s (state {self.state!r}):\n{jobs}")

    def console_log(self) -> str:
        return (self.workdir / "console.log").read_text(errors="replace")[-3000:]

    def sh(self, script: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        cmd = ["timeout", "-s", "KILL", str(int(timeout)), "nsenter", "-t", str(self.leader), "--all", "--",
               "/bin/sh", "-c", script]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 15, stdin=subprocess.DEVNULL)
        if res.returncode == 137:
            raise StepFailed(f"[nspawn {self.provider.hostname}] hung (killed after {timeout} s): {script}")
        if check and res.returncode != 0:
            raise StepFailed(f"[nspawn {self.provider.hostname}] exit {res.returncode}: {script}\n"
                             f"stdout: {res.stdout[-2000:]}\nstderr: {res.stderr[-2000:]}")
        return res

    def out(self, script: str, **kw) -> str:
        return self.sh(script, **kw).stdout

    def poweroff(self) -> float:
        """``systemctl poweroff`` in the box; seconds until nspawn exited (StepFailed past the timeout)."""
        started = time.monotonic()
        self.sh("systemctl --no-block poweroff", timeout=30)
        try:
            self.proc.wait(timeout=POWEROFF_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise StepFailed(f"the box did not power off within {POWEROFF_TIMEOUT_S} s:\n{self.console_log()}") from None
        return time.monotonic() - started

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if self.leader is not None:
            subprocess.run(["kill", "-KILL", str(self.leader)], capture_output=True)
        if getattr(self, "console", None):
            self.console.close()


def box_b(root: Path, repo_dir: Path, workdir: Path, provider: Provider) -> NspawnBox:
    """Box B as the lab boots it (not booted yet): its scratch disk, the repository disk, its "loaded module"."""
    scratch = workdir / "scratch"
    scratch.mkdir(exist_ok=True)
    (scratch / f"{provider.hostname}.txt").write_text("B's local NVMe\n")
    kmod = workdir / "kmod-version"
    kmod.write_text(provider.kmod_line())
    return NspawnBox(root, provider, {str(repo_dir): "/srv/ogrefs", str(scratch): "/mnt/scratch",
                                      str(kmod): "/run/nvidia-lab/version"}, workdir)


def _child_named(pid: int, name: str) -> int | None:
    """The first process below ``pid`` whose command is ``name`` (nspawn's inner child runs the box's PID 1)."""
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                kids = (task / "children").read_text().split()
                for k in kids:
                    if Path(f"/proc/{k}/comm").read_text().strip() == name:
                        return int(k)
                    todo.append(int(k))
        except OSError:
            continue
    return None
