"""The ``ogrefs`` command line.

Every error a user can cause ends as one line on stderr and a non-zero exit
(see ``main``); ``--json`` output is for scripts, the rest for people.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any, Callable

import click

from ogrefs.cli.base import (
    ENVIRONMENT_HELP,
    EXIT_CODES_HELP,
    Context,
    add_global_options,
    emit_json,
    group_options,
    json_option,
    local_time,
    run_main,
)
from ogrefs.errors import EXIT_PARTIAL, UsageError
from ogrefs.cli.progress import ProgressLine, WorkLine
from ogrefs.cli.select import filter_options, pick, pick_all
from ogrefs.units import human_bytes


def retry_for_option(f: Callable) -> Callable:
    """``--retry-for`` (snapshot, restore; the mount has its own): how long store calls ride out an outage."""
    return click.option("--retry-for", type=click.FloatRange(0, 86400), default=60.0, show_default=True,
                        help="Seconds to keep retrying an unreachable store before giving up.")(f)


@click.group(context_settings={"help_option_names": ["-h", "--help"]},
             epilog=f"{ENVIRONMENT_HELP}\n\n{EXIT_CODES_HELP}")
@group_options
@click.version_option(package_name="ogrefs")
@click.pass_context
def cli(ctx: click.Context, **options: Any) -> None:
    """Snapshot a whole training box and bring it back, lazily.

    Global options may come before or after the command. Encrypted
    repositories take the passphrase from --password-file,
    --password-command, OGREFS_PASSWORD, a raw --key-file, or a prompt.

    --json: JSON on stdout and errors as one JSON object on stderr. run, shell,
    dump, cat blob, cat catalog and help print content, not JSON: they refuse
    --json (exit 2).
    """
    ctx.obj = Context(**options)


@cli.command()
@click.option("--pack-size", type=click.IntRange(1, 1024), default=32, show_default=True, help="Target pack size, MiB.")
@click.option("--compression-level", type=click.IntRange(0, 19), default=3, show_default=True)
@click.option("--encrypt", is_flag=True, help="Encrypt every object (AES-256-GCM; key wrapped by passphrase).")
@json_option
@click.pass_obj
def init(obj: Context, pack_size: int, compression_level: int, encrypt: bool, as_json: bool) -> None:
    """Create a new repository."""
    from ogrefs.repo import Repository

    secret = None
    if encrypt:
        secret = obj.secret(prompt=False) if obj.has_secret_source() else _prompt_new_passphrase()
    repo = Repository.init(obj.url(), s3_endpoint=obj.s3_endpoint, pack_target_size=pack_size * 1024 * 1024,
                           compression_level=compression_level, secret=secret)
    if as_json:
        emit_json({"id": repo.config.id, "url": repo.store.url, "version": repo.config.version,
                   "encryption": repo.config.encryption})
    else:
        enc = " (encrypted)" if encrypt else ""
        click.echo(f"created ogrefs repository {repo.config.id[:8]} at {repo.store.url}{enc}")


def _prompt_new_passphrase(sources: str = "OGREFS_PASSWORD, --password-file, --password-command, --key-file",
                           what: str = "--encrypt"):
    from ogrefs.repo.keys import Secret

    if not os.isatty(0):
        raise UsageError(f"{what} needs {sources} or a terminal to ask on")
    value = click.prompt("new repository passphrase", hide_input=True, confirmation_prompt=True)
    if not value:
        raise UsageError("an empty passphrase protects nothing")
    return Secret(value.encode(), "scrypt")


@cli.group()
def key() -> None:
    """Manage the passphrases and key files of an encrypted repository."""


@key.command(name="list")
@json_option
@click.pass_obj
def key_list(obj: Context, as_json: bool) -> None:
    """List keys (the one used now is marked *)."""
    from ogrefs.repo.keys import list_keys

    repo = obj.open()
    if not repo.config.encryption:
        emit_json([]) if as_json else click.echo(f"{repo.store.url} is not encrypted: it has no keys")
        return
    keys = list_keys(repo.store)
    if as_json:
        emit_json([{k: p.get(k) for k in ("id", "kdf", "label", "host", "created")} | {"current": p["id"] == repo.key_id}
                   for p in keys])
        return
    for p in keys:
        mark = "*" if p["id"] == repo.key_id else " "
        click.echo(f"{mark} {p['id']}  {p.get('kdf'):6}  {p.get('host', '?'):16}  {p.get('label', '')}")


@key.command(name="add")
@click.option("--new-password-file", help="File with the new passphrase (else OGREFS_NEW_PASSWORD or a prompt).")
@click.option("--new-key-file", help="Add a raw key file instead of a passphrase.")
@click.option("--label", default="", help="A note to tell keys apart.")
@json_option
@click.pass_obj
def key_add(obj: Context, new_password_file, new_key_file, label, as_json: bool) -> None:
    """Add a passphrase or key file that also opens the repository."""
    repo = _encrypted(obj)
    params = repo.add_key(_new_secret(new_password_file, new_key_file), label)
    if as_json:
        emit_json({"added": params["id"], "kdf": params.get("kdf"), "label": params.get("label", label)})
    else:
        click.echo(f"added key {params['id']}")


def _new_secret(new_password_file: str | None, new_key_file: str | None):
    """The new passphrase or key file of ``key add`` / ``key passwd``."""
    from ogrefs.repo.keys import Secret

    if new_key_file or new_password_file:
        return Secret.from_sources(new_password_file, new_key_file)
    if os.environ.get("OGREFS_NEW_PASSWORD"):
        return Secret(os.environ["OGREFS_NEW_PASSWORD"].encode(), "scrypt")
    return _prompt_new_passphrase("OGREFS_NEW_PASSWORD, --new-password-file, --new-key-file", "a new key")


def _encrypted(obj: Context):
    """The repository, opened; a usage error naming the way to encryption when it is not encrypted."""
    repo = obj.open()
    if not repo.config.encryption:
        raise UsageError(f"{repo.store.url} is not encrypted, so it has no keys; to encrypt, init a new "
                         "repository with --encrypt and copy the snapshots into it (ogrefs copy --from-repo)")
    return repo


@key.command(name="passwd")
@click.option("--new-password-file", help="File with the new passphrase (else OGREFS_NEW_PASSWORD or a prompt).")
@click.option("--new-key-file", help="Change to a raw key file instead of a passphrase.")
@json_option
@click.pass_obj
def key_passwd(obj: Context, new_password_file, new_key_file, as_json: bool) -> None:
    """Change the passphrase that opened the repository (as restic: a new key replaces the one in use)."""
    from ogrefs.repo.keys import list_keys, remove_key

    repo = _encrypted(obj)
    old = next((k for k in list_keys(repo.store) if k["id"] == repo.key_id), {})
    params = repo.add_key(_new_secret(new_password_file, new_key_file), old.get("label", ""))
    remove_key(repo.store, repo.key_id or "", params["id"])
    if as_json:
        emit_json({"added": params["id"], "removed": repo.key_id})
    else:
        click.echo(f"changed: key {repo.key_id} replaced by {params['id']}")


@key.command(name="remove")
@click.argument("key_id")
@json_option
@click.pass_obj
def key_remove(obj: Context, key_id: str, as_json: bool) -> None:
    """Remove key KEY_ID, or the one key whose id starts with it (never the last one, nor the one in use)."""
    from ogrefs.repo.keys import key_by_prefix, list_keys, remove_key

    repo = _encrypted(obj)
    key_id = key_by_prefix([k["id"] for k in list_keys(repo.store)], key_id)
    remove_key(repo.store, key_id, repo.key_id or "")
    emit_json({"removed": key_id}) if as_json else click.echo(f"removed key {key_id}")


@cli.command()
@click.argument("paths", nargs=-1, type=click.Path(path_type=bytes))
@click.option("--tag", "tags", multiple=True, help="Tag the snapshot (repeatable).")
@click.option("--exclude", "excludes", multiple=True,
              help="Skip paths matching this glob (repeatable): * ? [set], against the path and the name.")
@click.option("--exclude-file", "exclude_files", multiple=True, type=click.Path(),
              help="Read --exclude patterns from this file, one a line (# comments).")
@click.option("--exclude-caches", is_flag=True, help="Skip directories holding a CACHEDIR.TAG (bford.info/cachedir).")
@click.option("--exclude-if-present", "if_present", multiple=True, metavar="NAME[:HEADER]",
              help="Skip directories holding a file of this name (that starts with HEADER) (repeatable).")
@click.option("--files-from", "files_from", multiple=True, type=click.Path(),
              help="Read the paths to snapshot from this file, one a line (# comments).")
@click.option("--dry-run", "-n", is_flag=True, help="Only count what would be snapshotted; store nothing.")
@click.option("--allow-empty", is_flag=True, help="Save a snapshot even when the excludes leave nothing in it.")
@click.option("--whole-box", is_flag=True,
              help="Snapshot / with every local disk file system (not pseudo, network or foreign FUSE ones); "
                   "/tmp, /var/tmp, /run, /var/run, /var/lock, /proc, /sys, /dev and /lost+found are left out.")
@click.option("--cross-mounts/--one-file-system", default=True,
              help="Descend into other mounted file systems (default) or stay on each path's own; "
                   "every mount point not descended into is listed.")
@click.option("--parent", help="Compare against this snapshot instead of the newest of the same paths.")
@click.option("--force", is_flag=True, help="Read every file, ignoring any parent snapshot.")
@click.option("--host", default=None, help="Host name to record (default: this machine's).")
@click.option("--box", envvar="OGREFS_BOX", default=None,
              help="The box this snapshot belongs to (default: that of the snapshot this box runs from, "
                   "else HOST-xxxxxxxx from the host name and machine id); `latest` means this box's newest.")
@retry_for_option
@json_option
@click.pass_obj
def snapshot(obj: Context, paths: tuple[bytes, ...], tags, excludes, exclude_files, exclude_caches, if_present,
             files_from, dry_run, allow_empty, whole_box, cross_mounts, parent, force, host, box, retry_for, as_json) -> None:
    """Snapshot PATHS (or the whole box) into the repository.

    Patterns are shell globs (* ? [abc] [!abc]) matched against the absolute
    path and the name; one ending in / matches a directory; a malformed one is
    an error. A snapshot that the excludes leave empty is refused without
    --allow-empty.
    """
    from ogrefs.snapshot.patterns import (
        CACHEDIR_SIGNATURE,
        check_pattern,
        parse_if_present,
        read_pattern_file,
    )
    from ogrefs.snapshot.pipeline import take_snapshot
    from ogrefs.snapshot.setup import snapshot_options

    excludes = [check_pattern(p) for p in [*excludes, *(q for f in exclude_files for q in read_pattern_file(f))]]
    markers = [parse_if_present(spec) for spec in if_present]
    if exclude_caches:
        markers.append((b"CACHEDIR.TAG", CACHEDIR_SIGNATURE))
    paths = tuple(paths) + tuple(os.fsencode(p) for f in files_from
                                 for p in read_pattern_file(f, "--files-from"))
    if whole_box:
        paths = paths or (b"/",)
        if paths != (b"/",):
            raise UsageError("--whole-box snapshots / and takes no paths")
    if not paths:
        raise UsageError("nothing to snapshot: give paths or --whole-box")
    repo = obj.open(retry_for=retry_for)
    opts = snapshot_options(repo, list(paths), tags=list(tags), excludes=list(excludes), whole_box=whole_box,
                            cross_mounts=cross_mounts, parent=parent, no_parent=force, host=host, box=box)
    opts.exclude_if_present = markers
    rules = _snapshot_rules(opts)
    if _snapshot_precheck(opts, rules, dry_run, allow_empty, as_json):
        return
    line = ProgressLine(enabled=not (as_json or obj.quiet))
    if line.enabled:  # restic's way to a percentage: count the total beside the snapshot
        from ogrefs.snapshot.dryrun import scan_in_background

        scan_in_background([os.path.abspath(p) for p in opts.paths], rules,
                           {os.path.normpath(p) for p in opts.skip_paths}, lambda t: setattr(line, "total", t))
    manifest = take_snapshot(repo, opts, progress=line.snapshot)
    line.done()
    if as_json:
        emit_json(manifest)
    else:
        t = manifest["totals"]
        click.echo(f"snapshot {manifest['id'][:12]} saved: {t['files']} files, {t['dirs']} dirs, "
                   f"{human_bytes(t['bytes'])} ({t['reused_files']} files unchanged), "
                   f"{human_bytes(t['new_stored_bytes'])} new in the repository, {t['seconds']:.1f} s")
    for item in manifest["changed_during_snapshot"]:
        click.echo(f"warning: {item} kept changing while it was read; stored as last read and flagged", err=True)
    for item in manifest["skipped"]:
        click.echo(f"note: skipped {item['path']} ({item['reason']})", err=True)
    for item in manifest.get("skipped_mounts", []):
        click.echo(f"note: not descended into {item['path']} ({item['type']}: {item['reason']})", err=True)
    for item in manifest["unreadable"]:
        click.echo(f"error: could not read {item['path']}: {item['error']}", err=True)
    if manifest["unreadable"]:
        sys.exit(EXIT_PARTIAL)


def _snapshot_rules(opts):
    """The walk rules of the snapshot (for the empty check, --dry-run and the progress total)."""
    from ogrefs.snapshot.walk import WalkRules

    rules = (WalkRules.for_whole_box(opts.excludes, [], opts.cross_mounts) if opts.whole_box
             else WalkRules.for_paths(opts.excludes, opts.cross_mounts))
    rules.exclude_if_present = opts.exclude_if_present
    return rules


def _snapshot_precheck(opts, rules, dry_run: bool, allow_empty: bool, as_json: bool) -> bool:
    """Refuse a snapshot the excludes leave empty; answer --dry-run. True: nothing more to do."""
    from ogrefs.snapshot.patterns import nothing_below

    roots = [os.path.abspath(p) for p in opts.paths]
    if not dry_run and not allow_empty:
        why = nothing_below([r for r in roots if os.path.lexists(r)] or roots, rules.excluded)
        if why:
            raise UsageError(f"{why}: the snapshot would be empty (--allow-empty saves it anyway)")
    if not dry_run:
        return False
    from ogrefs.snapshot.dryrun import dry_run as count

    result = count(roots, rules, {os.path.normpath(p) for p in opts.skip_paths})
    if as_json:
        emit_json(result.as_dict())
    else:
        click.echo(f"would snapshot {result.files} files, {result.dirs} dirs, {result.others} other, "
                   f"{human_bytes(result.bytes)} (dry run: nothing stored)")
        for item in result.not_descended:
            click.echo(f"note: would not descend into {item['path']} ({item['type']}: {item['reason']})", err=True)
        for item in result.unreadable:
            click.echo(f"error: cannot read {item['path']}: {item['error']}", err=True)
    return True


@cli.command()
@click.option("--box", default=None, help="Only snapshots of this box.")
@json_option
@click.pass_obj
@filter_options
def snapshots(obj: Context, box, as_json, filters) -> None:
    """List snapshots, oldest first."""
    repo = obj.open()
    unreadable: list[str] = []

    def skip(sid: str, exc: Exception) -> None:
        unreadable.append(sid)
        click.echo(f"error: snapshot {sid[:12]} is unreadable and not listed: {exc}", err=True)

    items = repo.list_snapshots(on_error=skip)
    try:
        _print_snapshots([m for m in items if filters.matches(m)], box, as_json)
    finally:
        if unreadable:
            sys.exit(1)  # the listing above is complete but for these; scripts must notice


def _print_snapshots(items: list, box, as_json: bool) -> None:
    from ogrefs.snapshot.selection import box_of, checkpoint_of

    if box:
        items = [m for m in items if box_of(m) == box]
    if as_json:
        emit_json([{k: m.get(k) for k in ("id", "time", "host", "paths", "tags", "parent", "totals")}
                   | {"box": box_of(m), "checkpoint": checkpoint_of(m)} for m in items])
        return
    if not items:
        click.echo("no snapshots")
        return
    click.echo(f"{'ID':12}  {'TIME (local)':23}  {'BOX':16}  {'SIZE':>9}  {'CHECKPOINT':24}  PATHS")
    for m in items:
        size = human_bytes(m.get("totals", {}).get("bytes", 0))
        tags_s = f"  [{', '.join(m['tags'])}]" if m.get("tags") else ""
        click.echo(f"{m['id'][:12]}  {local_time(m['time']):23}  {box_of(m)[:16]:16}  {size:>9}  "
                   f"{_checkpoint_label(checkpoint_of(m)):24}  {' '.join(m['paths'])}{tags_s}")


def _checkpoint_label(ck: dict | None) -> str:
    """``run@step 300`` for the coherent checkpoint a snapshot holds, ``-`` for none."""
    if ck is None:
        return "-"
    where = f"step {ck['step']}" if ck["step"] is not None else (
        f"epoch {ck['epoch']:g}" if ck["epoch"] is not None else "weights")
    return f"{os.path.basename(str(ck['run'] or '').rstrip('/')) or '/'}@{where}"


@cli.command()
@click.argument("snap")
@json_option
@click.pass_obj
@filter_options
def show(obj: Context, snap: str, as_json: bool, filters) -> None:
    """Show what snapshot SNAP holds."""
    from ogrefs.snapshot.selection import box_of, checkpoint_of

    repo = obj.open()
    m = pick(repo, snap, filters, as_json or obj.quiet)
    if as_json:
        emit_json(m)
        return
    t = m["totals"]
    click.echo(f"snapshot {m['id']}")
    click.echo(f"  time     {local_time(m['time'])} ({m['time']})")
    click.echo(f"  host     {m['host']}")
    click.echo(f"  box      {box_of(m)}")
    if checkpoint_of(m):
        click.echo(f"  checkpoint {_checkpoint_label(checkpoint_of(m))} ({checkpoint_of(m)['path']})")
    click.echo(f"  paths    {' '.join(m['paths'])}")
    if m.get("tags"):
        click.echo(f"  tags     {', '.join(m['tags'])}")
    click.echo(f"  parent   {m['parent'] or '-'}")
    click.echo(f"  contents {t['files']} files, {t['dirs']} dirs, {t['others']} other, {human_bytes(t['bytes'])}")
    click.echo(f"  added    {t['new_chunks']} new chunks, {human_bytes(t['new_stored_bytes'])} stored")
    env = m.get("environment")
    if env:
        try:
            from ogrefs.inspect import format_environment

            for line in format_environment(env):
                click.echo(f"  {line}")
        except ImportError:
            pass
    from ogrefs.inspect.compat import driver_versions

    for line in driver_versions(m):
        click.echo(f"  {line}")
    for key, label in (("changed_during_snapshot", "changed while read"), ("unreadable", "unreadable")):
        if m.get(key):
            click.echo(f"  {label}: {len(m[key])}")
    for item in m.get("skipped_mounts", []):
        click.echo(f"  not descended into {item['path']} ({item['type']}: {item['reason']})")


@cli.command()
@click.argument("snap")
@click.argument("target", type=click.Path(path_type=bytes))
@click.option("--include", "includes", multiple=True, type=click.Path(path_type=bytes),
              help="Restore only this path of the snapshot (repeatable).")
@click.option("--workers", type=click.IntRange(1, 64),
              help="Ranges fetched at once (default: two per usable CPU, 4 to 32).")
@click.option("--strict", is_flag=True, help="Refuse when this box cannot run the snapshot as it ran.")
@click.option("--force", is_flag=True, help="Restore even when the target seems to lack the free space.")
@retry_for_option
@json_option
@click.pass_obj
@filter_options
def restore(obj: Context, snap: str, target: bytes, includes, workers, strict, force, retry_for, as_json,
            filters) -> None:
    """Restore snapshot SNAP below TARGET (paths keep their absolute layout)."""
    from ogrefs.repo.catalog import Catalog
    from ogrefs.inspect.compat import environment_warning
    from ogrefs.restore import Restorer, interruptible_sleep, short_gil_turns, stop_on_signals

    stop = threading.Event()  # set by SIGINT/SIGTERM: no range is fetched after it, retry waits end
    repo = obj.open(retry_for=retry_for, sleep=interruptible_sleep(stop))
    lock = click.get_current_context().with_resource(repo.lock("shared", "restore"))  # prune keeps what we read
    m = pick(repo, snap, filters, as_json or obj.quiet)
    lock.set_snapshot(m["id"])
    warning = environment_warning(m, strict)
    if warning:
        click.echo(f"warning: {warning}", err=True)
    cat = Catalog(repo.catalog_path(m["id"]))
    line = ProgressLine(enabled=not (as_json or obj.quiet))
    r = Restorer(cat, repo.read_pack_range, target, includes=list(includes), workers=workers, progress=line.restore,
                 decode_blob=repo.codec.decode_blob, check_space=not force, stop_event=stop)
    short_gil_turns()
    try:
        with stop_on_signals(r.stop):
            stats = r.run()
    finally:
        line.done()
    _restore_report(r, stats, m["id"], target, as_json)


def _restore_report(r, stats, snap_id: str, target: bytes, as_json: bool) -> None:
    """The summary of a restore (failures counted) and its exit status: 0 only when everything is in place."""
    failed = {os.fsdecode(k): v for k, v in sorted(r.failed.items())}
    below = {os.fsdecode(k): v for k, v in sorted(r.below_failed().items())}
    meta = {os.fsdecode(k): v for k, v in sorted(r.metadata_problems.items())}
    result = {"id": snap_id, "target": os.fsdecode(target), "files": stats.files, "dirs": stats.dirs,
              "others": stats.others, "bytes": stats.total_bytes, "restored_bytes": stats.restored_bytes,
              "written_bytes": stats.written_bytes,
              "fetched_bytes": stats.fetched_bytes, "requests": stats.requests, "workers": r.workers,
              "files_restored": stats.files_done,
              "failed": failed, "not_restored_below": below, "metadata_problems": meta, "skipped": r.skipped}
    for path, reason in failed.items():
        click.echo(f"error: {path}: {reason} (not restored)", err=True)
    for path, n in below.items():
        click.echo(f"error: {path}: {n} entries below it not restored", err=True)
    for path, reason in meta.items():
        click.echo(f"error: {path}: {reason}", err=True)
    for entry in r.skipped:
        click.echo(f"error: catalog entry {entry} not restored (unsafe or malformed)", err=True)
    if as_json:
        emit_json(result)
    else:
        problems = f", {r.problems} problems (see above)" if r.problems else ""
        click.echo(f"restored {stats.files_done} of {stats.files} files, {stats.dirs} dirs, "
                   f"{human_bytes(stats.restored_bytes)} of {human_bytes(stats.total_bytes)} "
                   f"from {snap_id[:12]} to {os.fsdecode(target)}{problems}")
    if r.problems:
        sys.exit(EXIT_PARTIAL)


@cli.command()
@click.argument("snap_a")
@click.argument("snap_b")
@click.option("--limit", type=int, default=50, show_default=True, help="Paths listed per kind (0 = all).")
@json_option
@click.pass_obj
@filter_options
def diff(obj: Context, snap_a: str, snap_b: str, limit: int, as_json: bool, filters) -> None:
    """What changed from SNAP_A to SNAP_B: files, bytes, environment."""
    from ogrefs.repo.catalog import Catalog
    from ogrefs.maint.diff import diff_catalogs

    repo = obj.open()
    ma, mb = (pick(repo, s, filters, as_json or obj.quiet) for s in (snap_a, snap_b))
    files = diff_catalogs(Catalog(repo.catalog_path(ma["id"])), Catalog(repo.catalog_path(mb["id"])))
    env_changes: dict = {}
    if ma.get("environment") and mb.get("environment"):
        from ogrefs.inspect import diff_environments

        env_changes = diff_environments(ma["environment"], mb["environment"])
    if as_json:
        emit_json({"a": ma["id"], "b": mb["id"], "files": files.as_dict(limit or None), "environment": env_changes})
        return
    click.echo(f"diff {ma['id'][:12]} -> {mb['id'][:12]}")
    for label, items in (("+", files.added), ("-", files.removed), ("M", files.changed)):
        for p in items[: limit or None]:
            click.echo(f"{label} {p}")
        if limit and len(items) > limit:
            click.echo(f"{label} ... and {len(items) - limit} more")
    click.echo(f"files: {len(files.added)} added ({human_bytes(files.added_bytes)}), {len(files.removed)} removed "
               f"({human_bytes(files.removed_bytes)}), {len(files.changed)} changed "
               f"({human_bytes(files.changed_bytes_before)} -> {human_bytes(files.changed_bytes_after)})")
    if env_changes:
        click.echo("environment:")
        for line in _format_env_changes(env_changes):
            click.echo(f"  {line}")
    else:
        click.echo("environment: unchanged")
    from ogrefs.inspect.compat import driver_versions

    for line in driver_versions(ma, mb):
        click.echo(line)


def _format_env_changes(changes: dict, prefix: str = "") -> list[str]:
    """One line per change; a changed value (an [old, new] pair) as ``key: old X, new Y``."""
    lines = []
    for key, value in changes.items():
        if isinstance(value, dict) and value:
            lines.append(f"{prefix}{key}:")
            lines.extend(_format_env_changes(value, prefix + "  "))
        elif isinstance(value, list) and key not in ("added", "removed") and len(value) == 2:
            old, new = (_env_value(v) for v in value)
            lines.append(f"{prefix}{key}: old {old}, new {new}")
        elif isinstance(value, list):
            for item in value:
                lines.append(f"{prefix}{key}: {_env_value(item)}")
        else:
            lines.append(f"{prefix}{key}: {value}")
    return lines


def _env_value(v) -> str:
    return v if isinstance(v, str) else json.dumps(v, default=str)


@cli.command()
@click.option("--read-data", is_flag=True, help="Download and verify every chunk.")
@click.option("--read-data-subset", "subset_text", metavar="N/T|P%|SIZE",
              help="Download and verify only part of the packs: the N-th of T slices (1/5 .. 5/5 cover all), "
                   "a random P percent, or random packs up to SIZE (e.g. 2G).")
@json_option
@click.pass_obj
def check(obj: Context, read_data: bool, subset_text: str | None, as_json: bool) -> None:
    """Verify the repository's structure (and data with --read-data or --read-data-subset)."""
    from ogrefs.maint.check import Subset, check_repository

    subset = Subset.parse(subset_text) if subset_text is not None else None
    repo = obj.open()
    meter = WorkLine("packs read", enabled=not (as_json or obj.quiet))
    try:
        report = check_repository(repo, read_data=read_data, subset=None if read_data else subset, meter=meter,
                                  progress=None if (as_json or obj.quiet) else
                                  lambda s: click.echo(f"checking {s}", err=True))
    finally:
        meter.done()
    if as_json:
        emit_json({"ok": report.ok, "snapshots": report.snapshots, "packs": report.packs, "blobs": report.blobs,
                   "packs_read": report.packs_read, "read_bytes": report.read_bytes, "problems": report.problems})
    else:
        for p in report.problems:
            click.echo(f"error: {p}", err=True)
        verdict = "no errors" if report.ok else f"{len(report.problems)} problems"
        what = (f", {report.blobs} chunks in {report.packs_read} packs verified ({human_bytes(report.read_bytes)})"
                if read_data or subset else "")
        click.echo(f"checked {report.snapshots} snapshots, {report.packs} packs{what}: {verdict}")
    if not report.ok:
        sys.exit(1)


