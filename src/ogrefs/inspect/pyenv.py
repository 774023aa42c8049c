"""Python environments found on disk, read without running Python or pip.

* venv / virtualenv: a directory with ``pyvenv.cfg`` (``version`` or
  ``version_info``, ``home``).
* conda: a directory with ``conda-meta/``; the interpreter version and
  conda packages come from the ``<name>-<version>-<build>.json`` file
  *names* in conda-meta (their contents are not needed).
* anything else with a ``lib/pythonX.Y/{site,dist}-packages`` directory
  (``/usr/local``, ``/usr``, ``~/.local``) is a "system" or "user" env.

Installed distributions come from ``*.dist-info/METADATA`` and
``*.egg-info`` (``PKG-INFO``) headers.  For torch, ``torch/version.py`` is
read as text for ``__version__`` and ``cuda``; it is never imported.
"""

from __future__ import annotations

import os
import re

from ogrefs.inspect.deadline import Deadline
from ogrefs.inspect.files import open_regular

__all__ = [
    "canonical_name",
    "read_dist_headers",
    "read_pyvenv_cfg",
    "read_torch_version",
    "read_env",
    "env_prefix_for_site_dir",
]

_CANON_RE = re.compile(r"[-_.]+")
_PYDIR_RE = re.compile(r"/lib(?:64)?/python(\d+(?:\.\d+)?)t?/(?:site|dist)-packages$")


def canonical_name(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return _CANON_RE.sub("-", name).lower()


def read_dist_headers(path: str) -> tuple[str | None, str | None]:
    """(Name, Version) from a METADATA / PKG-INFO file's header block."""
    name = version = None
    try:
        with open_regular(path) as f:
            chunk = f.read(64 * 1024)
    except OSError:
        return None, None
    for raw in chunk.decode("utf-8", "replace").splitlines():
        if not raw.strip():
            break  # headers end at the first blank line
        key, sep, value = raw.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        if key == "name" and name is None:
            name = value.strip()
        elif key == "version" and version is None:
            version = value.strip()
        if name and version:
            break
    return name, version


def _from_dir_name(entry: str) -> tuple[str, str | None]:
    stem = entry.rsplit(".", 1)[0]
    name, sep, rest = stem.partition("-")
    version = rest.split("-", 1)[0] if sep else None
    return name, version


def read_pyvenv_cfg(path: str) -> dict:
    out: dict[str, str] = {}
    try:
        with open_regular(path, "r", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition("=")
                if sep:
                    out[key.strip().lower()] = value.strip()
    except OSError:
        pass
    return out


_TORCH_FIELD_RE = re.compile(
    r"""^(?P<key>__version__|cuda|hip|git_version)\s*(?::[^=]*)?=\s*(?:(?P<q>['"])(?P<val>[^'"]*)(?P=q)|(?P<none>None))""",
    re.M,
)


def read_torch_version(path: str) -> dict | None:
    """``{"version": "2.1.0+cu121", "cuda": "12.1", "hip": None}`` from version.py text."""
    try:
        with open_regular(path, "r", encoding="utf-8", errors="replace") as f:
            text = f.read(64 * 1024)
    except OSError:
        return None
    found: dict = {}
    for m in _TORCH_FIELD_RE.finditer(text):
        key = {"__version__": "version"}.get(m.group("key"), m.group("key"))
        found.setdefault(key, None if m.group("none") else m.group("val"))
    if "version" not in found:
        return None
    return {
        "version": found.get("version"),
        "cuda": found.get("cuda"),
        "hip": found.get("hip"),
    }


def env_prefix_for_site_dir(site_dir: str) -> tuple[str, str | None]:
    """(prefix, python X.Y or None) for ``<prefix>/lib/pythonX.Y/site-packages``."""
    m = _PYDIR_RE.search(site_dir)
    if m:
        return site_dir[: m.start()] or "/", m.group(1)
    if site_dir.endswith("/lib/python3/dist-packages"):
        return site_dir[: -len("/lib/python3/dist-packages")] or "/", "3"
    return os.path.dirname(site_dir), None


def _conda_meta(prefix: str) -> tuple[dict[str, str], str | None]:
    pkgs: dict[str, str] = {}
    try:
        names = os.listdir(os.path.join(prefix, "conda-meta"))
    except OSError:
        return pkgs, None
    for n in names:
        if not n.endswith(".json"):
            continue
        parts = n[:-5].rsplit("-", 2)
        if len(parts) == 3:
            pkgs[canonical_name(parts[0])] = parts[1]
    return dict(sorted(pkgs.items())), pkgs.get("python")


def read_env(
    kind: str,
    prefix: str,
    site_dirs: dict[str, list[str]],
    deadline: Deadline,
) -> tuple[dict, list[str]]:
    """Describe one environment.  Returns (env dict, notes).

    ``site_dirs`` maps each site-packages directory of the env to the
    ``*.dist-info`` / ``*.egg-info`` entry names the walk saw in it.  When
    the deadline passes, the remaining versions come from those entry
    names instead of the METADATA files (flagged ``"partial": true``).
    """
    notes: list[str] = []
    env: dict = {"path": prefix, "kind": kind, "python": None}
    if kind == "venv":
        cfg = read_pyvenv_cfg(os.path.join(prefix, "pyvenv.cfg"))
        env["python"] = cfg.get("version") or cfg.get("version_info")
        if env["python"] and env["python"].count(".") > 2:  # 3.11.5.final.0
            env["python"] = ".".join(env["python"].split(".")[:3])
        env["home"] = cfg.get("home")
        env["system_site_packages"] = cfg.get("include-system-site-packages", "false").lower() == "true"
    elif kind == "conda":
        conda_pkgs, pyver = _conda_meta(prefix)
        env["python"] = pyver
        env["conda_packages"] = conda_pkgs
    packages: dict[str, str | None] = {}
    partial = False
    torch = None
    for site in sorted(site_dirs):
        if env["python"] is None:
            env["python"] = env_prefix_for_site_dir(site)[1]
        for entry in sorted(site_dirs[site]):
            if entry.endswith(".dist-info"):
                meta = os.path.join(site, entry, "METADATA")
            elif entry.endswith(".egg-info"):
                full = os.path.join(site, entry)
                meta = os.path.join(full, "PKG-INFO") if os.path.isdir(full) else full
            else:
                continue
            name = version = None
            if not deadline.expired():
                name, version = read_dist_headers(meta)
            else:
                partial = True
            if not name:
                name, v2 = _from_dir_name(entry)
                version = version or v2
            key = canonical_name(name)
            if key in packages and packages[key] != version:
                notes.append(
                    f"{prefix}: {key} installed twice ({packages[key]} and {version}); stale metadata?"
                )
            packages.setdefault(key, version)
        tv = os.path.join(site, "torch", "version.py")
        if torch is None and os.path.isfile(tv):
            torch = read_torch_version(tv)
            if torch is not None:
                torch["path"] = tv
    env["site_packages"] = sorted(site_dirs)
    env["packages"] = dict(sorted(packages.items()))
    env["package_count"] = len(packages)
    env["torch"] = torch
    if partial:
        env["partial"] = True
        notes.append(f"{prefix}: deadline reached; some versions taken from directory names")
    return env, notes
