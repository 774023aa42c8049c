"""Cached Debian roots for the whole-box lab (issue 12): Debian 12 (bookworm), and 13 (trixie) beside it
for the lab of releases (issue 47, ``--suite trixie``; Python 3.13 there).

Two stages, each cached under ``$OGREFS_LAB_CACHE`` (default
``/var/cache/ogrefs-lab``) in a directory named by the hash of its recipe:

* ``base-<hash>/root``: ``debootstrap <suite>`` from the Debian mirror with
  systemd, fuse3 and the distribution's Python 3.11.2, plus a venv made with
  that Python (``/opt/ogrefs/venv``) holding ogrefs' dependencies from PyPI
  (bookworm's python3-pyfuse3 3.2, python3-trio 0.22 and python3-zstandard
  0.20 are older than pyproject.toml allows).  The slow stage: minutes.
* ``boxes-<hash>/{a,b}``: two copies of the base made to differ like two
  providers' images (``providers.py``), each with a fake NVIDIA driver
  userspace of its own version (``fake_nvidia/``).  Seconds.

A stage is built in a temporary directory next to its final place and
renamed into place only once complete, under an exclusive ``flock`` on
``<cache>/.lock``, so two test processes never both build it and an
interrupted build never looks complete.  ogrefs itself is not in the cache:
``install_ogrefs`` copies the source under test into a box's
``/opt/ogrefs/src`` for each run.

Run ``scripts/make_lab_roots`` to build (or just find) both stages.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAB_DIR = Path(__file__).resolve().parent
SUITE = "bookworm"  # Debian 12, the lab's default release
SUITES = ("bookworm", "trixie")  # Debian 12 and 13: the releases lab of issue 47
MIRROR = os.environ.get("OGREFS_LAB_MIRROR", "http://deb.debian.org/debian")
VENV = "/opt/ogrefs/venv"

# Debian packages of the base root: a bootable systemd box with FUSE 3, sshd,
# sudo and the distribution's Python; gcc and the headers only because
# pyfuse3 has no wheels (pip builds it against libfuse3).
PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "udev", "fuse3", "libfuse3-dev", "pkg-config", "gcc", "libc6-dev",
    "python3", "python3-venv", "python3-dev", "openssh-server", "sudo", "iproute2", "kmod", "procps",
    "util-linux", "attr", "ca-certificates",
)

DEBOOTSTRAP_TIMEOUT_S = 1800
PIP_TIMEOUT_S = 1200


def cache_root() -> Path:
    return Path(os.environ.get("OGREFS_LAB_CACHE", "/var/cache/ogrefs-lab"))


def project_dependencies() -> list[str]:
    """ogrefs' runtime requirements, read from pyproject.toml (part of the base recipe)."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return list(data["project"]["dependencies"])


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()[:16]


def base_recipe_hash(suite: str = SUITE) -> str:
    recipe = repr((1, suite, MIRROR, PACKAGES, VENV, project_dependencies())).encode()
    return _digest(recipe)


def boxes_recipe_hash(suite: str = SUITE) -> str:
    files = sorted([LAB_DIR / "providers.py", *(LAB_DIR / "fake_nvidia").iterdir()])
    return _digest(base_recipe_hash(suite).encode(), *(f.name.encode() + f.read_bytes() for f in files))


def check_prerequisites() -> str | None:
    """The reason the lab cannot be built here, or None."""
    if os.geteuid() != 0:
        return "the lab needs root (debootstrap, chroot, mount namespaces)"
    for tool in ("unshare", "chroot", "mount", "gcc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found"
    return None


def ensure_host_tools() -> None:
    """Install debootstrap and systemd-container with apt-get when missing (Debian hosts)."""
    missing = [p for p, tool in (("debootstrap", "debootstrap"), ("systemd-container", "systemd-nspawn"))
               if shutil.which(tool) is None]
    if not missing or shutil.which("apt-get") is None:
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], env=env, timeout=600, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", *missing], env=env, timeout=900, capture_output=True)


@contextmanager
def _locked(cache: Path) -> Iterator[None]:
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_stage(final: Path, build: Callable[[Path], None], log: Callable[[str], None]) -> Path:
    """Build ``final`` with ``build(tmpdir)`` unless it exists; rename into place when complete."""
    if final.is_dir():
        return final
    with _locked(final.parent):
        if final.is_dir():
            return final
        for stale in final.parent.glob(f".tmp-{final.name}-*"):
            _remove_tree(stale)
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
        tmp.mkdir()
        started = time.monotonic()
        try:
            build(tmp)
        except BaseException:
            _remove_tree(tmp)
            raise
        os.rename(tmp, final)
        log(f"built {final} in {time.monotonic() - started:.0f} s")
    return final


def _remove_tree(path: Path) -> None:
    """Remove a build directory; a chroot's leftover mounts are taken down first."""
    subprocess.run(["sh", "-c", f"grep -o ' {path}[^ ]*' /proc/mounts | sort -r | xargs -r -n1 umount -l"],
                   capture_output=True, timeout=60)
    shutil.rmtree(path, ignore_errors=True)


def run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])}... exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res


