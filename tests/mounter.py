"""Read-only FUSE mounts made through the real entry point, each cleaned up by ``Mounter.cleanup``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ogrefs.box.mountsys import mounted_fstype


class Mounter:
    """Runs the CLI against one repository and cleans up every mount it made."""

    def __init__(self, tmp: Path, repo_url: str, extra_env: dict[str, str] | None = None,
                 global_args: tuple[str, ...] = ()) -> None:
        self.tmp = tmp
        self.repo_url = repo_url
        self.global_args = global_args
        self.env = dict(os.environ, OGREFS_RUNTIME_DIR=str(tmp / "run"), OGREFS_CACHE_DIR=str(tmp / "xdg"),
                        **(extra_env or {}))
        self.mounts: list[Path] = []

    def cli(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        res = subprocess.run([sys.executable, "-m", "ogrefs", "--repo", self.repo_url, *self.global_args,
                              *args], env=self.env, capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
        if check and res.returncode != 0:
            raise AssertionError(f"ogrefs {' '.join(args)} failed ({res.returncode}): {res.stderr}")
        return res

    def mount(self, snap: str, mp: Path, *opts: str) -> Path:
        mp.mkdir(parents=True, exist_ok=True)
        self.mounts.append(mp)
        self.cli("mount", snap, str(mp), "--read-only", *opts)
        assert mounted_fstype(mp) == "fuse.ogrefs"
        return mp

    def status(self, mp: Path) -> dict:
        """The daemon's status as of now: it is rewritten every 0.5 s, so wait for one taken after this call."""
        since = time.time()
        deadline = since + 30
        while True:
            st = json.loads(self.cli("status", str(mp), "--json").stdout)
            if st["time"] > since or time.time() > deadline:
                return st
            time.sleep(0.2)

    def unmount(self, mp: Path) -> None:
        self.cli("unmount", str(mp))
        assert mounted_fstype(mp) is None

    def cleanup(self) -> None:
        for mp in self.mounts:
            if mounted_fstype(mp) is None:
                continue
            pid = None
            with_reg = list((self.tmp / "run" / "mounts").glob("*.json"))
            for reg in with_reg:
                try:
                    info = json.loads(reg.read_text())
                except (OSError, ValueError):
                    continue
                if info.get("mountpoint") == str(mp):
                    pid = info.get("pid")
            if self.cli("unmount", str(mp), check=False).returncode != 0:
                subprocess.run(["umount", "-l", str(mp)], capture_output=True)
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