@cli.command()
@click.argument("snaps", nargs=-1)
@click.option("--keep-last", type=click.IntRange(0), default=0, help="Keep the N newest snapshots.")
@click.option("--keep-hourly", type=click.IntRange(0), default=0, help="Keep the newest of each of N hours.")
@click.option("--keep-daily", type=click.IntRange(0), default=0, help="Keep the newest of each of N days.")
@click.option("--keep-weekly", type=click.IntRange(0), default=0, help="Keep the newest of each of N weeks.")
@click.option("--keep-monthly", type=click.IntRange(0), default=0, help="Keep the newest of each of N months.")
@click.option("--keep-yearly", type=click.IntRange(0), default=0, help="Keep the newest of each of N years.")
@click.option("--keep-within", default=None, metavar="DURATION",
              help="Keep every snapshot within DURATION (e.g. 1y2m3d4h) of the newest of its group.")
@click.option("--keep-tag", "keep_tags", multiple=True, help="Keep every snapshot with this tag.")
@click.option("--group-by", default="host,paths", show_default=True,
              help="Judge snapshots in groups of these fields: host, paths, tags (comma-separated; '' for one "
                   "group per box); each box's snapshots are always judged apart.")
@click.option("--host", "hosts", multiple=True, help="Only consider snapshots of this host (repeatable).")
@click.option("--path", "paths", multiple=True, help="Only consider snapshots of exactly these paths (repeatable).")
@click.option("--tag", "tags", multiple=True, help="Only consider snapshots with this tag (repeatable).")
@click.option("--dry-run", "-n", is_flag=True, help="Only say what would be forgotten.")
@click.option("--prune", "and_prune", is_flag=True, help="Run prune afterwards.")
@json_option
@click.pass_obj
def forget(obj: Context, snaps, keep_last, keep_hourly, keep_daily, keep_weekly, keep_monthly, keep_yearly,
           keep_within, keep_tags, group_by, hosts, paths, tags, dry_run, and_prune, as_json) -> None:
    """Forget snapshots SNAPS, or those a retention policy does not keep (grouped by box, host and paths).

    SNAPS are ids, unique id prefixes or selectors (latest, BOX:latest,
    latest-checkpoint, BOX:latest-checkpoint), as for show and restore.

    Days, weeks, months and years are those of local time.
    """
    from ogrefs.maint.forget import Policy, apply_policy, parse_duration, parse_group_by
    from ogrefs.snapshot.selection import Filters

    policy = Policy(keep_last, keep_hourly, keep_daily, keep_weekly, keep_monthly, list(keep_tags), keep_yearly,
                    keep_within)
    if keep_within:
        parse_duration(keep_within)
    grouping = parse_group_by(group_by)
    if snaps and not policy.empty():
        raise UsageError("give either snapshots to forget or a --keep-* policy, not both")
    if not snaps and policy.empty():
        raise UsageError("nothing to forget: name snapshots or give a --keep-* policy")
    repo = obj.open()
    filters = Filters.of(paths, tags, hosts)
    if snaps:
        removed = pick_all(repo, snaps, filters, as_json or obj.quiet)  # two names of one: once
        kept: list = []
    else:
        chosen = [m for m in repo.list_snapshots(strict=True) if filters.matches(m)]
        kept, removed = apply_policy(chosen, policy, grouping)
    if not dry_run:
        from ogrefs.maint.remove import remove_snapshot

        for m in removed:
            remove_snapshot(repo, m["id"])  # manifest, catalog and access traces; packs are prune's
    groups = _forget_groups(kept, removed, grouping if not snaps else ())
    if as_json:
        emit_json({"dry_run": dry_run, "removed": [m["id"] for m in removed],
                   "kept": [{"id": m["id"], "reasons": r} for m, r in kept],
                   "groups": [{"group": g, "kept": [{"id": m["id"], "reasons": r} for m, r in k],
                               "removed": [m["id"] for m in r]} for g, k, r in groups]})
    else:
        _print_forget_groups(groups, dry_run)
    if and_prune and not dry_run:
        _run_prune(obj, repo, False, as_json)


