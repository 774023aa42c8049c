"""Look inside without FUSE, as restic does: ``ls``, ``find``, ``dump``, ``stats``, ``cat``, ``copy``, ``tag``.

Registered on the main group by :func:`register`; the work is in
:mod:`ogrefs.maint.browse` and :mod:`ogrefs.maint.copy`, catalog queries in :mod:`ogrefs.repo.catalog`.
"""

from __future__ import annotations

import fnmatch
import json
import os
import stat
import sys
from typing import Any

import click

from ogrefs.cli.base import Context, emit_json, json_option, json_refused_option, local_time, refuse_json
from ogrefs.errors import UsageError
from ogrefs.units import human_bytes
from ogrefs.cli.select import filter_options, pick, pick_all


def _catalog(repo, manifest):
    from ogrefs.repo.catalog import Catalog

    return Catalog(repo.catalog_path(manifest["id"]))


def _node_dict(path: bytes, n) -> dict[str, Any]:
    kind = {stat.S_IFDIR: "dir", stat.S_IFREG: "file", stat.S_IFLNK: "symlink", stat.S_IFIFO: "fifo",
            stat.S_IFCHR: "chardev", stat.S_IFBLK: "blockdev", stat.S_IFSOCK: "socket"}.get(stat.S_IFMT(n.mode), "?")
    d = {"path": os.fsdecode(path) or "/", "name": os.fsdecode(os.path.basename(path.rstrip(b"/"))) or "/",
         "type": kind, "mode": n.mode, "permissions": stat.filemode(n.mode), "uid": n.uid, "gid": n.gid,
         "user": n.user, "group": n.grp, "size": n.size if n.is_reg else 0, "mtime_ns": n.mtime_ns,
         "mtime": local_time(n.mtime_ns / 1e9), "inode": n.ino, "links": n.nlink}
    if n.is_lnk:
        d["link_target"] = os.fsdecode(n.target or b"")
    return d


def _node_line(path: bytes, n, long: bool) -> str:
    name = os.fsdecode(path) or "/"
    if not long:
        return name
    link = f" -> {os.fsdecode(n.target or b'')}" if n.is_lnk else ""
    size = n.size if n.is_reg else 0
    return (f"{stat.filemode(n.mode)} {n.user or n.uid:>8} {n.grp or n.gid:>8} {size:>12} "
            f"{local_time(n.mtime_ns / 1e9)} {name}{link}")


@click.command(name="ls")
@click.argument("snap")
@click.argument("paths", nargs=-1, type=click.Path(path_type=bytes))
@click.option("--long", "-l", "long", is_flag=True, help="Mode, owner, size and mtime (local time) too.")
@click.option("--recursive", is_flag=True, help="With PATHS: list the directories below them too.")
@json_option
@click.pass_obj
@filter_options
def ls_cmd(obj: Context, snap: str, paths: tuple[bytes, ...], long: bool, recursive: bool, as_json: bool,
           filters) -> None:
    """List the files of snapshot SNAP: all of them, or PATHS and what they directly hold.

    As restic's ls. With --json, one JSON object per line (the snapshot first).
    """
    from ogrefs.maint.browse import lookup

    repo = obj.open()
    m = pick(repo, snap, filters, as_json or obj.quiet)
    cat = _catalog(repo, m)
    if as_json:
        click.echo(json.dumps({"struct_type": "snapshot", "id": m["id"], "time": m["time"], "host": m["host"],
                               "paths": m["paths"], "tags": m.get("tags", [])}))
    for start in paths or (b"/",):
        node = lookup(cat, start if start.startswith(b"/") else b"/" + start, m["id"])
        start = b"/" + start.strip(b"/") if start.strip(b"/") else b""
        entries = [(start, node)] if start else []
        if node.is_dir:
            deep = recursive or not paths
            entries += cat.walk(node.ino, start) if deep else [(start + b"/" + k, v) for k, v in cat.children(node.ino)]
        for p, n in entries:
            click.echo(json.dumps({"struct_type": "node", **_node_dict(p, n)}) if as_json else _node_line(p, n, long))


@click.command(name="find")
@click.argument("patterns", nargs=-1, required=True)
@click.option("--snapshot", "-s", "snaps", multiple=True, help="Search only this snapshot (repeatable).")
@click.option("--long", "-l", "long", is_flag=True, help="Mode, owner, size and mtime (local time) too.")
@json_option
@click.pass_obj
@filter_options
def find_cmd(obj: Context, patterns, snaps, long: bool, as_json: bool, filters) -> None:
    """Find files whose name matches a PATTERN, in every snapshot (newest last).

    A pattern is a shell glob (*, ?, [abc]) matched against the file name;
    one that contains a / is matched against the whole path.
    """
    repo = obj.open()
    manifests = pick_all(repo, snaps, filters, as_json or obj.quiet)
    pats = [os.fsencode(p) for p in patterns]
    results = []
    for m in manifests:
        hits = [(p, n) for p, n in _catalog(repo, m).walk() if _matches(p, pats)]
        if as_json:
            results.append({"snapshot": m["id"], "hits": len(hits), "matches": [_node_dict(p, n) for p, n in hits]})
        elif hits:
            click.echo(f"found in snapshot {m['id'][:12]} from {local_time(m['time'])}")
            for p, n in hits:
                click.echo(_node_line(p, n, long))
    if as_json:
        emit_json(results)


