"""What ``ogrefs snapshot`` leaves out, as the user writes it: patterns, pattern files, marker files.

Pattern syntax (``--exclude``, ``--exclude-file``; README "What a snapshot leaves out"):

* a shell glob: ``*`` (any characters, ``/`` included), ``?`` (one character),
  ``[abc]``, ``[a-z]``, ``[!abc]`` (a set, or its complement);
* matched against the whole absolute path and against the entry's name:
  ``*.pyc`` skips every .pyc file, ``/home/*/.cache`` those directories;
* a pattern ending in ``/`` matches a directory of that name anywhere;
* an excluded directory is left out with everything below it.

A pattern that cannot mean what it says is refused: empty, an unclosed or
empty ``[`` set, a NUL byte. In pattern files, blank lines and lines
starting with ``#`` are ignored (as restic). Pure functions, no state.
"""

from __future__ import annotations

import os
from typing import Collection

from ogrefs.errors import UsageError
from ogrefs.inspect.files import open_regular

#: The Cache Directory Tagging Specification's signature (https://bford.info/cachedir/).
CACHEDIR_SIGNATURE = b"Signature: 8a477f597d28d172789f06886806bc55"


def check_pattern(pattern: str) -> str:
    """``pattern`` if it is a well-formed glob; UsageError with the reason otherwise."""
    if not pattern:
        raise UsageError("an empty --exclude pattern matches nothing; leave it out")
    if "\0" in pattern:
        raise UsageError(f"--exclude pattern {pattern!r} holds a NUL byte")
    i = 0
    while i < len(pattern):
        if pattern[i] == "[":
            j = i + 1
            if j < len(pattern) and pattern[j] == "!":
                j += 1
            if j < len(pattern) and pattern[j] == "]":
                j += 1  # a leading ] is a member of the set
            close = pattern.find("]", j)
            if close < 0:
                raise UsageError(f"--exclude pattern {pattern!r}: '[' at position {i + 1} is never closed "
                                 "(write [[] for a literal '[')")
            if close == i + 1 or (pattern[i + 1] == "!" and close == i + 2):
                raise UsageError(f"--exclude pattern {pattern!r}: empty set at position {i + 1}")
            i = close
        i += 1
    return pattern


def read_pattern_file(path: str, what: str = "--exclude-file") -> list[str]:
    """Lines of a pattern or path file: blank lines and ``#`` comments skipped, line ends stripped."""
    try:
        with open_regular(path, "r", follow=True, encoding="utf-8", errors="surrogateescape") as fh:
            lines = [line.rstrip("\r\n") for line in fh]
    except OSError as exc:
        raise UsageError(f"{what} {path}: {exc.strerror}") from None
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def parse_if_present(spec: str) -> tuple[bytes, bytes | None]:
    """``NAME`` or ``NAME:HEADER`` (the file's first bytes must be HEADER) of ``--exclude-if-present``."""
    name, sep, header = spec.partition(":")
    if not name or "/" in name or name in (".", ".."):
        raise UsageError(f"--exclude-if-present {spec!r}: give a file name (NAME or NAME:HEADER), no path")
    return os.fsencode(name), (header.encode() if sep else None)


def marked_directory(path: bytes, markers: list[tuple[bytes, bytes | None]],
                     names: Collection[bytes] | None = None) -> bool:
    """True if directory ``path`` holds one of the marker files (with its header, when one is required).

    ``names``: the entry's names when they are known without looking (a non-directory: none; a directory
    taken whole from a mounted snapshot's catalog, snapshot/untouched.py), so a missing marker costs no
    lookup through the mount; only a marker with a header to check is still opened.
    """
    for name, header in markers:
        if names is not None and name not in names:
            continue
        marker = os.path.join(path, name)
        if header is None:
            if names is not None or (os.path.lexists(marker) and os.path.isdir(path)):
                return True
            continue
        try:
            with open_regular(marker) as fh:
                if fh.read(len(header)) == header:
                    return True
        except OSError:
            continue
    return False


def nothing_below(roots: list[bytes], excluded) -> str | None:
    """Why these roots would make an empty snapshot (every root excluded, or every entry below them), else None."""
    kept = [r for r in roots if not excluded(r)]
    if not kept:
        return "every path given is excluded"
    for root in kept:
        if not os.path.isdir(root) or os.path.islink(root):
            return None
        try:
            names = os.listdir(root)
        except OSError:
            return None  # unreadable: the snapshot reports it
        if any(not excluded(os.path.join(root, n)) for n in names) or not names:
            return None
    return "everything below the paths given is excluded"
