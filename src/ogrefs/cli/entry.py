"""The ``ogrefs`` command's entry point: start reading the code ahead (preload.py), then run the CLI.

It imports nothing heavy itself, so the read-ahead starts before click,
botocore, trio and pyfuse3 are imported (docs/benchmarks.md, "A mount's
start on a busy box").
"""

from __future__ import annotations

from ogrefs.cli import preload


def main(argv: list[str] | None = None) -> None:
    preload.start()
    from ogrefs.cli.app import main as run_cli

    run_cli(argv)
