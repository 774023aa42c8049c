"""``ogrefs mount``, ``ogrefs unmount`` and ``ogrefs status``.

Registered on the main group by :func:`register`; the work is in
:mod:`ogrefs.mount.client` (status: :mod:`ogrefs.mount.status`).  Errors are OgrefsError subclasses, which ``cli.main``
turns into one line on stderr.  Each command imports its work when it runs,
on purpose: every other command (and ``--help``) starts without the mount
machinery, the repository layer or pyfuse3.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import click

from ogrefs.cli.base import emit_json, json_option
from ogrefs.cli.run import register as register_run
from ogrefs.cli.select import filter_options, pick
from ogrefs.box.records import MountError
from ogrefs.errors import UsageError
from ogrefs.units import human_bytes as _human

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``10G``, ``512MiB``, ``1048576`` -> bytes (powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"{text!r} is not a size (examples: 10G, 512M, 1048576)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))


@click.command()
@click.argument("snap")
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("--read-only", "read_only", is_flag=True,
              help="Browse: a read-only FUSE mount. Without it, writes land on local disk (overlayfs).")
@click.option("--state-dir", type=click.Path(path_type=Path), default=None,
              help="Upper dirs, local copy and fetch state of a writable mount "
                   "(default /var/lib/ogrefs/mounts/<snapshot>-<target>); the same dir resumes.")
@click.option("--force", is_flag=True, help="Allow covering /proc, /sys, /dev, /run, /boot or / as a whole.")
@click.option("--strict", is_flag=True, help="Refuse when this box cannot run the snapshot as it ran.")
@click.option("--merge", "merge", is_flag=True,
              help="At /: show this box's files where the snapshot has none in its own directories too (a "
                   "snapshot of data paths; a whole box's project, runs, venvs). Without it they are exact "
                   "(docs/mount.md).")
@click.option("--data-only", "data_only", is_flag=True,
              help="At /: bring back the snapshot's data paths (/home, /root, /opt, /srv, ...) and leave this box's "
                   "system (/usr, /etc, /var, /bin, /lib*, /boot) alone: how a snapshot of another OS release "
                   "comes back (its programs: `ogrefs run`/`shell`).")
@click.option("--encrypt-cache", is_flag=True,
              help="Encrypted repositories: keep the local chunk cache encrypted too (AES-256-GCM).")
@click.option("--no-materialize", is_flag=True,
              help="Writable mounts: do not copy everything to local disk in the background (lazy only).")
@click.option("--no-passthrough", is_flag=True,
              help="Writable mounts: the daemon serves every read, also of files already copied to local disk "
                   "(default: the kernel reads those itself where it can, Linux 6.9+; docs/mount.md).")
@click.option("--save-trace/--no-save-trace", default=None,
              help="Record which chunks are read in the first minutes and store the trace for the next mount "
                   "(default: on for writable mounts).")
@click.option("--replay-trace/--no-replay-trace", default=True, show_default=True,
              help="Prefetch in the order of the recorded access trace of this snapshot's paths, if there is one "
                   "(off: hints only, e.g. when the workload has changed).")
@click.option("--host-path", "host_path", multiple=True, metavar="[KIND:]PATH",
              help="Mounting at /: also keep PATH (a glob) from this box; KIND is host, prefer-host, accounts "
                   "or merge (docs/mount.md). Repeatable.")
@click.option("--no-host-path", "no_host_path", multiple=True, metavar="PATH",
              help="Mounting at /: take PATH from the snapshot after all (drops a default rule). Repeatable.")
@click.option("--no-host-paths", is_flag=True,
              help="Mounting at /: keep nothing of this box; the snapshot covers identity, network, logins, driver.")
@click.option("--host-paths-file", multiple=True, type=click.Path(dir_okay=False),
              help="More host-path rules, one `[KIND] /pattern` or `-/pattern` a line (besides /etc/ogrefs/host-paths).")
@click.option("--prefetch/--no-prefetch", default=None,
              help="Fetch the prefetch hints (venv, newest checkpoint) and the trace in the background "
                   "(default: on for writable mounts; a read-only mount fetches only what is read).")
@click.option("--no-fuse", "no_fuse", is_flag=True,
              help="Write the snapshot into place at its original paths instead of mounting it (automatic where "
                   "FUSE or mounting is not allowed: RunPod, vast.ai; docs/mount.md).")
@click.option("--foreground", "-f", is_flag=True, help="Stay attached; Ctrl-C unmounts.")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              help="Local chunk cache (default: <XDG cache>/ogrefs/chunks), shared by mounts.")
@click.option("--cache-size", default=None,
              help="Bound of the chunk cache, e.g. 20G (default: 10G or 1/4 of free space).")
@click.option("--allow-other", is_flag=True, help="Let other users see the mount (needs user_allow_other).")
@click.option("--retry-for", type=click.FloatRange(0, 86400), default=60.0, show_default=True,
              help="Seconds to keep retrying an unreachable store before a read fails with EIO.")
@click.option("--max-requests", type=click.IntRange(3, 256), default=8, show_default=True,
              help="Concurrent store requests.")
@click.option("--debug", is_flag=True, help="Verbose log.")
@json_option
@click.pass_obj
@filter_options
def mount(obj, snap: str, mountpoint: Path, read_only: bool, state_dir: Path | None, force: bool, strict: bool,
          merge: bool, data_only: bool, encrypt_cache: bool, no_materialize: bool, no_passthrough: bool, save_trace: bool | None, replay_trace: bool, foreground: bool, cache_dir: Path | None, cache_size: str | None, allow_other: bool, retry_for: float,
          max_requests: int, debug: bool, as_json: bool, host_path: tuple = (), no_host_path: tuple = (),
          no_host_paths: bool = False, host_paths_file: tuple = (), prefetch: bool | None = None,
          no_fuse: bool = False, filters=None) -> None:
    """Mount snapshot SNAP at MOUNTPOINT; file data is fetched when read.

    At / (``ogrefs mount SNAP /``) every root path of the snapshot appears at
    its original place; at any other directory the snapshot's tree appears
    below it. Without --read-only, writes land on local disk.

    MOUNTPOINT must exist: neither kind of mount creates it. Neither hides
    what is there: a writable mount keeps a non-empty target's content
    visible below the snapshot's (overlayfs); a read-only mount cannot merge,
    so it refuses a non-empty MOUNTPOINT. A read-only mount fetches only what
    is read (--prefetch to warm the cache from the hints and the trace).
    `ogrefs mounts` lists mounts and the state they leave.
    """
    from ogrefs.inspect.compat import environment_warning
    from ogrefs.mount.client import mount as do_mount
    from ogrefs.box.hostpaths import load_rules
    from ogrefs.mount.options import MountOptions

    if data_only and (read_only or os.path.normpath(os.path.abspath(mountpoint)) != "/"):
        raise UsageError("--data-only is for a writable mount at / (it leaves this box's /usr, /etc, /var ... alone)")
    in_place = not read_only and _in_place(no_fuse, as_json or getattr(obj, "quiet", False))
    rules = None if read_only else tuple(load_rules(defaults=not no_host_paths, files=host_paths_file,
                                                    add=host_path, drop=no_host_path))
    opts = MountOptions(repo_url=obj.url(), snapshot=snap, mountpoint=mountpoint, s3_endpoint=obj.s3_endpoint,
                        chunk_cache=cache_dir, cache_size=parse_size(cache_size) if cache_size else None,
                        foreground=foreground, allow_other=allow_other, retry_for=retry_for,
                        max_requests=max_requests, log_level="DEBUG" if debug else "INFO",
                        read_only=read_only, state_dir=state_dir, force=force, materialize=not no_materialize,
                        passthrough=not no_passthrough,
                        save_trace=save_trace, replay_trace=replay_trace, encrypt_cache=encrypt_cache,
                        prefetch=prefetch, host_rules=rules, no_fuse=in_place, data_only=data_only,
                        merge_host=merge)

    def resolve(repo):
        manifest = pick(repo, snap, filters, as_json or obj.quiet)  # `latest`: this box's; named by id from here
        warning = environment_warning(manifest, strict)
        if warning:
            click.echo(f"warning: {warning}", err=True)
        return manifest

    # the mount's start, and the daemon's calls besides pack reads, within --retry-for too (store/deadline.py)
    plan = do_mount(opts, open_repo=lambda: obj.open(retry_for=retry_for), resolve=resolve)
    if foreground:
        return
    if in_place:
        _report_in_place(plan, snap, as_json or getattr(obj, "quiet", False), as_json)
        return
    info = plan.registration.read() or {}  # what the daemon and the keeper recorded of this mount
    if as_json:
        emit_json({"snapshot": plan.snapshot_id, "selector": snap, "target": str(plan.target), "read_only": read_only,
                   "state_dir": None if read_only else str(plan.state_dir), "trace_notes": info.get("trace_notes", [])})
    elif not getattr(obj, "quiet", False):
        mode = "read-only" if read_only else f"writable, local state in {plan.state_dir}"
        named = plan.snapshot_id[:12] + (f" ({snap})" if not plan.snapshot_id.startswith(snap.lower()) else "")
        click.echo(f"mounted {named} at {plan.target} ({mode})")
        if not read_only:
            from ogrefs.mount.keeper import describe
            from ogrefs.mount.status import exact_line

            for line in (describe(info), exact_line(info)):
                if line:
                    click.echo(line)
        for note in info.get("trace_notes") or []:
            click.echo(note)


def _in_place(forced: bool, quiet: bool) -> bool:
    """Whether this writable mount writes the snapshot into place; where it falls back by itself, one line why."""
    if forced:
        return True
    from ogrefs.mount.inplace import why_no_fuse

    why = why_no_fuse()
    if why and not quiet:
        click.echo(f"{why}: writing the snapshot into place at its original paths instead (no-FUSE mode)", err=True)
    return why is not None


def _report_in_place(plan, snap: str, quiet: bool, as_json: bool) -> None:
    """What a no-FUSE mount did by the time its working set was in place."""
    from ogrefs.mount.status import read_status

    try:
        m = read_status(plan.target).get("materialize") or {}
    except (MountError, UsageError):
        m = {}
    if as_json:
        emit_json({"snapshot": plan.snapshot_id, "selector": snap, "target": str(plan.target), "mode": "in-place",
                   "state_dir": str(plan.state_dir), "files_done": m.get("files_done"),
                   "files_total": m.get("files_total"), "kept_bytes": m.get("kept_bytes"),
                   "fetched_bytes": m.get("fetched_bytes"), "trace_notes": list(plan.trace_notes)})
        return
    if quiet:
        return
    named = plan.snapshot_id[:12] + (f" ({snap})" if not plan.snapshot_id.startswith(snap.lower()) else "")
    click.echo(f"{named} is in place at {plan.target} for its working set (no-FUSE mode, plan in {plan.state_dir}): "
               f"{m.get('files_done', 0)} of {m.get('files_total', 0)} files, {_human(m.get('kept_bytes', 0))} kept "
               f"from this box, {_human(m.get('fetched_bytes', 0))} fetched; the rest follows in the background "
               f"(`ogrefs status {plan.target} --wait`)")
    for note in plan.trace_notes:
        click.echo(note)


@click.command()
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("--lazy", is_flag=True,
              help="Detach now even if busy (a whole box whose own shells run from the overlays): the box shows its "
                   "own tree at once; the daemon serves what is still open and exits when the last user leaves.")
@click.option("--timeout", type=click.FloatRange(0, 3600), default=30.0, show_default=True,
              help="Seconds to wait for the daemon to exit.")
@click.option("--if-mounted", "if_mounted", is_flag=True,
              help="Nothing of ogrefs' at MOUNTPOINT is not an error: say so and exit 0 (the boot unit's stop).")
@json_option
def unmount(mountpoint: Path, lazy: bool, timeout: float, as_json: bool, if_mounted: bool = False) -> None:
    """Unmount an ogrefs mount and wait for its daemon to exit.

    Only what ogrefs mounted is touched: anything else at MOUNTPOINT (the
    box's own root, a disk) stays, with one line saying so and exit 2.
    """
    from ogrefs.mount.client import NotMounted, unmount as do_unmount

    try:
        note = do_unmount(mountpoint, lazy=lazy, timeout=timeout)
    except NotMounted as exc:
        if not if_mounted:
            raise
        if as_json:
            emit_json({"unmounted": None, "lazy": lazy, "reason": str(exc)})
        else:
            click.echo(str(exc), err=True)
        return
    if as_json:
        emit_json({"unmounted": str(mountpoint), "lazy": lazy, "daemon_exited": note is None})
    elif note:
        click.echo(note, err=True)


@click.command()
@click.argument("mountpoint", type=click.Path(path_type=Path))
@json_option
@click.option("--wait", is_flag=True,
              help="Wait until the background copy is complete (exit 0) or cannot complete (exit 1), "
                   "then report.")
@click.option("--timeout", type=click.FloatRange(0), default=None,
              help="With --wait: give up (exit 1) after this many seconds.")
def status(mountpoint: Path, as_json: bool, wait: bool, timeout: float | None) -> None:
    """What a mount has fetched, served and failed."""
    from ogrefs.mount.status import read_status, wait_background

    if wait:
        st, problem = wait_background(mountpoint, timeout=timeout,
                                      progress=None if as_json or not sys.stderr.isatty() else _progress_line)
    else:
        st, problem = read_status(mountpoint), None
    if wait and not as_json and sys.stderr.isatty():
        sys.stderr.write("\n")
    _report(st, as_json)
    if problem:
        raise MountError(problem)


def _progress_line(st: dict) -> None:
    m = st.get("materialize") or {}
    state = f" ({m.get('state', '?')})" if m.get("bytes_total") else ""
    sys.stderr.write(f"\r{_counted(m, _bar(m.get('bytes_done', 0), m.get('bytes_total', 0)))}{state}\x1b[K")
    sys.stderr.flush()


def _report(st: dict, as_json: bool) -> None:
    from ogrefs.mount.status import exact_line

    if as_json:
        click.echo(json.dumps(st, indent=2, sort_keys=True))
        return
    if st.get("in_place"):
        click.echo("\n".join(_in_place_lines(st, sys.stdout.isatty())))
        return
    if st.get("finalized"):
        click.echo(f"ogrefs mount of snapshot {st['snapshot'][:12]} at {st['mountpoint']}: finalized, "
                   f"runs from local disk ({st['state_dir']}/tree) with no daemon")
        return
    up = st["time"] - st["started"]
    lines = [
        f"ogrefs mount of snapshot {st['snapshot'][:12]} at {st['mountpoint']} (pid {st['pid']}, up {up:.0f} s)",
        f"  read by applications  {_human(st['bytes_read'])} in {st['reads']} reads, {st['open_files']} files open",
        f"  fetched from store    {_human(st['bytes_fetched'])} in {st['requests']} requests"
        f" ({st['chunks_fetched']} chunks{_amplification(st)})",
        f"  chunk cache           {st['cache_hits']} hits ({st['cache_hits_memory']} memory,"
        f" {st['cache_hits_disk']} disk), {st['cache_misses']} misses",
        f"  in flight             {st['chunks_in_flight']} chunks, {st['chunks_queued']} queued",
        f"  errors                {st['errors']} ({st['read_errors']} failed reads, {st['corrupt']} corrupt chunks,"
        f" {st['retries']} retried requests)",
    ]
    if pt := st.get("passthrough"):  # complete local copies read by the kernel (docs/mount.md)
        lines.append(f"  passthrough           {pt['state']}" + (f": {pt['opens']} opens read by the kernel from"
                                                                 f" the local copy" if pt["state"] == "on" else "")
                     + ("; none while the access trace is recorded" if st.get("trace_recording")
                        and pt["state"] in ("on", "asked") else ""))
    lines.extend(f"  {note}" for note in st.get("trace_notes") or [])
    lines.extend(f"  {why}" for why in st.get("refused") or [])  # overlays left out: a user's symlink on the way
    lines.extend(f"  {line}" for line in [exact_line(st)] if line)
    lines.extend(_prefetch_lines(st.get("materialize") or {}, sys.stdout.isatty()))
    y = st.get("snapshot_yield") or {}
    if y.get("yielding"):
        lines.append("  a snapshot of the box is running: prefetch, cache writes and materialization wait for it")
    elif y.get("snapshots"):
        lines.append(f"  stepped aside for {y['snapshots']} snapshot(s) of the box, {y.get('yielded_s', 0):.1f} s in all")
    click.echo("\n".join(lines))


def _in_place_lines(st: dict, tty: bool) -> list[str]:
    """A no-FUSE mount: what is in place, kept, fetched, failed."""
    m = st.get("materialize") or {}
    who = f"pid {st['pid']}" if st.get("pid") else "no daemon"
    lines = [f"ogrefs no-FUSE copy of snapshot {st['snapshot'][:12]} at {st['mountpoint']} ({who}; "
             f"plan in {st.get('state_dir')})",
             f"  files in place        {m.get('files_done', 0)} of {m.get('files_total', 0)}",
             f"  kept from this box    {m.get('kept_files', 0)} files, {_human(m.get('kept_bytes', 0))} not fetched",
             f"  fetched from store    {_human(m.get('fetched_bytes', 0))}",
             f"  failed                {m.get('failed', 0)}" + (f" (first: {m['first_failure']})"
                                                                 if m.get("first_failure") else "")]
    return lines + _prefetch_lines(m, tty)


#: below this much read, fetched/read says nothing (one byte read fetches a whole chunk)
_AMPLIFICATION_MIN_READ = 16 << 20


def _amplification(st: dict) -> str:
    """``, 1.20 bytes fetched per byte read`` only where that means something: reads alone fetched (no prefetch
    or background copy fetching beside them) and enough was read; else nothing."""
    background = bool((st.get("materialize") or {}).get("bytes_total"))
    if background or st["bytes_read"] < _AMPLIFICATION_MIN_READ:
        return ", prefetch and background copy included" if background else ""
    return f", {st['bytes_fetched'] / st['bytes_read']:.2f} bytes fetched per byte read"


def _counted(m: dict, bar: str = "") -> str:
    """``12.0 MiB / 1.0 GiB at 30.0 MiB/s, ETA 0:33``; while nothing is counted yet, what the work is doing."""
    done, total = m.get("bytes_done", 0), m.get("bytes_total", 0)
    if not total and not m.get("complete"):
        state = m.get("state") or "starting"
        return "nothing to fetch" if state == "done" else f"{state}: nothing counted yet"
    eta = m.get("eta_s")
    eta_s = f", ETA {int(eta // 60)}:{int(eta % 60):02d}" if eta is not None else ""
    return f"{bar}{_human(done)} / {_human(total)} at {_human(m.get('rate_bps') or 0)}/s{eta_s}"


def _bar(done: int, total: int, width: int = 24) -> str:
    """A progress bar; an empty class (nothing to fetch) has none, rather than a full one."""
    if not total:
        return ""
    filled = int(width * done / total)
    return "[" + "#" * filled + "." * (width - filled) + "] "


def _prefetch_lines(m: dict, tty: bool) -> list[str]:
    """Per priority class: bytes done / total, and for the whole: rate and ETA (a bar on a terminal)."""
    if not m:
        return []
    what = {"materialize": "materialized to local disk", "in-place": "written in place"}.get(
        m.get("mode"), "prefetched into the cache")
    state = m.get("state", "?") + (f": {m['reason']}" if m.get("reason") else "")
    out = [f"  {what:27} {'complete' if m.get('complete') else state}"]
    for name, c in (m.get("classes") or {}).items():
        done, total = c.get("bytes_done", 0), c.get("bytes_total", 0)
        if not total:
            out.append(f"    {name:11}        -")
            continue
        bar = _bar(done, total) if tty else ""
        out.append(f"    {name:11}        {bar}{_human(done)} / {_human(total)}")
    bar = _bar(m.get("bytes_done", 0), m.get("bytes_total", 0)) if tty else ""
    out.append(f"    all                {_counted(m, bar)}")
    return out


@click.command()
@click.argument("mountpoint", type=click.Path(path_type=Path))
@json_option
def finalize(mountpoint: Path, as_json: bool) -> None:
    """Once everything is local, run MOUNTPOINT from local disk alone (no daemon, no store)."""
    from ogrefs.mount.client import finalize as do_finalize

    notes: list[str] = []
    targets = do_finalize(mountpoint, notes=notes)
    if as_json:
        emit_json({"finalized": str(mountpoint), "targets": list(targets), "daemon_exited": not notes})
        return
    click.echo(f"finalized {mountpoint}: {', '.join(targets)} now run from local disk; "
               + ("; ".join(notes) if notes else "the daemon has exited"))


def register(group: click.Group) -> None:
    for cmd in (mount, unmount, status, finalize):
        group.add_command(cmd)
    register_run(group)

