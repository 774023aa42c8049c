"""``ogrefs run SNAP -- CMD`` and ``ogrefs shell SNAP`` (the work is in :mod:`ogrefs.mount.run`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ogrefs.cli.base import json_refused_option, refuse_json
from ogrefs.cli.select import filter_options, pick


def _options(f):
    for opt in reversed([
        click.option("--state-dir", type=click.Path(path_type=Path), default=None,
                     help="Where writes land (default: the snapshot's own, kept for the next run)."),
        click.option("--nspawn", is_flag=True, help="Enter with systemd-nspawn instead of chroot."),
        click.option("--merge", is_flag=True,
                     help="Also show this box's files where the snapshot has none (inside the snapshot's own "
                          "directories too); without it they show only above the snapshot's paths and where "
                          "a host-path rule keeps them."),
        click.option("--materialize", is_flag=True, help="Copy the whole snapshot to local disk meanwhile."),
        click.option("--host-path", "host_path", multiple=True, metavar="[KIND:]PATH",
                     help="Also keep PATH from this box (see `ogrefs mount --help`)."),
        click.option("--no-host-path", "no_host_path", multiple=True, metavar="PATH",
                     help="Take PATH from the snapshot after all."),
        click.option("--no-host-paths", is_flag=True, help="Keep nothing of this box but /proc, /sys, /dev, /run."),
        click.option("--host-paths-file", multiple=True, type=click.Path(dir_okay=False),
                     help="More host-path rules (docs/mount.md)."),
    ]):
        f = opt(f)
    return json_refused_option(filter_options(f))


def _run(obj, name: str, snap: str, command: list[str], state_dir, nspawn, merge, materialize, host_path,
         no_host_path, no_host_paths, host_paths_file, filters) -> None:
    from ogrefs.inspect.compat import environment_warning, release_note
    from ogrefs.box.hostpaths import load_rules
    from ogrefs.mount.options import MountOptions
    from ogrefs.mount.run import run
    refuse_json(obj, name, "what its command prints")
    rules = tuple(load_rules(defaults=not no_host_paths, files=host_paths_file, add=host_path, drop=no_host_path))

    chosen: list[str] = []  # the snapshot's id, resolved once (in the child, where the repository is opened)

    def build(root: Path) -> MountOptions:
        return MountOptions(repo_url=obj.url(), snapshot=chosen[0], mountpoint=root, s3_endpoint=obj.s3_endpoint,
                            read_only=False, state_dir=state_dir, materialize=materialize, box_root=True,
                            host_rules=rules, save_trace=False, merge_host=merge, inject_driver=not no_host_paths)

    def open_repo():
        repo = obj.open()
        manifest = pick(repo, snap, filters, obj.quiet)  # `latest` is this box's, as for mount
        chosen.append(manifest["id"])
        warning = environment_warning(manifest, False)
        if warning:
            click.echo(f"warning: {warning}", err=True)
        if merge and (other := release_note(manifest)):
            click.echo(f"warning: --merge shows this box's {other} files where the snapshot has none: its programs "
                       "may load this box's libraries of another release", err=True)
        return repo

    code = run(build, open_repo, lambda _repo: chosen[0], command, nspawn=nspawn)
    sys.exit(code)


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("snap")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@_options
@click.pass_obj
def run_cmd(obj, snap: str, command: tuple, **kw) -> None:
    """Run COMMAND inside snapshot SNAP's box (its root over this box's, this box's identity, network and
    GPU driver), in a private mount namespace; everything is taken down when it exits, its exit code is
    passed through. Example: ogrefs run latest -- python train.py"""
    _run(obj, "run", snap, list(command), **kw)


@click.command()
@click.argument("snap")
@_options
@click.pass_obj
def shell(obj, snap: str, **kw) -> None:
    """An interactive shell inside snapshot SNAP's box (see `ogrefs run`)."""
    _run(obj, "shell", snap, [os.environ.get("OGREFS_SHELL") or "/bin/bash", "-l"], **kw)


def register(group: click.Group) -> None:
    group.add_command(run_cmd, name="run")
    group.add_command(shell)
