"""What a snapshot holds: machine, GPUs, CUDA, Python envs, git trees, checkpoints.

A pure library (no CLI, no storage).  The snapshot walker feeds an
:class:`EnvironmentProbe` with every directory it visits and calls
:meth:`EnvironmentProbe.finish` for the manifest; ``show``/``diff``/
``restore`` use the helpers below.  Nothing here imports torch, runs
Python or pip from the snapshotted tree, or unpickles anything.
See docs/inspect.md.
"""

from ogrefs.inspect.compare import compatibility_warnings, diff_environments
from ogrefs.inspect.gpu import probe_gpus
from ogrefs.inspect.probe import (
    MANIFEST_VERSION,
    EnvironmentProbe,
    capture_environment,
    probe_local_machine,
)
from ogrefs.inspect.report import format_environment

__all__ = [
    "MANIFEST_VERSION",
    "EnvironmentProbe",
    "capture_environment",
    "probe_local_machine",
    "probe_gpus",
    "diff_environments",
    "compatibility_warnings",
    "format_environment",
]
