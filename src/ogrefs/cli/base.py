"""What every ``ogrefs`` command shares: the global options, ``--json``, and errors.

* Global options (``--repo``, ``--quiet``, ``--json``, the password options, ...)
  are accepted before the subcommand and after it (``ogrefs snapshots -r URL``),
  as restic's are: :func:`add_global_options` appends them to every command of
  the tree, and their callbacks write into the one :class:`Context`.
* :func:`run_main` turns every error a user can cause into one line on stderr
  (a JSON object under ``--json``) and an exit code from :mod:`ogrefs.errors`.
* Commands whose output *is* content (``run``, ``shell``, ``dump``, ``cat blob``,
  ``cat catalog``, ``help``) refuse ``--json`` (:func:`refuse_json`): JSON on
  stdout is a promise they cannot keep, and silence about it would be worse.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Callable

import click

from ogrefs.errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_LOCKED,
    EXIT_NO_REPOSITORY,
    EXIT_PARTIAL,
    EXIT_USAGE,
    EXIT_WRONG_PASSWORD,
    OgrefsError,
    UsageError,
)
from ogrefs.store.base import InvalidStoreURL, StoreError

EXIT_CODES_HELP = (
    "Exit codes: 0 success; 1 failure; 2 wrong usage (options, arguments, repository URL); "
    f"{EXIT_PARTIAL} partial (some files unreadable or not restored); {EXIT_NO_REPOSITORY} no repository at the URL; "
    f"{EXIT_LOCKED} the repository is locked by another process; {EXIT_WRONG_PASSWORD} wrong passphrase or key "
    f"file; {EXIT_INTERRUPTED} interrupted. Man page: ogrefs help --man. Shell completion: "
    "eval \"$(_OGREFS_COMPLETE=bash_source ogrefs)\" (zsh_source, fish_source)."
)

ENVIRONMENT_HELP = (
    "Environment: OGREFS_REPO, OGREFS_S3_ENDPOINT, OGREFS_PASSWORD, OGREFS_PASSWORD_FILE, "
    "OGREFS_PASSWORD_COMMAND, OGREFS_KEY_FILE (the global options); OGREFS_BOX (the box this one is: "
    "`latest` is its newest); OGREFS_CACHE_DIR (manifests, catalogs, the index and the mounts' chunk cache; "
    "default $XDG_CACHE_HOME/ogrefs, else ~/.cache/ogrefs); OGREFS_STATE_DIR (what writable mounts keep: "
    "their writes and local copies; default /var/lib/ogrefs/mounts); OGREFS_RUNTIME_DIR (the record of live "
    "mounts; default /run/ogrefs, else $XDG_RUNTIME_DIR/ogrefs); OGREFS_RUN_DIR (what run and shell write; "
    "default /var/lib/ogrefs/run); OGREFS_SHELL (the shell of `ogrefs shell`)."
)


class Context:
    """The global options of one invocation (set before or after the subcommand)."""

    def __init__(self, repo_url: str | None = None, s3_endpoint: str | None = None, quiet: bool = False,
                 password_file: str | None = None, key_file: str | None = None,
                 password_command: str | None = None, as_json: bool = False) -> None:
        self.repo_url = repo_url
        self.s3_endpoint = s3_endpoint
        self.quiet = quiet
        self.password_file = password_file
        self.key_file = key_file
        self.password_command = password_command
        self.as_json = as_json

    def has_secret_source(self) -> bool:
        return bool(self.key_file or self.password_file or self.password_command or os.environ.get("OGREFS_PASSWORD"))

    def secret(self, prompt: bool = True):
        from ogrefs.repo.keys import Secret

        if self.password_command and not (self.key_file or self.password_file):
            return Secret(run_password_command(self.password_command), "scrypt")
        return Secret.from_sources(self.password_file, self.key_file, _ask_passphrase if prompt else None)

    def url(self) -> str:
        if not self.repo_url:
            raise UsageError("no repository given: use --repo URL or set OGREFS_REPO")
        return self.repo_url

    def open(self, retry_for: float | None = None, sleep: Callable[[float], None] | None = None):
        """The repository; ``retry_for``: seconds each store call may keep retrying an outage (None: a few
        tries); ``sleep``: the retry wait (one that a stop request ends)."""
        from ogrefs.repo import Repository
        from ogrefs.repo.keys import secret_configured
        from ogrefs.store import open_store

        store = open_store(self.url(), s3_endpoint=self.s3_endpoint, retry_for=retry_for, sleep=sleep,
                           on_retry=None if (self.quiet or self.as_json) else retry_line)
        # a passphrase given means "encrypted": a plaintext config is then refused (issue 14.2)
        return Repository.open(self.url(), s3_endpoint=self.s3_endpoint, secret_source=self.secret, store=store,
                               expect_encrypted=self.has_secret_source()
                               or secret_configured(self.password_file, self.key_file))


def retry_line(note) -> None:
    """One line on stderr per retry of a store call (as restic prints them): the error and what is left."""
    left = (f"{note.seconds_left:.0f} s left of --retry-for" if note.seconds_left is not None
            else f"{note.attempts_left} attempts left")
    click.echo(f"{note.what} failed: {note.error}; retry {note.attempt} in {note.wait:.1f} s ({left})", err=True)


def _ask_passphrase() -> str:
    return click.prompt("repository passphrase", hide_input=True)


def run_password_command(command: str) -> bytes:
    """The passphrase is the first line a shell command prints (restic's --password-command)."""
    try:
        proc = subprocess.run(["/bin/sh", "-c", command], capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise UsageError(f"password command {command!r} did not finish within 120 s") from None
    if proc.returncode != 0:
        why = proc.stderr.decode(errors="replace").strip().splitlines()
        raise UsageError(f"password command {command!r} failed (exit {proc.returncode})"
                         + (f": {why[-1]}" if why else ""))
    value = proc.stdout.split(b"\n", 1)[0].rstrip(b"\r")
    if not value:
        raise UsageError(f"password command {command!r} printed no passphrase")
    return value


def local_time(when: float | str) -> str:
    """A time for people: local time with its zone (``2026-12-01 11:32:05 CET``); manifests keep UTC ISO."""
    from datetime import datetime

    t = datetime.fromisoformat(when) if isinstance(when, str) else datetime.fromtimestamp(when).astimezone()
    return t.astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def _json_callback(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    obj = ctx.find_object(Context)
    if obj is None:
        return value
    if value:
        obj.as_json = True
    return obj.as_json


def refuse_json(obj: Context | None, command: str, prints: str) -> None:
    """A usage error when --json was given (here or before the subcommand) to a command that prints content."""
    if obj is not None and obj.as_json:
        raise UsageError(f"{command} prints {prints}, not JSON: run it without --json")


def json_refused_option(f: Callable) -> Callable:
    """``--json`` on a content command: accepted by the parser so that the refusal is one clear line."""
    return click.option("--json", is_flag=True, expose_value=False, callback=_json_callback,
                        help="Refused: this command prints content, not JSON (exit 2).")(f)


def json_option(f: Callable) -> Callable:
    """``--json`` on a command: true when given here or before the subcommand."""
    return click.option("--json", "as_json", is_flag=True, callback=_json_callback,
                        help="Machine-readable output (errors too, as a JSON object on stderr).")(f)


#: (attribute, option names, is a flag, environment variable, help)
GLOBAL_OPTIONS: list[tuple[str, tuple[str, ...], bool, str | None, str]] = [
    ("repo_url", ("--repo", "-r"), False, "OGREFS_REPO",
     "Repository URL: a directory, file:///path or s3://bucket/prefix."),
    ("s3_endpoint", ("--s3-endpoint",), False, "OGREFS_S3_ENDPOINT",
     "Endpoint of an S3-compatible server (http:// or https:// URL)."),
    ("quiet", ("--quiet", "-q"), True, None, "No progress display."),
    ("as_json", ("--json",), True, None, "Machine-readable output; errors as a JSON object on stderr."),
    ("password_file", ("--password-file",), False, "OGREFS_PASSWORD_FILE", "File holding the repository passphrase."),
    ("password_command", ("--password-command",), False, "OGREFS_PASSWORD_COMMAND",
     "Shell command that prints the repository passphrase."),
    ("key_file", ("--key-file",), False, "OGREFS_KEY_FILE",
     "Raw key file (>= 32 random bytes) instead of a passphrase."),
]


def group_options(f: Callable) -> Callable:
    """The global options on the top-level group (with their environment variables)."""
    for attr, names, flag, env, text in reversed(GLOBAL_OPTIONS):
        f = click.option(*names, attr, is_flag=flag, envvar=env, help=text + (f" [env {env}]" if env else ""))(f)
    return f


def _late_callback(attr: str) -> Callable:
    def store(ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        obj = ctx.find_object(Context)
        if obj is not None and value not in (None, False):
            setattr(obj, attr, value)
        return value

    return store


def add_global_options(command: click.Command) -> None:
    """Append the global options to ``command`` and every command below it (names it has are left alone)."""
    taken = {n for p in command.params for n in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])}
    for attr, names, flag, _env, text in GLOBAL_OPTIONS:
        free = [n for n in names if n not in taken]
        if free and free[0].startswith("--"):
            command.params.append(click.Option(free, is_flag=flag, expose_value=False, callback=_late_callback(attr),
                                               help=f"{text} (global option)"))
    for sub in getattr(command, "commands", {}).values():
        add_global_options(sub)


def _wants_json(argv: list[str]) -> bool:
    args = argv[: argv.index("--")] if "--" in argv else argv
    return "--json" in args


def fail(message: str, code: int, as_json: bool) -> None:
    """One line on stderr (a JSON object under --json, as restic's exit_error) and the exit code."""
    if as_json:
        click.echo(json.dumps({"message_type": "exit_error", "code": code, "message": message}), err=True)
    else:
        click.echo(f"ogrefs: {message}", err=True)
    sys.exit(code)


def _click_message(exc: click.ClickException) -> str:
    ctx = getattr(exc, "ctx", None)
    where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    return exc.format_message().replace("\n", " ") + where


def run_main(group: click.Group, argv: list[str] | None) -> None:
    """Run the CLI; expected failures become one line and an exit code (see EXIT_CODES_HELP)."""
    args = list(sys.argv[1:] if argv is None else argv)
    as_json = _wants_json(args)
    try:
        group.main(args=args, prog_name="ogrefs", standalone_mode=False)
    except click.exceptions.Abort:
        fail("interrupted", EXIT_INTERRUPTED, as_json)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        if type(exc).__name__ == "NoArgsIsHelpError" and not as_json:  # `ogrefs` alone: its help, as click shows it
            click.echo(exc.format_message(), err=True)
            sys.exit(exc.exit_code)
        fail(_click_message(exc), exc.exit_code, as_json)
    except OgrefsError as exc:
        fail(str(exc), exc.exit_code, as_json)
    except InvalidStoreURL as exc:
        fail(str(exc), EXIT_USAGE, as_json)
    except StoreError as exc:
        fail(str(exc), EXIT_FAILED, as_json)
    except KeyboardInterrupt:
        fail("interrupted; the repository is unchanged apart from reusable packs", EXIT_INTERRUPTED, as_json)
    except PermissionError as exc:
        fail(f"permission denied: {exc.filename or exc}", EXIT_FAILED, as_json)
    except OSError as exc:
        fail(f"{os.fsdecode(exc.filename) + ': ' if exc.filename else ''}{exc.strerror or exc}", EXIT_FAILED, as_json)