def in_root(root: Path, script: str, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``script`` with sh in a chroot of ``root``, in a private mount namespace with /proc, /dev, /sys."""
    wrapper = (
        "set -e; r=\"$1\"; shift; mount -t proc proc \"$r/proc\"; mount --rbind /dev \"$r/dev\"; "
        "mount -t sysfs sysfs \"$r/sys\"; mount -t tmpfs tmpfs \"$r/run\"; mount -t tmpfs tmpfs \"$r/tmp\"; "
        "if [ -r \"$HOST_CA\" ]; then : > \"$r/tmp/host-ca.crt\"; mount --bind \"$HOST_CA\" \"$r/tmp/host-ca.crt\"; fi; "
        "exec chroot \"$r\" /bin/sh -ec \"$1\""
    )
    # The host's CA bundle (a TLS-inspecting proxy's CA, if any) for pip, seen as /tmp/host-ca.crt.
    host_ca = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt"
    base_env = {"HOST_CA": host_ca, "PIP_CERT": "/tmp/host-ca.crt", "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
                "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}
    return run(["unshare", "--mount", "--propagation", "private", "sh", "-c", wrapper, "lab", str(root), script],
               timeout=timeout, env={**base_env, **(env or {})}).stdout


def _build_base(tmp: Path, suite: str = SUITE) -> None:
    root = tmp / "root"
    try:
        run(["debootstrap", "--variant=minbase", "--include=systemd-sysv,ca-certificates", suite, str(root), MIRROR],
            timeout=DEBOOTSTRAP_TIMEOUT_S)
    except RuntimeError as exc:
        log = root / "debootstrap/debootstrap.log"
        raise RuntimeError(f"{exc}\n{log.read_text()[-3000:] if log.exists() else ''}") from None
    reqs = " ".join(f"'{r}'" for r in project_dependencies())
    in_root(root, (
        f"apt-get install -y -q --no-install-recommends {' '.join(PACKAGES)} >/dev/null; "
        f"/usr/bin/python3 -m venv {VENV}; "
        f"{VENV}/bin/pip install -q --no-cache-dir {reqs}; "
        f"{VENV}/bin/python -c 'import pyfuse3, trio, blake3, pyfastcdc, zstandard, boto3, pynvml'; "
        "apt-get clean; rm -rf /var/lib/apt/lists/*"
    ), timeout=PIP_TIMEOUT_S)
    (root / "etc/ogrefs-lab-base").write_text(f"{base_recipe_hash(suite)}\n")


def base_root(log: Callable[[str], None] = print, suite: str = SUITE) -> Path:
    final = cache_root() / f"base-{base_recipe_hash(suite)}"
    return _build_stage(final, lambda tmp: _build_base(tmp, suite), log) / "root"


def _build_boxes(tmp: Path, suite: str = SUITE) -> None:
    from . import providers

    base = base_root(suite=suite)
    for name in ("a", "b"):
        run(["cp", "-a", "--reflink=auto", str(base), str(tmp / name)], timeout=600)
        providers.make_provider_box(tmp / name, providers.PROVIDERS[name])


def box_roots(log: Callable[[str], None] = print, suite: str = SUITE) -> dict[str, Path]:
    """The cached, read-only-by-convention roots of boxes A and B of ``suite`` (built if missing)."""
    base_root(log, suite)
    final = cache_root() / f"boxes-{boxes_recipe_hash(suite)}"
    built = _build_stage(final, lambda tmp: _build_boxes(tmp, suite), log)
    return {"a": built / "a", "b": built / "b"}


def copy_box(src: Path, dest: Path) -> Path:
    """A private, writable copy of a cached box root for one test."""
    run(["cp", "-a", "--reflink=auto", str(src), str(dest)], timeout=600)
    return dest


def install_ogrefs(root: Path, src: Path | None = None) -> None:
    """Copy the ogrefs source under test into the box, importable by its venv, with /usr/local/bin/ogrefs.

    ``$OGREFS_LAB_SRC`` names another ``src`` directory (another branch's, an old commit's
    ``git archive``) to run the lab against it; the default is this checkout's.
    """
    src = src or Path(os.environ.get("OGREFS_LAB_SRC") or REPO / "src")
    target = root / "opt/ogrefs/src"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(src / "ogrefs", target / "ogrefs", ignore=shutil.ignore_patterns("__pycache__"))
    site = next((root / VENV.lstrip("/") / "lib").glob("python3*/site-packages"))
    (site / "ogrefs-lab.pth").write_text("/opt/ogrefs/src\n")
    script = root / VENV.lstrip("/") / "bin/ogrefs"  # what pip's console script runs (pyproject.toml)
    script.write_text(f"#!{VENV}/bin/python\nimport sys\n"
                      "try:\n    from ogrefs.cli.entry import main\n"
                      "except ModuleNotFoundError as exc:  # an older tree under test ($OGREFS_LAB_SRC)\n"
                      "    if exc.name != 'ogrefs.cli.entry':\n        raise\n"
                      "    from ogrefs.cli.app import main\n"
                      "sys.exit(main())\n")
    script.chmod(0o755)
    exe = root / "usr/local/bin/ogrefs"  # the README's way: a copy of scripts/setup's ogrefs-command
    exe.unlink(missing_ok=True)
    exe.write_text((REPO / "contrib/ogrefs-command").read_text().replace("@OGREFS@", str(script)[len(str(root)):]))
    exe.chmod(0o755)


def main(argv: list[str]) -> int:
    suite = argv[argv.index("--suite") + 1] if "--suite" in argv[:-1] else SUITE
    if suite not in SUITES:
        print(f"make_lab_roots: unknown suite {suite!r} (known: {', '.join(SUITES)})", file=sys.stderr)
        return 2
    reason = check_prerequisites()
    if reason:
        print(f"make_lab_roots: {reason}", file=sys.stderr)
        return 1
    ensure_host_tools()
    if shutil.which("debootstrap") is None:
        print("make_lab_roots: debootstrap is not installed and apt-get could not install it", file=sys.stderr)
        return 1
    started = time.monotonic()
    try:
        roots = box_roots(lambda m: print(f"make_lab_roots: {m}", file=sys.stderr), suite)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"make_lab_roots: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    for name, path in roots.items():
        print(f"{name} {path}")
    print(f"make_lab_roots: ready in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
