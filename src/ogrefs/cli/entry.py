"""The ``ogrefs`` command's entry point: start reading the code ahead (preload.py), then run the CLI.

It imports nothing heavy itself, so the read-ahead starts before click,
botocore, trio and pyfuse3 are imported (docs/benchmarks.md, "A mount's
start on a busy box").

It also raises the process's soft limit on open files to its hard limit
(:func:`raise_open_files_limit`): systemd starts services with a soft limit of
1024 and a hard one of 524288, and expects a program that needs more to raise
its own; a mount's daemon and its materializer (forked from this process,
so they inherit it), a restore and a snapshot keep many files open at once.
Under a unit the local copy stopped at 20-40 % with EMFILE (issue 47).
"""

from __future__ import annotations

import resource

from ogrefs.cli import preload

#: The most the soft limit is raised to: the kernel's default ``fs.nr_open`` (a hard limit of "unlimited"
#: cannot be a soft one).
OPEN_FILES_MAX = 1 << 20


def raise_open_files_limit() -> int:
    """The soft RLIMIT_NOFILE raised to the hard limit (at most :data:`OPEN_FILES_MAX`); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES_MAX if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_MAX)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return want
        except (ValueError, OSError):  # a hard limit above fs.nr_open: keep what there is
            pass
    return soft


def main(argv: list[str] | None = None) -> None:
    raise_open_files_limit()
    preload.start()
    from ogrefs.cli.app import main as run_cli

    run_cli(argv)