def _forget_groups(kept: list, removed: list, grouping: tuple[str, ...]) -> list[tuple[dict, list, list]]:
    """(the group's fields: its box, then --group-by's; kept with reasons; removed) per group, in the order first met."""
    from ogrefs.maint.forget import group_key

    out: dict[tuple, tuple[dict, list, list]] = {}

    def slot(m) -> tuple[dict, list, list]:
        key = group_key(m, grouping)
        return out.setdefault(key, (dict(zip(("box", *grouping), key)), [], []))  # group_key: the box first

    for m, reasons in kept:
        slot(m)[1].append((m, reasons))
    for m in removed:
        slot(m)[2].append(m)
    return list(out.values())


def _print_forget_groups(groups: list[tuple[dict, list, list]], dry_run: bool) -> None:
    """As restic: per group, its fields, then which snapshots are kept (and why) and which go."""
    for i, (fields, kept, removed) in enumerate(groups):
        if fields:
            click.echo(("\n" if i else "") + "snapshots of " + ", ".join(
                f"{k} [{' '.join(v) if isinstance(v, tuple) else v}]" for k, v in fields.items()) + ":")
        if kept:
            click.echo(f"keep {len(kept)} snapshots:")
        for m, reasons in kept:
            click.echo(f"  {m['id'][:12]}  {local_time(m['time'])}  {', '.join(reasons)}")
        if removed:
            click.echo(f"{'would forget' if dry_run else 'forget'} {len(removed)} snapshots:")
        for m in removed:
            click.echo(f"  {m['id'][:12]}  {local_time(m['time'])}")


