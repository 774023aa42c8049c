"""Read the code a command is about to import into the page cache, many files at once.

A command's imports read a few hundred small files one after another: each
import opens its ``.pyc`` (or maps its ``.so``), runs it, then asks for the
next.  With a warm page cache that costs nothing; with a cold one (a box that
just booted, an image on a network disk, a box whose page cache other work
keeps evicting) every file is one synchronous read, and behind a busy disk
each waits its turn in the queue.  Measured on the 2-core lab box with a disk
writer, a page-cache hog and a CPU loop beside it (docs/benchmarks.md, "A
mount's start on a busy box"): the ~490 files of a mount's imports took
1.4-2.6 s read one at a time and 0.36-0.45 s read by 16 threads at once.

So the command line starts :func:`start` first thing: worker threads find the
files of the modules listed here (:data:`PACKAGES`, walked whole but for
their tests and data; :data:`MODULES`, one file each; both without importing
anything) and ask the kernel to read each ahead (``posix_fadvise``
``WILLNEED``, which also brings in the inode and directory on the way),
while the main thread goes on importing.  It first probes a sample (each
package's ``__init__`` and every fourth module, found without walking a
directory; a one-byte read that may not wait, ``RWF_NOWAIT``): when all of
them are in the page cache it stops there, since on a warm cache the walk
and the reads ahead would only take the GIL from the imports.  Whatever the list misses is read
by the import as before; whatever it names needlessly costs a read ahead,
never a behaviour.  Nothing here can fail a command: every error is
ignored, and the threads are daemons that never hold anything the command
waits for.

Who owns what: :func:`start` hands each thread an immutable tuple of names;
the threads share nothing but a ``queue.SimpleQueue`` of paths (thread-safe)
and write nothing but the page cache.  ``OGREFS_PRELOAD=0`` turns it off.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import sys
import threading

#: Packages a mount, a snapshot, a restore or the agent imports (their whole directory, but tests and data) ...
PACKAGES = (
    "ogrefs", "click", "botocore", "urllib3", "dateutil", "jmespath", "pyfuse3", "trio", "attr", "attrs",
    "outcome", "sniffio", "sortedcontainers", "idna", "six", "zstandard", "blake3", "pyfastcdc",
    # the standard library's packages
    "collections", "concurrent", "ctypes", "email", "html", "http", "importlib", "json",
    "logging", "re", "sqlite3", "urllib", "xml.etree",
)
#: ... and single modules (the standard library's, mostly; an extension module's ``.so`` as well).
MODULES = (
    "__future__", "_compat_pickle", "_compression", "_markupbase", "_weakrefset", "ast", "base64", "bisect",
    "bz2", "calendar", "configparser", "contextlib", "contextvars", "copy", "copyreg", "csv", "dataclasses",
    "datetime", "decimal", "dis", "enum", "fnmatch", "functools", "getpass", "gettext", "gzip", "hashlib",
    "heapq", "hmac", "inspect", "ipaddress", "keyword", "linecache", "locale", "lzma", "mimetypes",
    "numbers", "opcode", "operator", "pathlib", "pickle", "platform", "queue", "quopri", "random",
    "reprlib", "secrets", "selectors", "shlex", "shutil", "signal", "socket", "ssl", "string", "stringprep",
    "struct", "subprocess", "tempfile", "textwrap", "threading", "token", "tokenize", "traceback", "types",
    "typing", "uuid", "warnings", "weakref", "xml", "zipfile", "ntpath", "encodings.idna", "grp", "mmap",
    "pickletools", "resource", "glob", "typing_extensions",
    "_bisect", "_blake2", "_bz2", "_contextvars", "_csv", "_ctypes", "_datetime", "_decimal", "_elementtree",
    "_hashlib", "_heapq", "_json", "_lzma", "_opcode", "_pickle", "_posixsubprocess", "_queue", "_random",
    "_sha512", "_socket", "_sqlite3", "_ssl", "_struct", "_typing", "_uuid", "array", "binascii", "fcntl",
    "math", "pyexpat", "select", "termios", "unicodedata", "zlib",
)
#: Directories of a package that its imports never read.
_SKIP_DIRS = frozenset({"tests", "_tests", "test", "testing", "data", "examples"})
#: Files of a package's data directory that an S3 client does read (botocore's loader).
_DATA_FILES = {"botocore": ("data/endpoints.json", "data/partitions.json", "data/sdk-default-configuration.json",
                            "data/_retry.json", "data/s3")}
#: Files a package ships that its imports never read (zstandard's CFFI backend beside its C one).
_SKIP_FILES = ("_cffi.",)
THREADS = 8


def start(packages: tuple[str, ...] = PACKAGES, modules: tuple[str, ...] = MODULES,
          threads: int = THREADS) -> list[threading.Thread]:
    """Begin reading ahead in the background; returns the threads (nobody waits for them but tests)."""
    if os.environ.get("OGREFS_PRELOAD", "1") == "0" or not hasattr(os, "posix_fadvise"):
        return []
    paths: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    started = [threading.Thread(target=_find_all, args=(packages, modules, paths, threads),
                                name="ogrefs-preload-find", daemon=True)]
    started += [threading.Thread(target=_advise_each, args=(paths,), name="ogrefs-preload", daemon=True)
                for _ in range(threads)]
    for thread in started:
        thread.start()
    return started


def files(packages: tuple[str, ...] = PACKAGES, modules: tuple[str, ...] = MODULES) -> list[str]:
    """Every file :func:`start` reads ahead with a cold page cache, in its order (tests check what it covers)."""
    return list(_all_files(packages, modules))


def _find_all(packages: tuple[str, ...], modules: tuple[str, ...], paths: queue.SimpleQueue, threads: int) -> None:
    """The finder thread: if the probes are all in the page cache, stop; else queue every file."""
    try:
        if all(_resident(path) for path in _probes(packages, modules)):
            return
        for path in _all_files(packages, modules):
            paths.put(path)
    finally:
        for _ in range(threads):
            paths.put(None)


def _probes(packages: tuple[str, ...], modules: tuple[str, ...]):
    """A sample found without walking any directory: each package's ``__init__``, every fourth module."""
    for name in packages:
        for location in _locations(name):
            yield from _cached(os.path.join(location, "__init__.py"))
    for name in modules[::4]:
        yield from _module_files(name)


