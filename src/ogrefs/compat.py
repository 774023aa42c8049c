"""Before a restore or mount: will this snapshot run here as it did there?

Compares the snapshot's recorded environment with this box (NVML again) and
returns one paragraph of warnings; ``--strict`` turns it into a refusal.
"""

from __future__ import annotations

from typing import Any

from .errors import OgrefsError


class IncompatibleBox(OgrefsError):
    """The box differs from the snapshot's in a way that will stop it running (--strict)."""


def environment_warning(manifest: dict[str, Any], strict: bool = False) -> str | None:
    """The warning paragraph, or None when nothing differs; raises under ``strict``."""
    env = manifest.get("environment")
    if not env:
        return None
    from .inspect import compatibility_warnings, probe_local_machine

    warnings = compatibility_warnings(env, probe_local_machine())
    if not warnings:
        return None
    text = (f"snapshot {manifest['id'][:12]} may not run here as it did on {manifest.get('host', '?')}: "
            + " ".join(warnings))
    if strict:
        raise IncompatibleBox(text + " (refusing because of --strict)")
    return text
