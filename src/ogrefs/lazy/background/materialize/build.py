"""Preparing a materialization (worker-thread side): build the local tree and the plan, or reopen them.

A fresh state directory gets the whole tree at once (directories, sparse
regular files of their final size, symlinks, FIFOs, device nodes where
permitted, hardlinks as hardlinks) and a plan with every distinct chunk once,
its class (hints before the rest) and its targets.  An earlier run's tree is
reopened as it is.  Either way this run's trace chunks go first.

A fresh build runs in a child process (:mod:`.buildproc`: no GIL shared
with the daemon's request handling, the scheduler's idle priority), which
the preparation's thread starts, paces at the :class:`~.pacing.BuildGate`
and waits for; :func:`build` is what that child runs.

Who owns what: :func:`prepare` runs in one worker thread before any writer
starts.  It gets immutable inputs and returns a new, frozen :class:`Prepared`
(or the reason it refused); the loop assigns what it needs from that.  It
never touches the loop's state; it only reads the gate, which the loop sets
and clears, and counts the seconds the child was held at it.

The materializer calls the preparation as a :data:`Preparer`: :func:`prepare`
unless it is given another (a test wraps :func:`prepare` to see when the tree
is built).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from ogrefs.errors import CorruptObject, OgrefsError
from ogrefs.lazy.background.materialize import space
from ogrefs.lazy.background.materialize.buildproc import COMMAND, Gate, build_in_child
from ogrefs.box.copyplan import Plan
from ogrefs.lazy.background.materialize.writer import TreeWriter, WriterFactory, syncfs
from ogrefs.lazy.trace.resolve import EntryResolver
from ogrefs.repo.traces import Entry
from ogrefs.localtree import LocalTree
from ogrefs.repo.catalog import ROOT_INO, Catalog
from ogrefs.units import human_bytes as human

log = logging.getLogger(__name__)

#: Rows inserted per executemany while the plan is built.
_ROWS = 1000


@dataclass(frozen=True)
class Prepared:
    """What a preparation found: everything the loop needs to run passes (immutable)."""

    writer: TreeWriter  # the tree's root fd, the catalog and the plan: for the writers
    fresh: bool  # the tree was built by this run: nothing of it was on disk before
    class_total: tuple[int, int, int]  # bytes per class
    class_done: tuple[int, int, int]
    files_total: int
    complete: frozenset[int]  # files recorded complete
    done: frozenset[bytes]  # chunks recorded done
    yielded_s: float = 0.0  # the build waited this long for an active application (pacing.BuildGate)


def prepare(plan: Plan, catalog: Catalog, tree_root: bytes, trace: list[Entry],
            refusal: Callable[[int], str | None], make_writer: WriterFactory = TreeWriter,
            gate: Gate | None = None, build_command: Sequence[str] = COMMAND) -> Prepared | str:
    """Worker thread: the tree and the plan ready for passes, or why materialization is refused.

    ``refusal(needed bytes)``: the disk-space policy (:func:`space.refusal`).
    ``make_writer``: makes the tree's writer (the one :attr:`Prepared.writer` hands the passes).
    ``gate``: where a fresh build is held while the application is active (none: never).
    ``build_command``: the argv of the build's child process (:mod:`.buildproc`).
    Raises :class:`space.Stop` when the disk or the plan fails meanwhile, and
    :class:`~.buildproc.BuildStopped` when the gate stopped the build.
    """
    try:
        return _prepare(plan, catalog, tree_root, trace, refusal, make_writer, gate, build_command)
    except (OSError, sqlite3.Error, OgrefsError) as exc:
        plan.rollback()
        raise space.Stop(exc, "preparing the local tree") from None
    except BaseException:
        plan.rollback()
        raise


def _prepare(plan: Plan, catalog: Catalog, tree_root: bytes, trace: list[Entry],
             refusal: Callable[[int], str | None], make_writer: WriterFactory, gate: Gate | None,
             build_command: Sequence[str]) -> Prepared | str:
    fresh = plan.meta("built") != "1"
    reason = refusal(catalog.file_data_total() if fresh else plan.bytes_needed())
    if reason is not None:
        return reason
    writer = make_writer(catalog, LocalTree(tree_root, create=fresh), plan)
    held = 0.0
    if fresh:
        held = build_in_child(plan.path, catalog.path, tree_root, gate, build_command)
    _classify_trace(plan, catalog, trace)
    writer.complete_files(plan.ready_files())
    total, done = [0, 0, 0], [0, 0, 0]
    for cls, t, d in plan.class_bytes():
        total[cls], done[cls] = t, d
    return Prepared(writer, fresh, (total[0], total[1], total[2]), (done[0], done[1], done[2]),
                    plan.count_files(), plan.complete_inos(), plan.done_chunks(), held)


#: The preparation as the materializer calls it, in a worker thread: ``(plan, catalog, tree_root, trace,
#: refusal, make_writer, gate, build_command) -> Prepared | refusal reason``; :func:`prepare` unless the
#: Materializer is given another.
Preparer = Callable[[Plan, Catalog, bytes, list[Entry], Callable[[int], str | None], WriterFactory, "Gate | None",
                     Sequence[str]], Prepared | str]


def _create_entry(tree: LocalTree, path: bytes, node, link_to: bytes | None) -> bool:
    """A non-directory entry of the tree: a hardlink to ``link_to``, an empty file of the node's size, or a
    special file; False for a type that is not materialized (a socket)."""
    if link_to is not None:
        tree.link_name(link_to, path)
        return True
    if node.is_reg:
        tree.create_file(path, node.size)
        return True
    return tree.create_special(path, node)


def build(writer: TreeWriter, tree_root: bytes) -> None:
    """Create the tree and the plan (from scratch: an interrupted build is redone); the build's child runs it."""
    t0 = time.monotonic()
    plan, catalog = writer.plan, writer.catalog
    plan.begin_build()
    if catalog.get(ROOT_INO) is None:
        raise CorruptObject("catalog has no root directory")
    _build_entries(writer.tree, catalog, plan)
    _plan_chunks(catalog, plan)
    # special files are complete now; regular files without data too (later, via pending = 0)
    for ino, path in plan.specials():
        node = catalog.get(ino)
        if node is not None:
            writer.apply_metadata(path, node)
    syncfs(tree_root)
    chunks, size = plan.commit_build()
    log.info("materialization: local tree built in %.1f s (%d files, %d chunks, %s to fetch)",
             time.monotonic() - t0, plan.count_files(), chunks, human(size))