@cli.command(name="prune")
@click.option("--dry-run", "-n", is_flag=True, help="Only say what would be deleted and how many bytes it frees.")
@click.option("--repack-below", type=click.FloatRange(0, 1), default=0.5, show_default=True,
              help="Repack packs whose live bytes are below this fraction of their size (0: never).")
@json_option
@click.pass_obj
def prune_cmd(obj: Context, dry_run: bool, repack_below: float, as_json: bool) -> None:
    """Delete packs that no snapshot references (two-phase; safe next to snapshots and mounts)."""
    _run_prune(obj, obj.open(), dry_run, as_json, repack_below)


def _run_prune(obj: Context, repo, dry_run: bool, as_json: bool, repack_below: float = 0.5) -> None:
    from ogrefs.maint.prune import prune

    meter = WorkLine("packs repacked or deleted", enabled=not (as_json or obj.quiet))
    try:
        report = prune(repo, dry_run=dry_run, log=None if (as_json or obj.quiet) else lambda s: click.echo(s, err=True),
                       repack_below=repack_below, meter=meter)
    finally:
        meter.done()
    if as_json:
        emit_json({"dry_run": dry_run, **report.as_dict()})
        return
    if report.repack:
        click.echo(f"{'would repack' if dry_run else 'repacked'} {len(report.repack)} mostly unused packs "
                   f"({human_bytes(report.repack_bytes)} still in use copied to new packs)")
    for item in report.repack_skipped:
        click.echo(f"warning: not repacked: {item}", err=True)
    if report.stale_temporaries:
        click.echo(f"{'would remove' if dry_run else 'removed'} {report.stale_temporaries} temporary files "
                   f"({human_bytes(report.stale_temporary_bytes)}) that interrupted writes left over an hour ago")
    verb = "would free" if dry_run else "freed"
    click.echo(f"{verb} {human_bytes(report.freed_bytes)} ({len(report.deleted)} packs); "
               f"{len(report.newly_marked) + len(report.deferred)} unreferenced packs "
               f"({human_bytes(report.pending_bytes)}) will be deleted by a later prune once no older lock remains")


