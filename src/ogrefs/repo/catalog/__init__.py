"""The per-snapshot catalog: a SQLite database describing every entry and chunk.

Schema (docs/format.md has the authoritative description):

* ``inodes``   one row per inode: full st_mode, owner ids and names, size,
               times in ns, rdev, symlink target, source dev/ino (for the
               incremental check), nlink within the snapshot, flags.
* ``dirents``  (parent, name) -> ino; names are raw bytes (any byte but / and NUL).
* ``xattrs``   (ino, name) -> value.
* ``extents``  a regular file's data as (file offset, length, blob); gaps are holes.
* ``blobs``    catalog-local blob number -> chunk id and its location
               (pack, offset, stored length, raw length).
* ``packs``    catalog-local pack number -> pack name.
* ``roots``    the absolute paths that were snapshotted.
* ``hints``    prefetch hints: (class, ino, rank).
* ``meta``     key/value.

Inode 1 is ``/``; inode numbers are assigned in walk order and never change, so
they are stable across mounts.  A reader needs only this file and the packs.

Modules: :mod:`.schema` (tables, row types, both validators side by side),
:mod:`.reader` (:class:`Catalog`), :mod:`.scans` (bulk scans through the
reader's public primitives), :mod:`.writer` (:class:`CatalogWriter`, owned by
the snapshotting thread), :mod:`.rewrite` (the one rewrite of a finished
catalog, checked by the reader).  Only this package names a catalog table in
SQL (tests/repo/test_catalog_queries.py).
"""

from ogrefs.repo.catalog.reader import Catalog
from ogrefs.repo.catalog.rewrite import rewrite_blobs
from ogrefs.repo.catalog.scans import Subtree, SubtreeEntry, child_extent_rows, file_chunks, listing, paths_of, subtree
from ogrefs.repo.catalog.schema import (FLAG_CHANGED, MAX_CHUNK, NAME_MAX, ROOT_INO, Extent, Inode, Listed,
                                        create_schema, sqlite_utils_module, valid_name)
from ogrefs.repo.catalog.writer import CatalogWriter

__all__ = ["Catalog", "CatalogWriter", "Extent", "FLAG_CHANGED", "Inode", "Listed", "MAX_CHUNK", "NAME_MAX", "ROOT_INO",
           "Subtree", "SubtreeEntry", "child_extent_rows", "create_schema", "file_chunks", "listing", "paths_of",
           "rewrite_blobs", "sqlite_utils_module", "subtree", "valid_name"]
