"""``ogrefs agent`` (keep this box protected, in the foreground) and ``ogrefs agent status``.

The work is in :mod:`ogrefs.agent`; errors are OgrefsError subclasses, which
``cli.main`` turns into one line on stderr.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import click

from ogrefs.cli.base import Context, emit_json, json_option
from ogrefs.errors import UsageError


def _line(ev: dict) -> str | None:
    """One line per snapshot (and per notice or failure) for people; None for the rest."""
    kind = ev["event"]
    if kind == "snapshot":
        why = ", ".join(ev["reasons"])
        if ev.get("checkpoint"):
            ck = ev["checkpoint"]
            why += f" {ck['run']} step {ck['step']}" if ck.get("step") is not None else f" {ck['path']}"
        text = (f"snapshot {ev['id'][:12]} saved ({why}): {ev['files']} files, {ev['read_bytes']} bytes read, "
                f"{ev['new_stored_bytes']} bytes new, {ev['seconds']:.1f} s")
        if "after_notice_s" in ev:
            text += f"; {ev['after_notice_s']:.1f} s after the {ev['notice']['provider']} notice"
            if "before_deadline_s" in ev:
                text += f", {ev['before_deadline_s']:.1f} s before its deadline"
        if ev.get("forgotten"):
            text += f"; forgot {len(ev['forgotten'])} old snapshots"
        return text
    if kind == "notice" and ev.get("doubt"):
        return f"odd answer from the {ev['provider']} metadata service ({ev['doubt']}): snapshotting in case it is a notice"
    if kind == "notice":
        dl = ev.get("deadline")
        when = datetime.fromtimestamp(dl, timezone.utc).isoformat(timespec="seconds") if dl else "unknown"
        return f"preemption notice from {ev['provider']} ({ev['action']}), deadline {when}: snapshotting"
    if kind in ("error", "notice-error", "watch-error"):
        return f"error: {ev.get('provider', '')} {ev['error']}".replace("  ", " ")
    if kind == "started":
        return (f"agent for box {ev['box']} started (pid {ev['pid']}); watching {len(ev['watching'])} checkpoint "
                f"directories; notices: {', '.join(ev['notices']) or 'none'}")
    return None


@click.group(invoke_without_command=True)
@click.option("--path", "paths", multiple=True, type=click.Path(path_type=bytes), help="Snapshot this path (repeatable).")
@click.option("--whole-box", is_flag=True, help="Snapshot the whole box (as `snapshot --whole-box`).")
@click.option("--exclude", "excludes", multiple=True, help="Skip paths matching this glob (repeatable).")
@click.option("--box", envvar="OGREFS_BOX", default=None, help="The box the snapshots belong to.")
@click.option("--every", type=click.FloatRange(min=0.01), default=None, help="Minutes between snapshots.")
@click.option("--on-checkpoint/--no-on-checkpoint", default=True, show_default=True,
              help="Snapshot when a new coherent checkpoint is complete and quiet.")
@click.option("--watch", "watch_dirs", multiple=True, help="Also watch this checkpoint run directory.")
@click.option("--quiet-for", type=click.FloatRange(0), default=5.0, show_default=True,
              help="Seconds a new checkpoint's files must stay unchanged before it is judged.")
@click.option("--scan", type=click.FloatRange(0.05), default=2.0, show_default=True,
              help="Seconds between scans of the checkpoint directories.")
@click.option("--preemption", "providers", multiple=True, type=click.Choice(["aws", "gcp", "azure"]),
              help="Watch this provider's preemption notices (repeatable).")
@click.option("--metadata-endpoint", default=None,
              help="Base URL of the metadata service (default: the provider's own address).")
@click.option("--poll", type=click.FloatRange(0.05), default=2.0, show_default=True,
              help="Seconds between polls of the metadata service.")
@click.option("--keep-last", type=click.IntRange(0), default=0, help="Retention: keep the N newest snapshots.")
@click.option("--keep-hourly", type=click.IntRange(0), default=0)
@click.option("--keep-daily", type=click.IntRange(0), default=0)
@click.option("--keep-weekly", type=click.IntRange(0), default=0)
@click.option("--keep-monthly", type=click.IntRange(0), default=0)
@click.option("--keep-tag", "keep_tags", multiple=True)
@click.option("--no-initial", is_flag=True, help="Do not snapshot at start.")
@click.option("--status-file", type=click.Path(path_type=Path), default=None,
              help="Where `ogrefs agent status` reads the agent's state (default: <runtime dir>/agent.json).")
@json_option
@click.pass_context
def agent(ctx: click.Context, paths, whole_box, excludes, box, every, on_checkpoint, watch_dirs, quiet_for, scan,
          providers, metadata_endpoint, poll, keep_last, keep_hourly, keep_daily, keep_weekly, keep_monthly,
          keep_tags, no_initial, status_file, as_json) -> None:
    """Keep this box protected: snapshots every N minutes, on each new checkpoint, on a preemption notice
    and on SIGTERM; one at a time, in the foreground.

    On SIGTERM or Ctrl-C a running snapshot finishes, one more saves what
    changed meanwhile, and the agent exits 0 (1 if no snapshot succeeded).
    """
    if ctx.invoked_subcommand is not None:
        return
    from ogrefs.agent.loop import Agent, AgentOptions
    from ogrefs.agent.notices import SOURCES
    from ogrefs.maint.forget import Policy

    if whole_box and paths:
        raise UsageError("--whole-box snapshots / and takes no --path")
    if not whole_box and not paths:
        raise UsageError("nothing to protect: give --path PATH (repeatable) or --whole-box")
    if metadata_endpoint and len(providers) != 1:
        raise UsageError("--metadata-endpoint needs exactly one --preemption provider")
    obj: Context = ctx.obj
    repo = obj.open()
    opts = AgentOptions(paths=list(paths) or [b"/"], whole_box=whole_box, excludes=list(excludes), box=box,
                        every_s=every * 60 if every else None, on_checkpoint=on_checkpoint,
                        watch_dirs=list(watch_dirs), quiet_s=quiet_for, scan_s=scan, poll_s=poll,
                        notices=[SOURCES[p](metadata_endpoint) for p in providers],
                        policy=Policy(keep_last, keep_hourly, keep_daily, keep_weekly, keep_monthly, list(keep_tags)),
                        initial=not no_initial, status_path=status_file)

    def emit(ev: dict) -> None:
        if as_json:
            click.echo(json.dumps({"time": time.time(), **ev}, sort_keys=True, default=str))
        else:
            text = _line(ev)
            if text:
                click.echo(text, err=ev["event"].endswith("error"))
        sys.stdout.flush()

    sys.exit(Agent(repo, opts, emit).run())


@agent.command(name="status")
@click.option("--status-file", type=click.Path(path_type=Path), default=None)
@json_option
def agent_status(status_file, as_json) -> None:
    """What the agent has done: its last snapshot, what it runs now, errors."""
    from ogrefs.agent.loop import read_status

    st = read_status(status_file)
    if as_json:
        emit_json(st)
        return
    state = "running" if st["alive"] else "not running"
    click.echo(f"agent for box {st.get('box')}: {state} (pid {st.get('pid')}), {st.get('snapshots', 0)} snapshots")
    if st.get("running"):
        click.echo(f"  snapshotting now ({', '.join(st['running']['reasons'])}), "
                   f"for {time.time() - st['running']['since']:.0f} s")
    last = st.get("last")
    if last:
        when = datetime.fromtimestamp(last["time"], timezone.utc).isoformat(timespec="seconds")
        click.echo(f"  last snapshot {last['id'][:12]} at {when} ({', '.join(last['reasons'])}, {last['seconds']:.1f} s)")
    if st.get("last_error"):
        click.echo(f"  last error: {st['last_error']['error']}")
    if not st["alive"]:
        sys.exit(1)


def register(group: click.Group) -> None:
    group.add_command(agent)
