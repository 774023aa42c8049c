"""Whole untouched subtrees of a mounted snapshot, copied into the new catalog at once.

snapshot/untouched.py lets the walk take a directory that nothing has changed
from the mounted snapshot's catalog instead of through the mount.  That still
cost a dozen SQLite statements and a page of Python an entry (three queries a
directory, then a dirent, an inode, xattrs, extents and blob locations an
entry): 1.4 s for the 25,600 files of the spot loop's box, a third of its
snapshot after a preemption notice, and it grows with the box, not with what
changed (docs/benchmarks.md, issue 13).

overlayfs gives more than one directory at a time: a directory with no
counterpart in upper has the lower's children, so every directory below it
has none either (a change anywhere below would have made overlayfs create the
whole path in upper).  Where the catalog is that directory's lowest layer (no
own directory of the box below it), everything below it *is* the catalog's
subtree.  :func:`~ogrefs.repo.catalog.subtree` checks its rows in SQL and
gives Python only what the rules decide on (names, modes, link counts,
flags); :meth:`~ogrefs.repo.catalog.CatalogWriter.add_copied` then copies the
rows from the attached catalog in one ``INSERT ... SELECT`` a table.  The
first version built every row in Python (an ``Inode`` and its checks, every
extent's location): 2.1-2.3 s for the 27,048-file venv of the loop bench,
against 1.15-1.2 s now (subtree, plan and copy timed alone on an
idle 2-core VM; docs/benchmarks.md has the snapshot it shortens).

A chunk must still be where the catalog says: a subtree with a chunk in a
pack that is not live for this run (forgotten, repacked) is refused whole,
and the walk finds those chunks again file by file (origin.live_extents).

Nothing the per-entry walk decides is skipped: :func:`plan_copy` applies the
same rules to every entry (excludes and ``--exclude-if-present`` markers,
paths never recorded, mount points, volatile paths, hard links, files that
kept changing while A read them, data gone from the repository), and where
one of them would make an entry anything but the catalog's, the copy is
refused and the walk goes entry by entry as before; the refusal names the
directories on the way to that entry, so their other subdirectories are still
copied whole.

Used by the snapshot's main thread only: :class:`UntouchedTrees` belongs to
one Snapshotter and writes to its catalog writer, stats and observers.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ogrefs.repo.catalog import FLAG_CHANGED, CatalogWriter, Subtree, subtree
from ogrefs.snapshot.untouched import KnownDir, visible_xattrs
from ogrefs.snapshot.walk import WalkRules

log = logging.getLogger(__name__)

#: The most entries read into memory at once (about 300 bytes each); a larger subtree is copied in parts.
SUBTREE_MAX = 200_000


@dataclass
class CopyPlan:
    """What copying one subtree writes, counts and reports; nothing is applied until the whole plan holds."""

    inodes: list[tuple[int, int]] = field(default_factory=list)  # (inode in the catalog, new inode), walk order
    xattrs: list[tuple[int, bytes, bytes]] = field(default_factory=list)
    observed: list[tuple[bytes, list[bytes]]] = field(default_factory=list)  # (directory, names), walk order
    unchanged: list[bytes] = field(default_factory=list)  # regular files taken unchanged
    dirs: int = 0
    files: int = 0
    others: int = 0
    bytes: int = 0
    chunks: int = 0


@dataclass(frozen=True)
class Refused:
    """The copy would not be what the walk records: these catalog directories go entry by entry."""

    dirs: tuple[int, ...]
    why: str


class PathSet:
    """Sorted absolute paths, asked whether any lies at or below a directory."""

    def __init__(self, paths) -> None:
        self._sorted = sorted(p.rstrip(b"/") or b"/" for p in paths)

    def any_below(self, path: bytes) -> bool:
        """Whether a path of the set lies strictly below directory ``path``."""
        prefix = path.rstrip(b"/") + b"/"
        i = bisect.bisect_left(self._sorted, prefix)
        if i < len(self._sorted) and self._sorted[i] == prefix:  # "/" itself, below nothing
            i += 1
        return i < len(self._sorted) and self._sorted[i].startswith(prefix)


def plan_copy(tree: Subtree, path: bytes, *, rules: WalkRules, never: set[bytes], dev: int,
              root_dev: int, new_ino: Callable[[], int],
              packs_live: Callable[[frozenset[str]], bool],
              visible_xattrs: Callable[[list[tuple[bytes, bytes]]], list[tuple[bytes, bytes]]]) -> CopyPlan | Refused:
    """The inode numbers, xattrs and counts of copying ``tree`` (the catalog's entries below ``path``).

    Entries are visited as the walk visits them (depth first, names sorted,
    a directory's entries right after it), so inode numbers and observer
    calls come in the same order.  ``never``: paths the snapshot never
    records (its own state, --skip); ``packs_live``: whether packs are all
    live for this run (a chunk elsewhere, gone or repacked, is the walk's to
    find again, file by file); ``new_ino`` hands out the new catalog's inode numbers (only a plan
    that holds is applied, so numbers taken by a refused one are a gap).
    """
    plan = CopyPlan()
    if tree.unlocated or not packs_live(tree.packs):
        return Refused((tree.top,), "some chunks are not in this run's live packs")
    markers = bool(rules.exclude_if_present)
    # (catalog directory, its path, iterator over its entries)
    stack = [(tree.top, path.rstrip(b"/"), iter(tree.children[tree.top]))]
    while stack:
        dino, dpath, kids = stack[-1]
        entry = next(kids, None)
        if entry is None:
            stack.pop()
            continue
        name, node = entry
        cpath = dpath + b"/" + name
        names = None
        if markers:
            names = frozenset(n for n, _ in tree.children[node.ino]) if node.is_dir else ()
        why = None
        if rules.excluded(cpath, names) or cpath in never:
            why = "excluded"
        elif cpath in rules.table:
            why = "a mount point"
        elif node.nlink > 1 and not node.is_dir:
            why = "a hard link"
        elif node.is_dir and rules.not_descended(cpath, is_root=False, dev=dev, root_dev=root_dev) is not None:
            why = "not descended into"
        elif node.is_reg and node.flags & FLAG_CHANGED:
            why = "a file to read again"
        if why is not None:
            return Refused(tuple(d for d, *_ in stack), f"{os.fsdecode(cpath)}: {why}")
        ino = new_ino()
        plan.inodes.append((node.ino, ino))
        plan.xattrs.extend((ino, n, v) for n, v in visible_xattrs(tree.xattrs.get(node.ino, [])))
        if node.is_dir:
            plan.dirs += 1
            kids_of = tree.children[node.ino]
            plan.observed.append((cpath, [n for n, _ in kids_of]))
            stack.append((node.ino, cpath, iter(kids_of)))
        elif node.is_reg:
            plan.files += 1
            plan.bytes += node.size
            plan.chunks += tree.chunks.get(node.ino, 0)
            plan.unchanged.append(cpath)
        else:
            plan.others += 1
    return plan


class UntouchedTrees:
    """Copies untouched subtrees whole into one snapshot's catalog, where the walk's rules allow it.

    ``never``: paths the snapshot never records; ``packs_live``: whether
    packs are all live for the run; ``unchanged``: the set of files taken unchanged that the
    checkpoint probe asks (frommount.py).  Directories a plan refused are
    remembered, so the walk below them tries each subdirectory once.
    """

    def __init__(self, rules: WalkRules, never: set[bytes], cat: CatalogWriter, stats: Any, observers: list,
                 unchanged: set[str], packs_live: Callable[[frozenset[str]], bool]) -> None:
        self.rules, self.never, self.cat, self.stats = rules, never, cat, stats
        self.observers, self.unchanged, self.packs_live = observers, unchanged, packs_live
        self._refused: set[int] = set()  # catalog directories: walked entry by entry
        self._mount_points = PathSet(rules.table)
        self._never = PathSet(rules.skip_paths | never)

    def copy(self, known: KnownDir, path: bytes, new_top: int, dev: int, root_dev: int) -> bool:
        """Everything below ``path`` (``known``: a complete directory) into the catalog under ``new_top``;
        False, with nothing written, where the walk must go entry by entry."""
        if known.own or known.whiteouts_hide or known.ino in self._refused:
            return False
        if self._mount_points.any_below(path) or self._never.any_below(path):
            return False  # a mount point, a volatile or never-recorded path somewhere below
        host = known.mount
        if host.host_owned and (host.is_host_owned(known.cat_path) or PathSet(host.host_owned).any_below(known.cat_path)):
            return False
        tree = subtree(known.cat, known.ino, SUBTREE_MAX)
        plan = Refused((known.ino,), "not a plain tree of valid names, or too large") if tree is None else plan_copy(
            tree, path, rules=self.rules, never=self.never, dev=dev, root_dev=root_dev,
            new_ino=self.cat.new_ino, packs_live=self.packs_live, visible_xattrs=visible_xattrs)
        if isinstance(plan, Refused):
            log.debug("untouched %s walked entry by entry: %s", os.fsdecode(path), plan.why)
            self._refused.update(plan.dirs)
            return False
        self.cat.add_copied(tree, new_top, plan.inodes, plan.xattrs)
        for where, names in plan.observed:
            for obs in self.observers:
                obs.observe_dir(where, names)
        s = self.stats
        s.dirs, s.files, s.others = s.dirs + plan.dirs, s.files + plan.files, s.others + plan.others
        s.bytes, s.chunks = s.bytes + plan.bytes, s.chunks + plan.chunks
        s.reused_files += plan.files
        s.mount_reused_files += plan.files
        self.unchanged.update(os.fsdecode(p) for p in plan.unchanged)
        return True
