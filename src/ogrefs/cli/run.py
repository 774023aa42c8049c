"""``ogrefs run SNAP -- CMD`` and ``ogrefs shell SNAP`` (the work is in :mod:`ogrefs.mount.run`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ogrefs.cli.base import json_refused_option, refuse_json
from ogrefs.errors import UsageError
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
        click.option("--no-fuse", "no_fuse", is_flag=True,
                     help="Write the snapshot into place at / and run the job supervised on this box's own tree "
                          "(automatic where FUSE or mounting is not allowed; docs/mount.md)."),
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
         no_host_path, no_host_paths, host_paths_file, filters, no_fuse: bool = False) -> None:
    from ogrefs.inspect.compat import environment_warning, release_note
    from ogrefs.box.hostpaths import load_rules
    from ogrefs.mount.options import MountOptions
    from ogrefs.mount.run import run
    refuse_json(obj, name, "what its command prints")
    rules = tuple(load_rules(defaults=not no_host_paths, files=host_paths_file, add=host_path, drop=no_host_path))
    code = _run_without_fuse(obj, snap, command, filters, no_fuse, nspawn, state_dir, rules)
    if code is not None:
        sys.exit(code)

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


def _run_without_fuse(obj, snap: str, command: list[str], filters, forced: bool, nspawn: bool, state_dir,
                      rules) -> int | None:
    """The no-FUSE ``run`` (docs/mount.md, "ogrefs run without FUSE"), where FUSE or mounting is not allowed, with
    --no-fuse, or where a no-FUSE mount of the snapshot is registered: the job's exit code; None (nothing done)
    otherwise.

    The job runs supervised on this box's own tree against the no-FUSE mount of the snapshot (started at /
    if none is, or resumed where its copy stopped), as `ogrefs mount SNAP /` then the job would.
    """
    from ogrefs.box.records import pid_alive, registered_mounts
    from ogrefs.inspect.compat import environment_warning
    from ogrefs.mount.client import mount
    from ogrefs.mount.inplace import why_box_forbids_mounts
    from ogrefs.mount.options import MountOptions
    from ogrefs.mount.run import run_on_copy

    copies = [info for info in registered_mounts() if info.get("in_place") and info.get("mountpoint")]
    why = None if forced else why_box_forbids_mounts()
    if not (forced or why or copies):
        return None
    repo = obj.open()
    # `latest` is this box's, as for mount; its note said once (the FUSE run, if it comes to that, says it)
    manifest = pick(repo, snap, filters, obj.quiet or not (forced or why))
    mine = sorted((c for c in copies if c.get("snapshot") == manifest["id"]), key=lambda c: c["mountpoint"] != "/")
    if not (forced or why or mine):
        return None  # FUSE works and no copy of this snapshot is registered: the mount as ever
    if nspawn:
        raise UsageError("--nspawn needs a mount; without FUSE the job runs on this box's own tree")

    def say(line: str) -> None:
        if not obj.quiet:
            click.echo(line, err=True)

    warning = environment_warning(manifest, False)
    if warning:
        say(f"warning: {warning}")
    named = manifest["id"][:12]
    copy = mine[0] if mine else None
    if copy is None or not (copy.get("finalized") or (copy.get("pid") and pid_alive(copy["pid"]))):
        target = Path(copy["mountpoint"]) if copy else Path("/")
        say(f"{why or '--no-fuse'}: writing {named} into place at {target} (no-FUSE mode); the job runs on this "
            "box's own tree")
        mount(MountOptions(repo_url=obj.url(), snapshot=manifest["id"], mountpoint=target,
                           s3_endpoint=obj.s3_endpoint, read_only=False, state_dir=state_dir, host_rules=rules,
                           no_fuse=True, ready_when_prepared=True), open_repo=lambda: repo)
    else:
        target = Path(copy["mountpoint"])
        say(f"{named} is written into place at {target} by its no-FUSE mount (no-FUSE mode); the job runs on this "
            "box's own tree")
    return run_on_copy(target, command, say)


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
