"""``ogrefs diff``: what changed between two snapshots, files and environment.

Files are compared by walking both catalogs side by side, directory by
directory (children come sorted by name from SQLite), so memory stays
proportional to one directory, not the tree. A file "changed" when its type,
size, mode, owner, link target or chunk list differ; content equality is
decided by chunk ids, never by reading data.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ogrefs.repo.catalog import ROOT_INO, Catalog, Inode


@dataclass
class FileDiff:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    added_bytes: int = 0
    removed_bytes: int = 0
    changed_bytes_before: int = 0
    changed_bytes_after: int = 0

    def as_dict(self, limit: int | None = None) -> dict[str, Any]:
        cut = (lambda xs: xs[:limit]) if limit else (lambda xs: xs)
        return {
            "added": cut(self.added), "removed": cut(self.removed), "changed": cut(self.changed),
            "counts": {"added": len(self.added), "removed": len(self.removed), "changed": len(self.changed)},
            "bytes": {"added": self.added_bytes, "removed": self.removed_bytes,
                      "changed_before": self.changed_bytes_before, "changed_after": self.changed_bytes_after},
        }


def _content(cat: Catalog, node: Inode) -> tuple:
    if node.is_reg:
        return tuple((off, ln, cid) for off, ln, cid, _ in cat.raw_extents(node.ino))
    return (node.target,) if node.is_lnk else (node.rdev,)


def _same(ca: Catalog, a: Inode, cb: Catalog, b: Inode) -> bool:
    if (a.mode, a.uid, a.gid, a.size, a.target, a.rdev) != (b.mode, b.uid, b.gid, b.size, b.target, b.rdev):
        return False
    if a.is_dir:
        return True
    if a.is_reg and a.mtime_ns == b.mtime_ns and a.src_ino == b.src_ino and a.ctime_ns == b.ctime_ns:
        return True  # the snapshot reused the chunk list without reading: identical
    return _content(ca, a) == _content(cb, b)


def _subtree(cat: Catalog, node: Inode, path: bytes) -> list[tuple[bytes, Inode]]:
    out = [(path, node)]
    if node.is_dir:
        out.extend(cat.walk(node.ino, path))
    return out


def diff_catalogs(a: Catalog, b: Catalog) -> FileDiff:
    d = FileDiff()
    stack: list[tuple[int, int, bytes]] = [(ROOT_INO, ROOT_INO, b"")]
    while stack:
        ia, ib, prefix = stack.pop()
        ka = dict(a.children(ia))
        kb = dict(b.children(ib))
        for name in sorted(set(ka) | set(kb)):
            path = prefix + b"/" + name
            na, nb = ka.get(name), kb.get(name)
            if na is None:
                for p, n in _subtree(b, nb, path):
                    d.added.append(os.fsdecode(p))
                    d.added_bytes += n.size if n.is_reg else 0
            elif nb is None:
                for p, n in _subtree(a, na, path):
                    d.removed.append(os.fsdecode(p))
                    d.removed_bytes += n.size if n.is_reg else 0
            elif na.is_dir and nb.is_dir:
                if not _same(a, na, b, nb):
                    d.changed.append(os.fsdecode(path))
                stack.append((na.ino, nb.ino, path))
            elif not _same(a, na, b, nb):
                d.changed.append(os.fsdecode(path))
                d.changed_bytes_before += na.size if na.is_reg else 0
                d.changed_bytes_after += nb.size if nb.is_reg else 0
    for xs in (d.added, d.removed, d.changed):
        xs.sort()
    return d