def _matches(path: bytes, pats: list[bytes]) -> bool:
    name = path.rsplit(b"/", 1)[-1]
    return any(fnmatch.fnmatchcase(path if b"/" in p else name, p) for p in pats)


@click.command(name="dump")
@click.argument("snap")
@click.argument("path", type=click.Path(path_type=bytes))
@click.option("--archive", type=click.Choice(["tar"]), default="tar", show_default=True,
              help="Format for a directory.")
@json_refused_option
@click.pass_obj
@filter_options
def dump_cmd(obj: Context, snap: str, path: bytes, archive: str, filters) -> None:
    """Write PATH of snapshot SNAP to stdout: a file as its bytes, a directory as a tar archive.

    The tar is POSIX pax with each entry's extended attributes (SCHILY.xattr.*, as GNU tar and
    restic write them: tar -x --xattrs --xattrs-include='*' restores them). Refuses --json.
    """
    from ogrefs.maint.browse import file_data, lookup, write_tar

    refuse_json(obj, "dump", "the file's bytes or a tar")
    repo = obj.open()
    m = pick(repo, snap, filters, obj.quiet)
    cat = _catalog(repo, m)
    node = lookup(cat, path if path.startswith(b"/") else b"/" + path, m["id"])
    out = sys.stdout.buffer
    if sys.stdout.isatty():
        raise UsageError("dump writes binary data: redirect stdout to a file or a pipe")
    if node.is_dir:
        write_tar(repo, cat, b"/" + path.strip(b"/"), node, out)
    elif node.is_reg:
        for piece in file_data(repo, cat, node):
            out.write(piece)
    else:
        raise UsageError(f"{os.fsdecode(path)} is a {stat.filemode(node.mode)[0]!r} entry, not a file or directory")
    out.flush()


@click.command(name="stats")
@click.argument("snaps", nargs=-1)
@click.option("--mode", type=click.Choice(["restore-size", "raw", "raw-data"]), default="restore-size",
              show_default=True, help="restore-size: what a restore writes; raw: the unique chunks, as stored.")
@json_option
@click.pass_obj
@filter_options
def stats_cmd(obj: Context, snaps, mode: str, as_json: bool, filters) -> None:
    """Sizes of SNAPS (default: every snapshot), as restic's stats."""
    from ogrefs.maint.browse import raw_size, restore_size

    repo = obj.open()
    manifests = pick_all(repo, snaps, filters, as_json or obj.quiet)
    cats = [_catalog(repo, m) for m in manifests]
    st = restore_size(cats) if mode == "restore-size" else raw_size(cats)
    if as_json:
        emit_json(st.as_dict())
        return
    click.echo(f"stats in {st.mode} mode of {st.snapshots} snapshots")
    if st.mode == "restore-size":
        click.echo(f"  total file count  {st.files}")
        click.echo(f"  total size        {human_bytes(st.bytes)}")
    else:
        ratio = f"{st.bytes / st.stored_bytes:.2f}x" if st.stored_bytes else "-"
        click.echo(f"  unique chunks     {st.chunks}")
        click.echo(f"  total size        {human_bytes(st.bytes)} (uncompressed)")
        click.echo(f"  stored size       {human_bytes(st.stored_bytes)} (compression {ratio})")


@click.command(name="cat")
@click.argument("kind", type=click.Choice(["config", "snapshot", "catalog", "key", "lock", "index", "blob"]))
@click.argument("name", required=False)
@click.pass_obj
def cat_cmd(obj: Context, kind: str, name: str | None) -> None:
    """Print a repository object decoded: config, snapshot ID (manifest), key ID, lock ID, index NAME
    (JSON); blob CHUNK_ID (its verified bytes) or catalog ID (the SQLite file) to a pipe.

    The JSON kinds print JSON with or without --json; blob and catalog refuse --json."""
    from ogrefs.cli.cat import show_object

    if kind in ("blob", "catalog"):
        refuse_json(obj, f"cat {kind}", "its bytes")
    if kind != "config" and not name:
        raise UsageError(f"cat {kind} needs a name (e.g. ogrefs cat {kind} ID)")
    repo = obj.open()
    out = show_object(repo, kind, name or "")
    if isinstance(out, bytes):
        if sys.stdout.isatty():
            raise UsageError(f"cat {kind} writes binary data: redirect stdout to a file or a pipe")
        sys.stdout.buffer.write(out)
    else:
        emit_json(out)


