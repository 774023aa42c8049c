"""Collect the environment manifest during the snapshot walk.

The snapshot walker already visits every directory, so this module does
not walk again: :meth:`EnvironmentProbe.observe_dir` is called once per
directory with the entry names and only *notes* candidates (set lookups
and suffix tests on names, no I/O).  :meth:`EnvironmentProbe.finish`
then reads the few files that matter, within a deadline, and returns a
JSON-serialisable manifest.

Ownership: a probe belongs to one walker thread; ``observe_dir`` and
``finish`` must not be called concurrently.  ``finish`` starts one daemon
thread for NVML (see :mod:`ogrefs.inspect.gpu`) and waits for it.

Paths in the manifest are ``os.fsdecode`` of the walked bytes (non-UTF-8
bytes appear as surrogate escapes, which ``json.dumps`` writes as
``\\udcXX`` and ``os.fsencode`` turns back into the original bytes).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Callable

from ogrefs.inspect.deadline import Deadline
from ogrefs.inspect.checkpoints import analyze_checkpoints, is_candidate_name
from ogrefs.inspect.cuda import (
    HEADER_NAMES,
    cuda_library_name,
    header_versions,
    local_toolkits,
    read_toolkit,
    so_version,
)
from ogrefs.inspect.gitrepo import read_git
from ogrefs.inspect.gpu import GpuProbe, import_pynvml
from ogrefs.inspect.here import GPU_TIMEOUT_S, MANIFEST_VERSION, probe_local_machine
from ogrefs.inspect.machine import machine_info
from ogrefs.inspect.pyenv import env_prefix_for_site_dir, read_env

__all__ = ["EnvironmentProbe", "capture_environment", "probe_local_machine", "MANIFEST_VERSION"]


#: Checkpoint candidates are not collected under these prefixes (system
#: files, e.g. /lib/firmware/*.bin) or inside installed packages.
_NO_CKPT_PREFIXES = (
    b"/usr/", b"/lib/", b"/lib32/", b"/lib64/", b"/boot/", b"/etc/", b"/bin/",
    b"/sbin/", b"/var/lib/", b"/var/cache/", b"/snap/",
)
_NO_CKPT_PARTS = (b"/site-packages/", b"/dist-packages/", b"/.cache/pip/", b"/node_modules/")
_SITE_NAMES = (b"site-packages", b"dist-packages")
_PY_BIN_RE = re.compile(rb"^python(\d+(\.\d+)?t?)?$")
_MAX_HINTS = 200_000
_MAX_CKPT_DIRS = 100_000
_MAX_LIBS_LISTED = 200
_SKIP_WALK = frozenset({b"/proc", b"/sys", b"/dev"})


class EnvironmentProbe:
    """Notes candidates during a walk; reads them in :meth:`finish`."""

    def __init__(self, *, gpu_timeout_s: float = GPU_TIMEOUT_S, check_git_dirty: bool = True,
                 load_nvml: Callable[[], Any] = import_pynvml) -> None:
        self.gpu_timeout_s = gpu_timeout_s
        self._load_nvml = load_nvml
        self.check_git_dirty = check_git_dirty
        self.dirs_seen = 0
        self._venvs: set[bytes] = set()
        self._condas: set[bytes] = set()
        self._git: set[bytes] = set()
        self._site: dict[bytes, list[bytes]] = {}
        self._toolkits: set[bytes] = set()
        self._headers: list[tuple[bytes, str, str]] = []
        self._py_bins: dict[bytes, list[bytes]] = {}
        self._py_hints: list[bytes] = []
        self._cuda_hints: list[bytes] = []
        self._cuda_libs: list[tuple[str, bytes]] = []
        self._ckpt: dict[bytes, list[bytes]] = {}
        self._dropped: dict[str, int] = {}
        #: Set by the snapshot: the verdict on a checkpoint file it knows unchanged (None: read it).
        self.known_checks = None

    # -- during the walk -------------------------------------------------
    def observe_dir(self, path: bytes, names: list[bytes]) -> None:
        """Note what in directory ``path`` (absolute, bytes) is worth reading later."""
        self.dirs_seen += 1
        present = set(names)
        base = path.rsplit(b"/", 1)[-1]
        if b"pyvenv.cfg" in present:
            self._venvs.add(path)
        if b"conda-meta" in present:
            self._condas.add(path)
        if b".git" in present:
            self._git.add(path)
        for header, (what, macro) in HEADER_NAMES.items():
            if header in present:
                self._headers.append((path + b"/" + header, what, macro))
        if base in _SITE_NAMES:
            self._site[path] = [n for n in names if n.endswith((b".dist-info", b".egg-info"))]
        in_site = base in _SITE_NAMES or b"/site-packages/" in path or b"/dist-packages/" in path
        if path == b"/usr/local" or path.endswith(b"/usr/local"):
            for n in names:
                if n.startswith(b"cuda"):
                    self._toolkits.add(path + b"/" + n)
        elif base.startswith(b"cuda") and (b"version.json" in present or b"version.txt" in present):
            self._toolkits.add(path)
        if base == b"bin":
            bins = [n for n in names if n.startswith(b"python") and _PY_BIN_RE.match(n)]
            if bins:
                self._py_bins[path] = bins
        elif base == b"lib-dynload":
            self._hint(self._py_hints, path, "python")
        if in_site and base == b"nvidia":
            for n in names:
                if not n.startswith((b"_", b".")) and not n.endswith(b".py"):
                    self._hint(self._cuda_hints, path + b"/" + n, "cuda")
        for n in names:
            if b".so" in n:
                lib = cuda_library_name(n)
                if lib is not None:
                    self._cuda_libs.append((lib, path + b"/" + n))
                    self._hint(self._cuda_hints, path + b"/" + n, "cuda")
                elif (in_site and (n.endswith(b".so") or b".so." in n)) or n.startswith(b"libpython"):
                    self._hint(self._py_hints, path + b"/" + n, "python")
        if not (in_site or path.startswith(_NO_CKPT_PREFIXES) or any(p in path for p in _NO_CKPT_PARTS)):
            cands = [n for n in names if is_candidate_name(n)]
            if cands:
                if len(self._ckpt) < _MAX_CKPT_DIRS:
                    self._ckpt[path] = cands
                else:
                    self._dropped["checkpoint directories"] = self._dropped.get("checkpoint directories", 0) + 1

    def _hint(self, bucket: list[bytes], p: bytes, what: str) -> None:
        if len(bucket) < _MAX_HINTS:
            bucket.append(p)
        else:
            self._dropped[f"{what} hints"] = self._dropped.get(f"{what} hints", 0) + 1

    # -- after the walk --------------------------------------------------
    def finish(self, deadline_s: float = 20.0) -> dict:
        """Read the candidates within ``deadline_s`` seconds; return the manifest."""
        return self._finish(Deadline(deadline_s))

    def _finish(self, deadline: Deadline) -> dict:
        deadline_s = deadline.seconds
        started = time.monotonic()
        gpu_probe = GpuProbe(self._load_nvml)
        notes: list[str] = []

        machine = machine_info()
        cuda = self._read_cuda(deadline)
        envs, env_hints, env_notes = self._read_envs(deadline)
        notes += env_notes
        ckpt_candidates = {
            os.fsdecode(d): [os.fsdecode(n) for n in names] for d, names in self._ckpt.items()
        }
        checkpoints, ckpt_hints, ckpt_notes = analyze_checkpoints(ckpt_candidates, deadline, self.known_checks)
        notes += ckpt_notes
        repos = []
        for wt in sorted(self._git):
            repos.append(read_git(os.fsdecode(wt), deadline, check_dirty=self.check_git_dirty))
        skipped = sum(1 for r in repos if "deadline" in r.get("dirty_unknown_reason", ""))
        if skipped:
            notes.append(f"deadline reached: git status not run for {skipped} repositor{'y' if skipped == 1 else 'ies'}")
        gpus = gpu_probe.result(min(self.gpu_timeout_s, deadline.remaining()))

        for env in envs:
            for p in env["packages"]:
                if p.startswith("nvidia-"):
                    cuda["wheels"].append({"env": env["path"], "name": p, "version": env["packages"][p]})
            if env.get("torch"):
                cuda["torch"].append({"env": env["path"], **{k: env["torch"][k] for k in ("version", "cuda")}})

        for what, n in sorted(self._dropped.items()):
            notes.append(f"{n} {what} not recorded (limit reached)")
        elapsed = time.monotonic() - started
        cut_short = deadline.expired() or any("deadline" in n for n in notes)
        if cut_short:
            notes.insert(0, f"capture cut short by the {deadline_s:g} s deadline; what was found so far is kept")
        hints = {
            "python": sorted({os.fsdecode(p) for p in self._py_hints} | env_hints),
            "cuda": sorted({os.fsdecode(p) for p in self._cuda_hints} | {t["path"] for t in cuda["toolkits"]}),
            "checkpoint": ckpt_hints,
        }
        return {
            "version": MANIFEST_VERSION,
            "captured_at": time.time(),
            "elapsed_s": round(elapsed, 3),
            "deadline_s": deadline_s,
            "complete": not cut_short,
            "machine": machine,
            "gpus": gpus,
            "cuda": cuda,
            "python_envs": envs,
            "git": repos,
            "checkpoints": checkpoints,
            "hints": hints,
            "notes": notes,
        }

    def _read_cuda(self, deadline: Deadline) -> dict:
        toolkits = [read_toolkit(os.fsdecode(p)) for p in sorted(self._toolkits)]
        found = header_versions(((os.fsdecode(p), what, macro) for p, what, macro in self._headers), deadline.expired)
        libs = []
        for lib, p in self._cuda_libs[:_MAX_LIBS_LISTED]:
            name = os.fsdecode(p)
            libs.append({"name": lib, "path": name, "version": so_version(name)})
        out = {
            "toolkits": toolkits,
            "cudnn": found["cudnn"],
            "nccl": found["nccl"],
            "libraries": libs,
            "library_count": len(self._cuda_libs),
            "wheels": [],
            "torch": [],
        }
        return out

    def _read_envs(self, deadline: Deadline) -> tuple[list[dict], set[str], list[str]]:
        owners: dict[str, str] = {os.fsdecode(p): "venv" for p in self._venvs}
        owners.update({os.fsdecode(p): "conda" for p in self._condas})
        sites: dict[str, dict[str, list[str]]] = {p: {} for p in owners}
        for site, entries in self._site.items():
            s = os.fsdecode(site)
            owner = max(
                (p for p in owners if s.startswith(p.rstrip("/") + "/")), key=len, default=None
            )
            if owner is None:
                owner, _ = env_prefix_for_site_dir(s)
                if owner not in owners:
                    owners[owner] = "user" if owner.endswith("/.local") else "system"
                    sites[owner] = {}
            sites[owner][s] = [os.fsdecode(e) for e in entries]
        envs, notes = [], []
        hints: set[str] = set()
        for prefix in sorted(owners):
            env, n = read_env(owners[prefix], prefix, sites[prefix], deadline)
            envs.append(env)
            notes += n
            hints |= set(env["site_packages"])
            bindir = os.fsencode(os.path.join(prefix, "bin"))
            for b in self._py_bins.get(bindir, []):
                hints.add(os.fsdecode(bindir + b"/" + b))
            home, ver = env.get("home"), env.get("python")
            if home and ver:
                base = os.path.join(home, "python" + ".".join(ver.split(".")[:2]))
                if os.path.exists(base):
                    hints.add(base)
            interps = sorted(os.fsdecode(bindir + b"/" + b) for b in self._py_bins.get(bindir, []))
            env["interpreters"] = interps
        return envs, hints, notes


def _walk(probe: EnvironmentProbe, root: bytes, deadline: Deadline) -> bool:
    """Depth-first scandir walk without following links; False if cut short."""
    stack = [root]
    while stack:
        if deadline.expired():
            return False
        path = stack.pop()
        if path in _SKIP_WALK:
            continue
        names: list[bytes] = []
        subdirs: list[bytes] = []
        try:
            with os.scandir(path) as it:
                for entry in it:
                    names.append(entry.name)
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            subdirs.append(entry.path)
                    except OSError:
                        pass
        except OSError:
            continue
        probe.observe_dir(path, names)
        stack.extend(reversed(sorted(subdirs)))
    return True


def capture_environment(roots: list[str], deadline_s: float = 20.0,
                        load_nvml: Callable[[], Any] = import_pynvml) -> dict:
    """Walk ``roots`` (no symlinks followed; /proc, /sys, /dev skipped) and capture.

    The walk may use at most half of ``deadline_s``; reading gets the rest.
    """
    total = Deadline(deadline_s)
    walk_deadline = Deadline(deadline_s / 2)
    probe = EnvironmentProbe(load_nvml=load_nvml)
    complete_walk = True
    for root in roots:
        raw = os.fsencode(os.path.abspath(root))
        if not _walk(probe, raw.rstrip(b"/") or b"/", walk_deadline):
            complete_walk = False
            break
    env = probe._finish(total)
    if not complete_walk:
        env["complete"] = False
        env["notes"].insert(
            0,
            f"directory walk cut short after {probe.dirs_seen} directories "
            f"(half of the {deadline_s:g} s deadline); later directories were not examined",
        )
    return env
