"""The repository layer: config, packs, the chunk index, catalogs and manifests.

It sits on a :class:`ogrefs.store.base.Store` and knows the repository format
(docs/format.md); it knows nothing about file trees or FUSE.
"""

from ogrefs.repo.repository import Repository, default_cache_dir

__all__ = ["Repository", "default_cache_dir"]
