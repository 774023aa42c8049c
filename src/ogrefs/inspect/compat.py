"""Before a restore or mount: will this snapshot run here as it did there?

Compares the snapshot's recorded environment with this box (NVML again) and
returns one paragraph of warnings; ``--strict`` turns it into a refusal.
"""

from __future__ import annotations

from typing import Any

from ogrefs.errors import OgrefsError


class IncompatibleBox(OgrefsError):
    """The box differs from the snapshot's in a way that will stop it running (--strict)."""


def environment_warning(manifest: dict[str, Any], strict: bool = False) -> str | None:
    """The warning paragraph, or None when nothing differs; raises under ``strict``."""
    env = manifest.get("environment")
    if not env:
        return None
    from ogrefs.inspect.compare import compatibility_warnings
    from ogrefs.inspect.here import probe_local_machine

    warnings = compatibility_warnings(env, probe_local_machine())
    if not warnings:
        return None
    text = (f"snapshot {manifest['id'][:12]} may not run here as it did on {manifest.get('host', '?')}: "
            + " ".join(warnings))
    if strict:
        raise IncompatibleBox(text + " (refusing because of --strict)")
    return text


def release_note(manifest: dict[str, Any]) -> str | None:
    """``Debian GNU/Linux 13 (trixie), glibc 2.41, systemd 257``: this box's release when the snapshot's
    (recorded in its environment) differs from it, else None (inspect/release.py)."""
    from ogrefs.inspect.machine import machine_info
    from ogrefs.inspect.release import release_differences, release_name

    snap = (manifest.get("environment") or {}).get("machine") or {}
    here = machine_info()
    return release_name(here) if release_differences(snap, here) else None


def _driver(gpus: dict | None) -> str:
    g = gpus or {}
    if not g.get("driver_version"):
        return f"no NVIDIA driver ({g.get('reason') or 'none answered'})"
    return f"{g['driver_version']} (CUDA up to {g.get('cuda_driver_version') or '?'})"


def driver_versions(*manifests: dict[str, Any]) -> list[str]:
    """One line per side for ``show``/``diff``: the NVIDIA driver each snapshot ran on, and this box's.

    After ``mount SNAP /`` the driver is this box's (a host-owned path,
    docs/mount.md), so these are the two versions that must agree with the
    snapshot's CUDA.
    """
    from ogrefs.inspect.here import probe_local_machine

    lines = [f"driver of snapshot {m['id'][:12]}: {_driver((m.get('environment') or {}).get('gpus'))}"
             for m in manifests]
    try:
        here = probe_local_machine().get("gpus")
    except Exception as exc:  # noqa: BLE001 - a probe that fails is reported, never fatal
        here = {"reason": str(exc)}
    lines.append(f"driver of this box: {_driver(here)}")
    return lines
