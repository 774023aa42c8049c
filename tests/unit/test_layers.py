"""The layers of docs/architecture.md, checked: every import in src/ogrefs, read with ``ast``.

Every ``import`` and ``from ... import`` counts, at module level or inside a
function, absolute or relative, under ``TYPE_CHECKING`` or not. A module may
import a package of a lower level; a package of its own level only along an
edge of ``PEER_EDGES``; never a higher one. On top of the order: the
third-party rules of ``ONLY_IN``, and no module reaches into another module's
``_private`` names (``from m import _x``, ``m._x``, or a ``_private`` module
of another package).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import REPO_ROOT

SRC = REPO_ROOT / "src"

#: Lowest first. A unit is a package under ogrefs/ or a top-level module; each may import the levels below it.
LEVELS: list[set[str]] = [
    {"errors", "units"},  # shared by every layer; they import nothing of ogrefs
    {"inspect"},  # machine/environment/checkpoint detection: pure, imports only errors (snapshot, agent, cli use it)
    {"store"},
    {"repo"},
    {"box", "supervise"},  # this box as mounts change and record it; a job whose files arrive while it runs
    {"snapshot", "restore", "maint", "lazy", "localtree", "inplace"},  # the middle: threads (snapshot, restore,
    # maint, inplace), trio (lazy)
    {"mount"},
    {"agent"},
    {"cli"},
    {"ogrefs", "__main__"},  # the package's __init__ and `python -m ogrefs`
]

#: The edges allowed between two units of one level, each with why.
PEER_EDGES: dict[tuple[str, str], str] = {
    ("restore", "localtree"): "localtree writes entries into a local tree; restore is one of its two users",
    ("lazy", "localtree"): "the materializer is localtree's other user (the same no-follow writes as restore)",
    ("inplace", "restore"): "the no-FUSE mount writes each batch of files with restore's Restorer",
    ("inplace", "localtree"): "the no-FUSE mount keeps and finishes entries with the same no-follow writes",
}

#: Third-party packages that only some modules may import: the module itself or a package prefix of it.
ONLY_IN: dict[str, tuple[str, ...]] = {
    "pyfuse3": ("ogrefs.mount.fuse_ops",),  # the one FUSE adapter, so another binding could replace it
    "click": ("ogrefs.cli",),  # the command line is the only place that talks to a user's terminal
    "trio": ("ogrefs.lazy", "ogrefs.mount"),  # store/repo have no event loop; snapshot/restore/maint use threads
}


@dataclass(frozen=True)
class Edge:
    """One import: ``module`` (the importer) names ``target`` (a module), maybe ``name`` from it."""

    module: str
    line: int
    target: str
    name: str | None = None


def unit_of(module: str) -> str:
    """``ogrefs.lazy.fs.vfs`` -> ``lazy``, ``ogrefs.restore`` -> ``restore``, ``ogrefs`` -> ``ogrefs``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def level_of(unit: str) -> int | None:
    return next((i for i, units in enumerate(LEVELS) if unit in units), None)


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(module: str, source: str, is_package: bool = False) -> list[Edge]:
    """Every import in ``source`` (module ``module``), relative ones resolved."""
    package = module if is_package else module.rpartition(".")[0]
    edges: list[Edge] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            edges += [Edge(module, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            edges += [Edge(module, node.lineno, target, alias.name) for alias in node.names]
    return edges


def private_attribute_uses(module: str, source: str, modules: set[str], is_package: bool = False) -> list[str]:
    """``m._x`` where ``m`` is a name bound to another ogrefs module by an import in ``source``."""
    bound: dict[str, str] = {}
    for edge in imports_of(module, source, is_package):
        if edge.name is None and edge.target.startswith("ogrefs."):
            continue  # `import ogrefs.a.b` binds `ogrefs`; attribute chains on it are caught below by the full name
        if edge.name is not None and f"{edge.target}.{edge.name}" in modules:
            bound[edge.name] = f"{edge.target}.{edge.name}"
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.asname and alias.name in bound:
                    bound[alias.asname] = bound[alias.name]
        elif isinstance(node, ast.Import):
            bound.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and _is_private(node.attr) and bound[node.value.id] != module):
            found.append(f"{module}:{node.lineno} uses {bound[node.value.id]}.{node.attr}")
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def violations(module: str, edges: list[Edge], modules: set[str]) -> list[str]:
    """What breaks the rules among ``edges`` of ``module``; ``modules`` are all ogrefs modules."""
    found = []
    unit = unit_of(module)
    here = level_of(unit)
    if here is None:
        return [f"{module}: unit {unit!r} is in no level of LEVELS (place it)"]
    for e in edges:
        where = f"{module}:{e.line}"
        top = e.target.split(".")[0]
        if top in ONLY_IN and not any(module == p or module.startswith(p + ".") for p in ONLY_IN[top]):
            found.append(f"{where} imports {top} (only {', '.join(ONLY_IN[top])} may)")
        if top != "ogrefs":
            continue
        imported = _imported_module(e, modules)
        other = unit_of(imported)
        there = level_of(other)
        if other != unit:
            if there is None or there > here:
                found.append(f"{where} imports {imported}: {other} is above {unit}")
            elif there == here and (unit, other) not in PEER_EDGES:
                found.append(f"{where} imports {imported}: {unit} -> {other} is no PEER_EDGES edge")
        found += _private_reach(where, module, e, modules)
    return found


def _imported_module(e: Edge, modules: set[str]) -> str:
    """The module an import brings in: ``from ogrefs import restore`` is ``ogrefs.restore``."""
    return f"{e.target}.{e.name}" if e.name and f"{e.target}.{e.name}" in modules else e.target


def _private_reach(where: str, module: str, e: Edge, modules: set[str]) -> list[str]:
    found = []
    imported = _imported_module(e, modules)
    if e.name and imported == e.target and _is_private(e.name) and e.target != module:
        found.append(f"{where} imports {e.target}.{e.name}, a private name of another module")
    parts = imported.split(".")
    for i, part in enumerate(parts):
        owner = ".".join(parts[:i])  # the package that holds this private module
        if _is_private(part) and not (module == owner or module.startswith(owner + ".")):
            found.append(f"{where} imports {imported}, a private module of {owner}")
    return found


def _tree() -> dict[str, tuple[str, bool]]:
    return {module_name(p): (p.read_text(), p.name == "__init__.py") for p in sorted((SRC / "ogrefs").rglob("*.py"))}


def test_the_tree_keeps_its_layers():
    tree = _tree()
    modules = set(tree)
    found = []
    for module, (source, is_package) in tree.items():
        found += violations(module, imports_of(module, source, is_package), modules)
        found += private_attribute_uses(module, source, modules, is_package)
    assert found == [], "\n".join(found)


def module_graph(tree: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the ogrefs modules it imports (every import: deferred, type-only, of a package's ``__init__``)."""
    modules = set(tree)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, (source, is_package) in tree.items():
        for e in imports_of(module, source, is_package):
            target = _imported_module(e, modules)
            if target in modules and target != module:
                graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_between_any_two_modules():
    assert cycles(module_graph(_tree())) == []


def test_the_cycle_finder_finds_type_only_and_deferred_circles():
    tree = {
        "ogrefs.a": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ogrefs.b import B\n", False),
        "ogrefs.b": ("def f():\n    from ogrefs import c\n", False),
        "ogrefs.c": ("from ogrefs.a import x\n", False),
        "ogrefs.d": ("from ogrefs.a import x\n", False),
        "ogrefs.p": ("from ogrefs.p.q import y\n", True),
        "ogrefs.p.q": ("from ogrefs import p\n", False),
    }
    assert cycles(module_graph(tree)) == [["ogrefs.a", "ogrefs.b", "ogrefs.c"], ["ogrefs.p", "ogrefs.p.q"]]
    del tree["ogrefs.c"], tree["ogrefs.p.q"]
    assert cycles(module_graph(tree)) == []


#: The floors of the lazy engine, lowest first: a subpackage may import its own floor's modules and the
#: floors below it, never a peer on its floor (fs and trace know nothing of each other) or one above.
LAZY_FLOORS: list[set[str]] = [
    {"fetch"},  # chunks: fetcher, queue, blob I/O, chunk cache, residency, background threads' priority
    {"fs", "trace"},  # what the kernel sees; what was read and will be read (recorder, resolve, replay)
    {"background"},  # prefetch, box CPU, the snapshot gate, materialization
]

#: Modules of the lazy engine that run in worker threads (or a child process) only: they import no trio,
#: not even through another ogrefs module. Every other module of lazy/ runs on the trio loop.
THREAD_SIDE: set[str] = {
    "ogrefs.lazy.fetch.blobio",
    "ogrefs.lazy.fetch.chunkcache",
    "ogrefs.lazy.trace.resolve",
    "ogrefs.lazy.trace.newer_checkpoint",
    "ogrefs.lazy.background.proctick",
    "ogrefs.lazy.background.materialize.build",
    "ogrefs.lazy.background.materialize.buildchild",
    "ogrefs.lazy.background.materialize.buildproc",
    "ogrefs.lazy.background.materialize.space",
    "ogrefs.lazy.background.materialize.writer",
}


def floor_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        here = _floor(module)
        for target in sorted(targets):
            there = _floor(target)
            if here is None or there is None or module.split(".")[2] == target.split(".")[2]:
                continue
            if there >= here:
                found.append(f"{module} imports {target}: floor {there} is not below floor {here}")
    return found


def _floor(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["ogrefs", "lazy"] or len(parts) < 3:
        return None
    return next((i for i, floor in enumerate(LAZY_FLOORS) if parts[2] in floor), -1)


def trio_reached(module: str, tree: dict[str, tuple[str, bool]], graph: dict[str, set[str]]) -> list[str]:
    """The chain of imports by which ``module`` reaches trio, or []."""
    seen, todo = {module}, [[module]]
    while todo:
        chain = todo.pop()
        source, is_package = tree[chain[-1]]
        if any(e.target.split(".")[0] == "trio" for e in imports_of(chain[-1], source, is_package)):
            return chain + ["trio"]
        for nxt in sorted(graph[chain[-1]] - seen):
            seen.add(nxt)
            todo.append(chain + [nxt])
    return []


def test_the_lazy_engine_keeps_its_floors():
    tree = _tree()
    units = {m.split(".")[2] for m in tree if m.startswith("ogrefs.lazy.")}
    assert units == {u for floor in LAZY_FLOORS for u in floor}, "every package of lazy/ is on one floor"
    assert floor_violations(module_graph(tree)) == []


def test_thread_side_modules_reach_no_trio():
    tree = _tree()
    assert THREAD_SIDE <= set(tree), THREAD_SIDE - set(tree)
    graph = module_graph(tree)
    assert {m: trio_reached(m, tree, graph) for m in sorted(THREAD_SIDE) if trio_reached(m, tree, graph)} == {}


def test_the_floor_and_trio_checks_find():
    tree = {
        "ogrefs.lazy.fetch.a": ("from ogrefs.lazy.fs import b\n", False),
        "ogrefs.lazy.fs.b": ("from ogrefs.lazy.trace.c import x\n", False),
        "ogrefs.lazy.trace.c": ("def f():\n    from ogrefs.lazy.trace import d\n", False),
        "ogrefs.lazy.trace.d": ("import trio\n", False),
    }
    graph = module_graph(tree)
    assert floor_violations(graph) == [
        "ogrefs.lazy.fetch.a imports ogrefs.lazy.fs.b: floor 1 is not below floor 0",
        "ogrefs.lazy.fs.b imports ogrefs.lazy.trace.c: floor 1 is not below floor 1"]
    assert trio_reached("ogrefs.lazy.fetch.a", tree, graph) == [
        "ogrefs.lazy.fetch.a", "ogrefs.lazy.fs.b", "ogrefs.lazy.trace.c", "ogrefs.lazy.trace.d", "trio"]
    assert trio_reached("ogrefs.lazy.trace.d", tree, {**graph, "ogrefs.lazy.trace.d": set()}) == [
        "ogrefs.lazy.trace.d", "trio"]
    tree["ogrefs.lazy.trace.d"] = ("import os\n", False)
    assert trio_reached("ogrefs.lazy.fetch.a", tree, module_graph(tree)) == []


def test_every_unit_of_the_tree_has_a_level():
    units = {unit_of(m) for m in _tree()}
    assert {u for u in units if level_of(u) is None} == set()
    assert {u for level in LEVELS for u in level} - units == set(), "a level names a unit that no longer exists"


# -- the checker itself: each rule fails on a module that breaks it --------------------------------------

MODULES = {"ogrefs.lazy", "ogrefs.lazy.vfs", "ogrefs.lazy.fetcher", "ogrefs.mount", "ogrefs.mount.core",
           "ogrefs.repo", "ogrefs.repo.codec", "ogrefs.inspect", "ogrefs.inspect._deadline", "ogrefs.restore",
           "ogrefs.localtree", "ogrefs.maint", "ogrefs.maint.prune", "ogrefs.snapshot", "ogrefs.snapshot.pipeline"}


def _check(module: str, source: str) -> list[str]:
    return (violations(module, imports_of(module, source), MODULES)
            + private_attribute_uses(module, source, MODULES))


@pytest.mark.parametrize("module, source, needle", [
    ("ogrefs.lazy.vfs", "from ogrefs.mount.core import mount\n", "mount is above lazy"),
    ("ogrefs.lazy.vfs", "def f():\n    from ..mount import core\n", "mount is above lazy"),
    ("ogrefs.lazy.vfs", "import pyfuse3\n", "imports pyfuse3"),
    ("ogrefs.mount.core", "import pyfuse3\n", "imports pyfuse3"),
    ("ogrefs.lazy.vfs", "import click\n", "imports click"),
    ("ogrefs.repo.codec", "import trio\n", "imports trio"),
    ("ogrefs.snapshot.pipeline", "from ogrefs.maint.prune import read_trash\n", "no PEER_EDGES edge"),
    ("ogrefs.repo.codec", "from .. import restore\n", "restore is above repo"),
    ("ogrefs.lazy.vfs", "from ogrefs.lazy.fetcher import _Slot\n", "private name of another module"),
    ("ogrefs.lazy.vfs", "from .fetcher import _Slot\n", "private name of another module"),
    ("ogrefs.lazy.vfs", "from ogrefs.lazy import fetcher\nfetcher._slots\n", "uses ogrefs.lazy.fetcher._slots"),
    ("ogrefs.lazy.vfs", "from ogrefs.lazy import fetcher as f\nf._slots\n", "uses ogrefs.lazy.fetcher._slots"),
    ("ogrefs.lazy.vfs", "import ogrefs.lazy.fetcher as f\nf._slots\n", "uses ogrefs.lazy.fetcher._slots"),
    ("ogrefs.lazy.vfs", "from ogrefs.inspect._deadline import Deadline\n", "private module of ogrefs.inspect"),
    ("ogrefs.lazy.vfs", "from ogrefs.inspect import _deadline\n", "private module of ogrefs.inspect"),
    ("ogrefs.newpkg.x", "import os\n", "in no level"),
])
def test_the_checker_finds(module, source, needle):
    found = _check(module, source)
    assert any(needle in v for v in found), found


@pytest.mark.parametrize("module, source", [
    ("ogrefs.mount.core", "from ogrefs.lazy.vfs import SnapshotFS\nimport trio\n"),
    ("ogrefs.mount.fuse_ops", "import pyfuse3\n"),
    ("ogrefs.restore", "from ogrefs.localtree import LocalTree\n"),
    ("ogrefs.lazy.vfs", "from .fetcher import Fetcher\nfrom ogrefs.errors import CorruptObject\n"),
    ("ogrefs.inspect.probe", "from ogrefs.inspect._deadline import Deadline\nfrom ._deadline import x\n"),
    ("ogrefs.lazy.fetcher", "from ogrefs.lazy import fetcher\nfetcher._own\n"),
])
def test_the_checker_accepts(module, source):
    assert _check(module, source) == []
