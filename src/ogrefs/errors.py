"""Errors a user can cause or meet, each carrying a one-line reason.

The CLI turns every ``OgrefsError`` (and every store error) into that line on
stderr and a non-zero exit; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class OgrefsError(Exception):
    """Base for expected failures; ``str(e)`` is shown to the user as is."""

    exit_code = 1


class RepositoryError(OgrefsError):
    """The repository is missing, unreadable, or of a format we do not know."""


class SnapshotNotFound(OgrefsError):
    """No snapshot matches the name the user gave."""


class CorruptObject(OgrefsError):
    """An object or chunk failed its integrity check; its bytes are never used."""


class UsageError(OgrefsError):
    """Arguments that cannot work together or point at nothing."""

    exit_code = 2
