"""The options of a snapshot as the CLI and the agent take it: what is never snapshotted, and the probe.

One place, so that ``ogrefs snapshot`` and ``ogrefs agent`` make the same snapshot.
"""

from __future__ import annotations

import os

from ogrefs.errors import UsageError
from ogrefs.snapshot.pipeline import SnapshotOptions


def skip_paths(repo) -> list[bytes]:
    """ogrefs' own cache and state never go into a snapshot (mount state holds whole local copies)."""
    from ogrefs.repo import default_cache_dir

    skip = [os.fsencode(default_cache_dir()), os.fsencode(repo.cache_dir),
            os.fsencode(os.environ.get("OGREFS_STATE_DIR") or "/var/lib/ogrefs"),
            os.fsencode(os.environ.get("OGREFS_RUNTIME_DIR") or "/run/ogrefs")]
    if repo.store.url.startswith("file://"):
        skip.append(os.fsencode(repo.store.url[len("file://"):]))
    return skip


def environment_observers() -> list:
    try:
        from ogrefs.inspect import EnvironmentProbe
    except ImportError:
        return []
    return [EnvironmentProbe()]


def snapshot_options(repo, paths: list[bytes], *, whole_box: bool = False, tags: list[str] | None = None,
                     excludes: list[str] | None = None, cross_mounts: bool = True, parent: str | None = None,
                     no_parent: bool = False, host: str | None = None, box: str | None = None) -> SnapshotOptions:
    if whole_box:
        paths = paths or [b"/"]
        if paths != [b"/"]:
            raise UsageError("--whole-box snapshots / and takes no paths")
    if not paths:
        raise UsageError("nothing to snapshot: give paths or --whole-box")
    opts = SnapshotOptions(paths=list(paths), tags=list(tags or []), excludes=list(excludes or []),
                           whole_box=whole_box, cross_mounts=cross_mounts, parent=parent, no_parent=no_parent,
                           skip_paths=skip_paths(repo), box=box or None)
    if host:
        opts.host = host
    opts.observers.extend(environment_observers())
    return opts
