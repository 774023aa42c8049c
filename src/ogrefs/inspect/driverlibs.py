"""This box's NVIDIA driver libraries, found as nvidia-container-toolkit finds them.

The toolkit (``internal/ldcache``, ``pkg/nvcdi/driver-nvml.go``) reads the
host's dynamic linker cache, takes the directories that hold ``libcuda.so``
and ``libnvidia-ml.so`` there, and injects every ``*.so.<version>`` of the
running kernel module's version from them (``vdpau/`` too), with the
``.so.1``/``.so`` links pointing at them; then it rebuilds the container's
own cache over the container's libraries plus those. ``ogrefs run`` does the
same for the snapshot's root (host-owned rules for these exact paths; a
``/etc/ld.so.conf.d`` file naming their directories; the snapshot's own
``ldconfig``): a driver installed where the default rules do not look
(``/usr/lib64/nvidia``, ``/usr/local/nvidia/lib64``) still reaches the
snapshot, and only the files of the version the kernel runs.

The running version comes from ``/proc/driver/nvidia/version`` (what NVML
reports), else from the name ``libcuda.so.1`` points at. Files only; nothing
is executed or loaded. No state.
"""

from __future__ import annotations

import os
import re
import struct

from ogrefs.inspect.files import open_regular

LD_CACHE = "/etc/ld.so.cache"
PROC_VERSION = "/proc/driver/nvidia/version"
_OLD_MAGIC = b"ld.so-1.7.0"
_NEW_MAGIC = b"glibc-ld.so.cache1.1"
_KMOD = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)")
#: the libraries whose directories are the driver's (as the toolkit's driver-root locator does)
ANCHORS = ("libcuda.so", "libnvidia-ml.so")
MAX_CACHE_BYTES = 64 << 20


def read_ld_cache(path: str = LD_CACHE) -> list[tuple[str, str]]:
    """(library name, path) of every ELF entry of a glibc linker cache (the new format, alone or after the
    old one); [] for a missing or malformed file (a wrong offset is skipped, never followed)."""
    try:
        with open_regular(path, "rb", follow=True) as f:
            data = f.read(MAX_CACHE_BYTES)
    except OSError:
        return []
    start = 0
    if data.startswith(_OLD_MAGIC):
        (n,) = struct.unpack_from("<I", data, len(_OLD_MAGIC) + 1)
        start = len(_OLD_MAGIC) + 1 + 4 + 12 * n
        start += -start % 8  # the new header is 8-byte aligned
    if data[start:start + len(_NEW_MAGIC)] != _NEW_MAGIC:
        return []
    nlibs = struct.unpack_from("<I", data, start + len(_NEW_MAGIC))[0]
    header, size = 48, 24  # magic+version 20, nlibs, table size, 3 unused, 8 of alignment; entry: 4+4+4+4+8
    out = []
    for i in range(min(nlibs, (len(data) - start - header) // size)):
        flags, key, value = struct.unpack_from("<iII", data, start + header + i * size)
        if not flags & 0x0001:  # not ELF (FLAG_ELF, FLAG_ELF_LIBC5, FLAG_ELF_LIBC6 have this bit)
            continue
        name, lib = _string(data, start + key), _string(data, start + value)
        if name and lib:
            out.append((name, lib))
    return out


def _string(data: bytes, at: int) -> str | None:
    if not 0 <= at < len(data):
        return None
    end = data.find(b"\0", at)
    return os.fsdecode(data[at:end]) if end > at else None


def running_version(path: str = PROC_VERSION) -> str | None:
    """``550.54.15``: the loaded kernel module's version, or None (no module, no driver)."""
    try:
        with open_regular(path, "r", follow=True, encoding="utf-8", errors="replace") as f:
            m = _KMOD.search(f.read(4096))
    except OSError:
        return None
    return m.group(1) if m else None


def driver_libraries(cache: list[tuple[str, str]] | None = None, version: str | None = None,
                     proc_version: str = PROC_VERSION) -> tuple[str | None, list[str]]:
    """The running driver's version and its library files and links on this box (absolute paths, sorted)."""
    entries = read_ld_cache() if cache is None else cache
    anchors = [lib for name, lib in entries if name.startswith(ANCHORS)]
    version = version or running_version(proc_version) or _linked_version(anchors)
    if not version:
        return None, []
    suffix = f".so.{version}"
    dirs = sorted({os.path.dirname(lib) for lib in anchors})
    found: set[str] = set()
    for d in dirs + [os.path.join(d, "vdpau") for d in dirs]:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        files = {n for n in names if n.endswith(suffix)}
        found |= {os.path.join(d, n) for n in files}
        for n in names:  # libcuda.so.1 -> libcuda.so.550.54.15, libcuda.so -> libcuda.so.1
            link = os.path.join(d, n)
            if n not in files and os.path.islink(link) and os.path.basename(os.path.realpath(link)) in files:
                found.add(link)
    return version, sorted(found)


def _linked_version(anchors: list[str]) -> str | None:
    for lib in anchors:
        m = re.search(r"\.so\.(\d+\.\d+(?:\.\d+)?)$", os.path.realpath(lib))
        if m:
            return m.group(1)
    return None
