"""``ogrefs help [COMMAND...] [--man]``: a command's help, or the whole CLI as a man page (roff).

The man page is generated from the click commands themselves (names,
docstrings, options, the exit codes of the group's epilog), so it never
drifts from ``--help`` (the environment and exit codes are the group's epilog, both from cli/base.py). Shell completion is click's: ``_OGREFS_COMPLETE``.
"""

from __future__ import annotations

import datetime
import inspect

import click

from ogrefs.cli.base import ENVIRONMENT_HELP, EXIT_CODES_HELP, Context, json_refused_option, refuse_json
from ogrefs.errors import UsageError

COMPLETION_HELP = ("Shell completion: eval \"$(_OGREFS_COMPLETE=bash_source ogrefs)\" in ~/.bashrc "
                   "(zsh_source for ~/.zshrc, fish_source for fish).")


def _roff(text: str) -> str:
    lines = []
    for line in text.replace("\\", "\\\\").splitlines():
        lines.append(("\\&" + line) if line.startswith((".", "'")) else line)
    return "\n".join(lines).replace("-", "\\-")


def _commands(group: click.Group, prefix: str) -> list[tuple[str, click.Command]]:
    out = []
    for name in sorted(group.commands):
        cmd = group.commands[name]
        if cmd.hidden:
            continue
        out.append((f"{prefix} {name}", cmd))
        if isinstance(cmd, click.Group):
            out.extend(_commands(cmd, f"{prefix} {name}"))
    return out


def _options(ctx: click.Context, cmd: click.Command) -> list[str]:
    out = []
    for param in cmd.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None or "(global option)" in (record[1] or ""):
            continue
        out += [".TP", f"\\fB{_roff(record[0])}\\fR", _roff(record[1] or "")]
    return out


def render_man(group: click.Group) -> str:
    """The whole command line as a section-1 man page."""
    root = click.Context(group, info_name="ogrefs")
    date = datetime.date.today().isoformat()
    out = [f'.TH OGREFS 1 "{date}" "ogrefs" "User Commands"', ".SH NAME",
           "ogrefs \\- " + _roff(group.get_short_help_str(200)), ".SH SYNOPSIS",
           "\\fBogrefs\\fR [\\fIGLOBAL OPTIONS\\fR] \\fICOMMAND\\fR [\\fIARGS\\fR] [\\fIGLOBAL OPTIONS\\fR]",
           ".SH DESCRIPTION", _roff(inspect.cleandoc(group.help or "")), ".SH GLOBAL OPTIONS", *_options(root, group), ".SH COMMANDS"]
    for path, cmd in _commands(group, "ogrefs"):
        ctx = click.Context(cmd, info_name=path, parent=root)
        out += [".SS " + _roff(path), _roff(" ".join(cmd.collect_usage_pieces(ctx))), ".PP",
                _roff(inspect.cleandoc(cmd.help or cmd.short_help or "")), *_options(ctx, cmd)]
    out += [".SH ENVIRONMENT", _roff(ENVIRONMENT_HELP), ".SH EXIT STATUS", _roff(EXIT_CODES_HELP),
            ".SH SHELL COMPLETION", _roff(COMPLETION_HELP),
            ".SH SEE ALSO", "restic(1), borg(1)"]
    return "\n".join(out) + "\n"


@click.command(name="help")
@click.argument("words", nargs=-1)
@click.option("--man", is_flag=True, help="Print the man page of the whole command line (roff, for man -l).")
@json_refused_option
@click.pass_context
def help_cmd(ctx: click.Context, words: tuple[str, ...], man: bool) -> None:
    """Show the help of COMMAND (`ogrefs help key add`); with --man, the man page of every command."""
    refuse_json(ctx.find_object(Context), "help", "help text or a man page")
    group = ctx.find_root().command
    if man:
        click.echo(render_man(group), nl=False)
        return
    cmd, info = group, "ogrefs"
    parent = ctx.find_root()
    for word in words:
        sub = cmd.commands.get(word) if isinstance(cmd, click.Group) else None
        if sub is None:
            raise UsageError(f"no command {' '.join([info, word])!r} (see 'ogrefs --help')")
        info = f"{info} {word}"
        parent = click.Context(sub, info_name=word, parent=parent)
        cmd = sub
    click.echo(cmd.get_help(parent))


def register(group: click.Group) -> None:
    group.add_command(help_cmd)
