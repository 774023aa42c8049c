"""``ogrefs mounts``: the mounts of this box and the local state they keep (``--remove`` to delete a state).

Registered on the main group by :func:`register`; the work is in :mod:`ogrefs.mount.state`.
"""

from __future__ import annotations

import click

from ogrefs.cli.base import emit_json, json_option
from ogrefs.units import human_bytes


@click.command(name="mounts")
@click.option("--remove", "remove", metavar="STATE_DIR|TARGET",
              help="Delete the state directory (local writes and local copy) of a mount that is not mounted.")
@json_option
def mounts_cmd(remove: str | None, as_json: bool) -> None:
    """List writable and read-only mounts and the state directories writable mounts leave.

    A writable mount keeps its writes and its local copy in a state directory
    after `unmount` (mounting again resumes from it); this lists each one with
    its size, and `--remove` deletes one that no live mount uses.
    """
    from ogrefs.mount.state import list_mounts, remove_state

    if remove:
        gone = remove_state(remove)
        emit_json({"removed": str(gone)}) if as_json else click.echo(f"removed {gone}")
        return
    items = list_mounts()
    if as_json:
        emit_json([m.as_dict() for m in items])
        return
    if not items:
        click.echo("no mounts and no mount state on this box")
        return
    for m in items:
        kind = "no-FUSE" if m.in_place else "writable" if m.writable else "read-only"
        snap = (m.snapshot or "?")[:12]
        click.echo(f"{m.target or '?'}  {kind}, {m.state}, snapshot {snap}" + (f", pid {m.pid}" if m.pid else ""))
        if m.state_dir:
            s = m.sizes
            click.echo(f"  state {m.state_dir}: {human_bytes(s.get('total', 0))} (local copy "
                       f"{human_bytes(s.get('tree', 0))}, writes {human_bytes(s.get('upper', 0))})")
        if "cache" in m.sizes:
            click.echo(f"  chunk cache (shared) {human_bytes(m.sizes['cache'])}")


def register(group: click.Group) -> None:
    group.add_command(mounts_cmd)
