"""``--path`` / ``--tag`` / ``--host`` on every command that takes a snapshot, and the note a bare ``latest`` leaves.

The selection itself is :mod:`ogrefs.snapshot.selection`; this module only
turns the options into a :class:`Filters` and says on stderr when ``latest``
passed over newer partial snapshots, so that the pick is never a surprise.
"""

from __future__ import annotations

import functools
from typing import Callable

import click

from ogrefs.snapshot.selection import Filters, Manifest, select_snapshot


def filter_options(f: Callable) -> Callable:
    """Add --path, --tag, --host to a command; it receives them as one ``filters`` argument."""

    @functools.wraps(f)
    def wrapper(*args, sel_paths=(), sel_tags=(), sel_hosts=(), **kw):
        return f(*args, filters=Filters.of(sel_paths, sel_tags, sel_hosts), **kw)

    for opt in reversed([
        click.option("--path", "sel_paths", multiple=True, metavar="PATH",
                     help="Only snapshots whose paths are exactly these (repeatable: the whole set)."),
        click.option("--tag", "sel_tags", multiple=True, metavar="TAG",
                     help="Only snapshots carrying this tag (repeatable: all of them)."),
        click.option("--host", "sel_hosts", multiple=True, metavar="HOST",
                     help="Only snapshots taken on this host (repeatable: any of them); `latest` is then "
                          "that host's newest, whatever its box."),
    ]):
        wrapper = opt(wrapper)
    return wrapper


def pick(repo, name: str, filters: Filters, quiet: bool = False) -> Manifest:
    """The snapshot ``name`` selects; a note on stderr when a bare ``latest`` passed over newer partial ones."""
    m, passed = select_snapshot(repo, name, filters=filters)
    if passed and not quiet:
        newest = passed[-1]
        click.echo(f"note: {name} is {m['id'][:12]} ({' '.join(m['paths'])}): {len(passed)} newer snapshot(s) of "
                   f"paths inside it passed over, the newest {newest['id'][:12]} ({' '.join(newest['paths'])}); "
                   f"--path picks one", err=True)
    return m


def pick_all(repo, names, filters: Filters, quiet: bool = False) -> list[Manifest]:
    """``names`` resolved (each once), or every snapshot the filters keep when none is named."""
    if names:
        picked = {m["id"]: m for m in (pick(repo, n, filters, quiet) for n in names)}
        return list(picked.values())
    return [m for m in repo.list_snapshots() if filters.matches(m)]
