"""CUDA toolkit, cuDNN and NCCL versions, read from files on disk.

* A toolkit directory (``/usr/local/cuda-12.1``), first answer wins:
  ``version.json`` (``{"cuda": {"version": "12.1.1"}}``, CUDA >= 11.1),
  ``version.txt`` (``CUDA Version 10.2.89``), a
  ``dist-info/nvidia_cuda_runtime-X.Y.Z.dist-info`` directory (toolkits
  assembled from wheels), a ``libcudart.so.X.Y.Z`` name, then
  ``#define CUDART_VERSION 12010`` in ``include/cuda_runtime_api.h``.
* cuDNN / NCCL: the ``#define CUDNN_MAJOR 8`` ... lines of
  ``cudnn_version.h`` (``cudnn.h`` before cuDNN 8) and ``NCCL_MAJOR``...
  of ``nccl.h``.
* Library files: names such as ``libcudart.so.12.1.105`` carry a version.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Iterable

from ogrefs.inspect.files import open_regular

__all__ = [
    "read_toolkit",
    "read_header_version",
    "header_versions",
    "cuda_library_name",
    "local_toolkits",
    "HEADER_NAMES",
]

#: Header files that carry versions, and the macro prefix in each.
HEADER_NAMES = {
    b"cudnn_version.h": ("cudnn", "CUDNN"),
    b"cudnn_version_v8.h": ("cudnn", "CUDNN"),
    b"cudnn_version_v9.h": ("cudnn", "CUDNN"),
    b"nccl.h": ("nccl", "NCCL"),
}

_LIB_RE = re.compile(
    rb"^lib(cudart|cublas|cublasLt|cudnn[A-Za-z_]*|nccl|cufft|cufftw|curand|cusparse|cusparseLt"
    rb"|cusolver|cusolverMg|nvrtc|nvrtc-builtins|nvJitLink|cupti|nvToolsExt|nvjpeg|cufile|npp[a-z]*)"
    rb"(?:-[0-9a-f]{8})?\.so(?:\.[0-9.]+)?$"
)
_SO_VERSION_RE = re.compile(r"\.so\.([0-9][0-9.]*)$")


def cuda_library_name(name: bytes) -> str | None:
    """The library stem ("cudart") if ``name`` is a CUDA toolkit library file."""
    m = _LIB_RE.match(name)
    return m.group(1).decode() if m else None


def so_version(name: str) -> str | None:
    m = _SO_VERSION_RE.search(name)
    return m.group(1) if m else None


def read_header_version(path: str, prefix: str) -> str | None:
    """``MAJOR.MINOR.PATCH`` from ``#define <prefix>_MAJOR 8`` style lines."""
    try:
        with open_regular(path, follow=True) as f:
            text = f.read(256 * 1024).decode("latin-1")
    except OSError:
        return None
    parts = []
    for field in ("MAJOR", "MINOR", ("PATCHLEVEL", "PATCH")):
        names = field if isinstance(field, tuple) else (field,)
        value = None
        for nm in names:
            m = re.search(rf"^\s*#\s*define\s+{prefix}_{nm}\s+(\d+)", text, re.M)
            if m:
                value = m.group(1)
                break
        if value is None:
            break
        parts.append(value)
    return ".".join(parts) if parts else None


def header_versions(headers: Iterable[tuple[str, str, str]],
                    expired: Callable[[], bool] = lambda: False) -> dict[str, list[dict]]:
    """``{"cudnn": [...], "nccl": [...]}`` from ``(path, what, macro)`` of version headers, one entry per
    directory and version: cuDNN 9 ships ``cudnn_version.h`` and ``cudnn_version_v9.h`` side by side
    (seen in the nvidia-cudnn-cu13 wheel), which is one cuDNN, not two."""
    found: dict[str, list[dict]] = {"cudnn": [], "nccl": []}
    seen: set[tuple[str, str, str]] = set()
    for path, what, macro in headers:
        if expired():
            break
        v = read_header_version(path, macro)
        key = (what, os.path.dirname(path), v or "")
        if v and key not in seen:
            seen.add(key)
            found[what].append({"path": path, "version": v})
    return found


def read_toolkit(path: str) -> dict:
    """Version of the CUDA toolkit at ``path`` (a directory or a link to one)."""
    out: dict = {"path": path, "version": None, "source": None}
    if os.path.islink(path):
        try:
            out["link_target"] = os.readlink(path)
        except OSError:
            pass
    try:
        with open_regular(os.path.join(path, "version.json"), follow=True) as f:
            data = json.loads(f.read(1 << 20))
        v = data.get("cuda", {}).get("version")
        if isinstance(v, str):
            out["version"], out["source"] = v, "version.json"
            return out
    except (OSError, ValueError, AttributeError):
        pass
    try:
        with open_regular(os.path.join(path, "version.txt"), "r", follow=True, encoding="utf-8", errors="replace") as f:
            m = re.search(r"CUDA Version\s+([0-9][0-9.]*)", f.read(4096))
        if m:
            out["version"], out["source"] = m.group(1), "version.txt"
            return out
    except OSError:
        pass
    # Toolkits assembled from NVIDIA wheels keep their dist-info directories.
    try:
        infos = sorted(os.listdir(os.path.join(path, "dist-info")))
    except OSError:
        infos = []
    for part in ("runtime", "nvcc"):
        for n in infos:
            m = re.match(rf"^nvidia_cuda_{part}(?:_cu\d+)?-([0-9][0-9.]*[0-9])\.dist-info$", n)
            if m:
                out["version"], out["source"] = m.group(1), f"dist-info/{n}"
                return out
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
        try:
            names = os.listdir(os.path.join(path, sub))
        except OSError:
            continue
        for n in sorted(names):
            if n.startswith("libcudart.so."):
                v = so_version(n)
                if v and v.count(".") >= 1:
                    out["version"], out["source"] = v, f"{sub}/{n}"
                    return out
    for header, macro in (("cuda_runtime_api.h", "CUDART_VERSION"), ("cuda.h", "CUDA_VERSION")):
        try:
            with open_regular(os.path.join(path, "include", header), follow=True) as f:
                text = f.read(512 * 1024).decode("latin-1")
        except OSError:
            continue
        m = re.search(rf"^\s*#\s*define\s+{macro}\s+(\d+)", text, re.M)
        if m:
            v = int(m.group(1))
            out["version"], out["source"] = f"{v // 1000}.{(v % 1000) // 10}", f"include/{header}"
            return out
    return out


def local_toolkits(root: str = "/usr/local") -> list[dict]:
    """CUDA toolkits installed as ``<root>/cuda*`` on this machine."""
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith("cuda"))
    except OSError:
        return []
    return [read_toolkit(os.path.join(root, n)) for n in names if os.path.isdir(os.path.join(root, n))]