@cli.command()
@click.option("--all", "everything", is_flag=True, help="Remove every lock, not only stale ones.")
@json_option
@click.pass_obj
def unlock(obj: Context, everything: bool, as_json: bool) -> None:
    """Remove stale locks (left by processes that died)."""
    from ogrefs.repo.locks import remove_stale_locks

    repo = obj.open()
    removed = remove_stale_locks(repo.store, everything, repo.meta_codec)
    if as_json:
        emit_json({"removed": [lk.__dict__ for lk in removed]})
    else:
        for lk in removed:
            click.echo(f"removed lock {lk.id[:12]}: {lk.describe()}")
        click.echo(f"{len(removed)} locks removed")


from ogrefs.cli.browse import register as _register_browse  # noqa: E402
from ogrefs.cli.mount import register as _register_mount  # noqa: E402
from ogrefs.cli.help import register as _register_help  # noqa: E402
from ogrefs.cli.mounts import register as _register_mounts  # noqa: E402

_register_mount(cli)
_register_browse(cli)
_register_mounts(cli)
_register_help(cli)
from ogrefs.cli.agent import register as _register_agent  # noqa: E402

_register_agent(cli)
add_global_options(cli)  # after every command is registered: global options work after the subcommand too


def main(argv: list[str] | None = None) -> None:
    """Entry point: map expected failures to one line and an exit code (see cli_base.run_main)."""
    run_main(cli, argv)