def _all_files(packages: tuple[str, ...], modules: tuple[str, ...]):
    for name in packages:
        yield from _package_files(name)
    for name in modules:
        yield from _module_files(name)


def _resident(path: str) -> bool:
    """Whether the file's first byte is in the page cache (a read that may not wait, ``RWF_NOWAIT``);
    False where that cannot be told.  On a miss the probe itself starts readahead, which a fast disk can
    finish inside the call: then the answer is True, and the file is being read in anyway."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return True  # nothing to read ahead there either
    try:
        return os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT) >= 0
    except (OSError, AttributeError):  # EAGAIN: not in memory; EOPNOTSUPP: cannot tell
        return False
    finally:
        os.close(fd)


def _advise_each(paths: queue.SimpleQueue) -> None:
    while (path := paths.get()) is not None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def _spec(name: str):
    """A top-level module's spec (finding it imports nothing; a dotted name would import its parents)."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError, AttributeError):
        return None


def _locations(name: str) -> list[str]:
    """The directories of package ``name`` (``a.b``: ``b`` under ``a``'s), found without importing."""
    top, _, rest = name.partition(".")
    spec = _spec(top)
    if spec is None or not spec.submodule_search_locations:
        return []
    return [os.path.join(d, *rest.split(".")) if rest else d for d in spec.submodule_search_locations]


def _cached(source: str) -> list[str]:
    """A ``.py`` file's compiled twin (what an import reads when it is fresh), or the file itself."""
    if source.endswith(".py") and sys.implementation.cache_tag is not None:
        try:
            return [importlib.util.cache_from_source(source)]
        except (NotImplementedError, ValueError):
            pass
    return [source]


def _module_files(name: str) -> list[str]:
    parent, _, leaf = name.rpartition(".")
    if parent:  # a module of a package, found beside the package's files (importing nothing)
        return [c for d in _locations(parent) for c in _cached(os.path.join(d, leaf + ".py"))]
    spec = _spec(name)
    if spec is None or not spec.has_location or not spec.origin:
        return []
    return _cached(spec.origin)


def _package_files(name: str) -> list[str]:
    locations = _locations(name)
    if not locations:
        return _module_files(name) if "." not in name else []
    found: list[str] = []
    tag = sys.implementation.cache_tag or ""
    for top in locations:
        for extra in _DATA_FILES.get(name, ()):
            found.extend(_walk(os.path.join(top, extra), tag, skip=False))
        found.extend(_walk(top, tag, skip=True))
    return found


def _walk(top: str, tag: str, skip: bool) -> list[str]:
    """Compiled modules and extension modules under ``top`` (a ``.py`` itself where it has no compiled
    twin for this interpreter), or the file ``top`` itself; data files too where ``skip`` is False."""
    if os.path.isfile(top):
        return [top]
    found: list[str] = []
    try:
        entries = list(os.scandir(top))
    except OSError:
        return found
    compiled = {e.name.split(".", 1)[0] for entry in entries if entry.name == "__pycache__"
                for e in _scan(entry.path) if e.name.endswith(f".{tag}.pyc")}
    for entry in entries:
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            continue
        name = entry.name
        if is_dir:
            if name == "__pycache__":
                found.extend(e.path for e in _scan(entry.path) if e.name.endswith(f".{tag}.pyc"))
            elif not (skip and name in _SKIP_DIRS):
                found.extend(_walk(entry.path, tag, skip))
        elif name.startswith(_SKIP_FILES):
            continue
        elif name.endswith(".so") or (name.endswith(".py") and name[:-3] not in compiled) or not skip:
            found.append(entry.path)
    return found


def _scan(path: str) -> list[os.DirEntry]:
    try:
        return list(os.scandir(path))
    except OSError:
        return []
