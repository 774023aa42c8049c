"""What a snapshot holds: machine, GPUs, CUDA, Python envs, git trees, checkpoints.

A pure library (no CLI, no storage).  The snapshot walker feeds an
:class:`EnvironmentProbe` with every directory it visits and calls
:meth:`EnvironmentProbe.finish` for the manifest; ``show``/``diff``/
``restore`` use the helpers below.  Nothing here imports torch, runs
Python or pip from the snapshotted tree, or unpickles anything.
See docs/inspect.md.

The names below are loaded on first use (PEP 562), not when the package
is imported: a mount's compatibility check needs :mod:`ogrefs.inspect.here`
and :mod:`ogrefs.inspect.compare` only, not the walk's readers.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "MANIFEST_VERSION": "here",
    "probe_local_machine": "here",
    "EnvironmentProbe": "probe",
    "capture_environment": "probe",
    "probe_gpus": "gpu",
    "diff_environments": "compare",
    "compatibility_warnings": "compare",
    "format_environment": "report",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ogrefs.inspect' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ogrefs.inspect.{module}"), name)
    globals()[name] = value
    return value