@click.command(name="copy")
@click.argument("snaps", nargs=-1)
@click.option("--from-repo", required=True, envvar="OGREFS_FROM_REPO", help="Repository to copy from.")
@click.option("--from-s3-endpoint", envvar="OGREFS_FROM_S3_ENDPOINT", help="S3 endpoint of the source repository.")
@click.option("--from-password-file", envvar="OGREFS_FROM_PASSWORD_FILE", help="Passphrase file of the source.")
@click.option("--from-password-command", envvar="OGREFS_FROM_PASSWORD_COMMAND",
              help="Command printing the source's passphrase.")
@click.option("--from-key-file", envvar="OGREFS_FROM_KEY_FILE", help="Raw key file of the source.")
@json_option
@click.pass_obj
@filter_options
def copy_cmd(obj: Context, snaps, from_repo, from_s3_endpoint, from_password_file, from_password_command,
             from_key_file, as_json: bool, filters) -> None:
    """Copy SNAPS (default: all) from --from-repo into this repository.

    Chunks the destination already holds are not sent again; snapshots keep
    their ids, so copying twice copies nothing the second time. Either side
    may be encrypted (the source's passphrase: --from-password-file,
    --from-password-command or OGREFS_FROM_PASSWORD).
    """
    from ogrefs.cli.progress import WorkLine
    from ogrefs.maint.copy import copy_snapshots
    from ogrefs.repo import Repository

    source = Context(from_repo, from_s3_endpoint or obj.s3_endpoint, obj.quiet, from_password_file, from_key_file,
                     from_password_command)
    src = Repository.open(from_repo, s3_endpoint=source.s3_endpoint, secret_source=lambda: _source_secret(source))
    dst = obj.open()
    if src.config.id == dst.config.id:
        raise UsageError("source and destination are the same repository")
    quiet = as_json or obj.quiet
    manifests = pick_all(src, snaps, filters, quiet)
    meter = WorkLine("source packs read", enabled=not quiet)
    try:
        report = copy_snapshots(src, dst, manifests, log=None if quiet else lambda s: click.echo(s, err=True),
                                meter=meter)
    finally:
        meter.done()
    if as_json:
        emit_json(report.as_dict())
        return
    for sid in report.skipped:
        click.echo(f"snapshot {sid[:12]} is already in the destination")
    for sid, why in report.repaired.items():
        click.echo(f"snapshot {sid[:12]} was in the destination but could not be restored there ({why}): "
                   "copied again")
    click.echo(f"copied {len(report.copied)} snapshots: {report.chunks_sent} chunks sent "
               f"({human_bytes(report.bytes_sent)}), {report.chunks_present} already there")


def _source_secret(source: Context):
    from ogrefs.repo.keys import Secret

    if not (source.password_file or source.key_file or source.password_command) and os.environ.get(
            "OGREFS_FROM_PASSWORD"):
        return Secret(os.environ["OGREFS_FROM_PASSWORD"].encode(), "scrypt")
    if not (source.password_file or source.key_file or source.password_command):
        raise UsageError("the source repository is encrypted: give --from-password-file, --from-password-command, "
                         "--from-key-file or OGREFS_FROM_PASSWORD")
    return source.secret(prompt=False)


@click.command(name="tag")
@click.argument("snaps", nargs=-1, required=True)
@click.option("--add", "add", multiple=True, help="Add this tag (repeatable).")
@click.option("--remove", "remove", multiple=True, help="Remove this tag (repeatable).")
@click.option("--set", "set_", multiple=True, help="Replace all tags by these (repeatable; --set '' clears).")
@json_option
@click.pass_obj
@filter_options
def tag_cmd(obj: Context, snaps, add, remove, set_, as_json: bool, filters) -> None:
    """Change the tags of SNAPS. As restic, a changed snapshot gets a new id (the old one is in 'original')."""
    from ogrefs.maint.browse import retag

    if not (add or remove or set_):
        raise UsageError("nothing to change: give --add, --remove or --set")
    if set_ and (add or remove):
        raise UsageError("--set replaces every tag: it does not combine with --add or --remove")
    repo = obj.open()
    changed = []
    for m in pick_all(repo, snaps, filters, as_json or obj.quiet):
        old = list(m.get("tags", []))
        new = [t for t in set_ if t] if set_ else [t for t in old if t not in remove] + \
            [t for t in add if t not in old]
        if new == old:
            continue
        moved = retag(repo, m, new)
        changed.append({"old": m["id"], "new": moved["id"], "tags": new})
        if not as_json:
            click.echo(f"snapshot {m['id'][:12]} -> {moved['id'][:12]}: tags {', '.join(new) or '(none)'}")
    if as_json:
        emit_json({"changed": changed})
    elif not changed:
        click.echo("no snapshot changed")


def register(group: click.Group) -> None:
    for cmd in (ls_cmd, find_cmd, dump_cmd, stats_cmd, cat_cmd, copy_cmd, tag_cmd):
        group.add_command(cmd)
