"""Errors a user can cause or meet, each carrying a one-line reason.

The CLI turns every ``OgrefsError`` (and every store error) into that line on
stderr and a non-zero exit; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

#: Exit codes, as restic numbers them where it has one (README and ``--help`` list them).
EXIT_OK = 0
EXIT_FAILED = 1            # the command failed (a problem found, a store error, ...)
EXIT_USAGE = 2             # wrong arguments or options
EXIT_PARTIAL = 3           # done, but some things were not (unreadable files, failed restores)
EXIT_NO_REPOSITORY = 10    # no repository at the given URL
EXIT_LOCKED = 11           # another process holds a lock that excludes this command
EXIT_WRONG_PASSWORD = 12   # no key opens with the given passphrase or key file
EXIT_INTERRUPTED = 130     # Ctrl-C or a signal


class OgrefsError(Exception):
    """Base for expected failures; ``str(e)`` is shown to the user as is."""

    exit_code = 1


class RepositoryError(OgrefsError):
    """The repository is missing, unreadable, or of a format we do not know."""


class NoRepository(RepositoryError):
    """Nothing at the repository URL looks like an ogrefs repository."""

    exit_code = EXIT_NO_REPOSITORY


class SnapshotNotFound(OgrefsError):
    """No snapshot matches the name the user gave."""


class CorruptObject(OgrefsError):
    """An object or chunk failed its integrity check; its bytes are never used."""


class UsageError(OgrefsError):
    """Arguments that cannot work together or point at nothing."""

    exit_code = EXIT_USAGE