def _build_entries(tree: LocalTree, catalog: Catalog, plan: Plan) -> None:
    """Every entry of the snapshot in the tree, and its row in the plan's files, others or links."""
    others: list[tuple[int, bytes, int]] = [(ROOT_INO, b"", 1)]
    files: list[tuple[int, bytes]] = []
    links: list[tuple[bytes, int]] = []
    first: dict[int, bytes] = {}  # hardlinked inode -> its first path
    for path, node in catalog.walk():
        if node.is_dir:
            tree.make_dir(path)
            others.append((node.ino, path, 1))
        else:
            link_to = first.get(node.ino) if node.nlink > 1 else None
            try:
                made = _create_entry(tree, path, node, link_to)
            except PermissionError as exc:  # device nodes need root; the mount still serves them
                log.info("materialization: cannot create %s (%s)", os.fsdecode(path), exc.strerror)
                continue
            if made and link_to is not None and node.is_reg:
                links.append((path, node.ino))  # complete when its first name is
            if not made or link_to is not None:
                continue
            if node.nlink > 1:
                first[node.ino] = path
            if node.is_reg:
                files.append((node.ino, path))
            else:
                others.append((node.ino, path, 0))
        if len(files) + len(others) + len(links) >= _ROWS:
            plan.add_entries(files, others, links)
            files, others, links = [], [], []
    plan.add_entries(files, others, links)


def _plan_chunks(catalog: Catalog, plan: Plan) -> None:
    """The plan: every extent of every file in the tree, each distinct chunk once; the hints' classes."""
    rows: list[tuple] = []
    bad: set[int] = set()  # files whose data the catalog locates wrongly: never local, read lazily (EIO)
    for ino, off, length, chunk, pack, poff, slen in catalog.all_extents(on_malformed=lambda ino, _why: bad.add(ino)):
        if pack is None:
            bad.add(ino)
            continue
        rows.append((ino, off, length, chunk, pack, poff, slen))
        if len(rows) >= 2 * _ROWS:
            plan.add_extents(rows)
            rows.clear()
    plan.add_extents(rows)
    if bad:
        log.error("materialization: %d file(s) have malformed data locations in the catalog; they are "
                  "not materialized (reading them fails)", len(bad))
    plan.settle_files(bad)
    # hints, in rank order: their files' chunks come before everything else but the trace
    for seq, (_klass, ino, _rank) in enumerate(catalog.hints()):
        for fino in hint_files(catalog, ino):
            plan.hint_file(seq, fino)


def hint_files(catalog: Catalog, ino: int) -> Iterable[int]:
    """The regular files hint ``ino`` names: itself, or every file below a directory (the no-FUSE mount too)."""
    node = catalog.get(ino)
    if node is None:
        return
    if node.is_reg:
        yield ino
    elif node.is_dir:
        for _path, child in catalog.walk(ino):
            if child.is_reg:
                yield child.ino


def _classify_trace(plan: Plan, catalog: Catalog, trace: list[Entry]) -> None:
    """This run's trace chunks (not yet done) go first, in trace order; an older run's trace class is undone."""
    order: dict[bytes, int] = {}
    if trace:
        resolver = EntryResolver(catalog)
        for r in resolver.resolve(trace):
            order.setdefault(r.extent.chunk, len(order))
        log.info("materialization: %d trace chunks first (%d trace entries no longer exist)",
                 len(order), resolver.dropped)
    plan.classify_trace(order)
