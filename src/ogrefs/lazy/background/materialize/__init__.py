"""Background materialization: copy a mounted snapshot, all of it, into a local tree while it is in use.

After a mount is ready, a :class:`~ogrefs.lazy.background.materialize.materializer.Materializer`
fetches every chunk of the snapshot through the mount's
:class:`~ogrefs.lazy.fetch.fetcher.Fetcher` and writes it into ``<state_dir>/tree/``,
a real local copy of the snapshot tree (directories, sparse regular files,
symlinks, FIFOs, device nodes where permitted, hardlinks as hardlinks).  Once a
file's data is all local, its owner, mode, xattrs and times are applied and the
vfs serves it from the local file; once everything is local, directories get
their metadata and the store is never contacted again.

Order: the access trace of the last run first (``Priority.TRACE``), then the
catalog's prefetch hints (``Priority.HINT``), then everything else in pack
order (``Priority.BACKGROUND``); readers always go first.

Adoption: a chunk fetched from the store for a reader while a pass runs is
adopted by the :class:`~ogrefs.lazy.fetch.residency.Residency` and written into the
tree at once by the same durable batch write, instead of going to the chunk
cache.  A chunk is claimed by one writer only.

Modules, one side of the thread boundary each:

* :mod:`.plan`     the SQLite plan (worker threads; one connection per thread);
* :mod:`.build`    preparing: the tree and the plan built or reopened (one worker thread; returns a frozen result);
* :mod:`.space`    the disk-space policy (needs vs. free, "disk full");
* :mod:`.writer`   durable batch writes and metadata (worker threads, one at a time);
* :mod:`.pipeline` one pass: feeder, collector, writers (the trio loop);
* :mod:`.pacing`   the pause after each batch while an application uses the mount (the trio loop);
* :mod:`.materializer` the facade: lifecycle, progress, the vfs's questions (the trio loop).

Durability and disk space are described in :mod:`.writer` and :mod:`.space`;
docs/architecture.md and docs/reliability.md give the whole picture.
"""
