"""GPU facts through NVML (the ``pynvml`` module of nvidia-ml-py).

No GPU, no driver and no pynvml are ordinary answers, returned as
``{"available": False, "reason": ...}``.  NVML can hang when a driver
is wedged, so the query runs in a daemon thread and the caller waits at
most ``timeout_s``.  A thread stuck inside NVML cannot be interrupted; it
is left behind (daemon, so it never blocks exit), remembered, and later
probes answer at once instead of starting another one that would hang
the same way.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

__all__ = ["GpuProbe", "probe_gpus", "cuda_version_text"]

_stuck_lock = threading.Lock()
_stuck: threading.Thread | None = None


def import_pynvml():
    """Import pynvml: what GpuProbe loads NVML with unless given another loader (tests give a fake)."""
    import pynvml

    return pynvml


def _text(v) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def cuda_version_text(v: int) -> str:
    """NVML's integer CUDA version (12040) as text ("12.4")."""
    return f"{v // 1000}.{(v % 1000) // 10}"


_ARCH = {
    "3": "Kepler", "5": "Maxwell", "6": "Pascal", "7.0": "Volta", "7.2": "Volta",
    "7.5": "Turing", "8.0": "Ampere", "8.6": "Ampere", "8.7": "Ampere",
    "8.9": "Ada Lovelace", "9.0": "Hopper", "10.0": "Blackwell",
    "10.1": "Blackwell", "12.0": "Blackwell",
}


def _arch_name(cc: str) -> str | None:
    return _ARCH.get(cc) or _ARCH.get(cc.split(".")[0])


def _query(nvml) -> dict:
    nvml.nvmlInit()
    try:
        out: dict = {"available": False, "source": "nvml"}
        out["driver_version"] = _text(nvml.nvmlSystemGetDriverVersion())
        try:
            fn = getattr(nvml, "nvmlSystemGetCudaDriverVersion_v2", None) or nvml.nvmlSystemGetCudaDriverVersion
            out["cuda_driver_version"] = cuda_version_text(int(fn()))
        except Exception as exc:  # old drivers lack the call
            out["cuda_driver_version"] = None
            out["cuda_driver_error"] = str(exc)
        count = int(nvml.nvmlDeviceGetCount())
        devices = []
        for i in range(count):
            dev: dict = {"index": i}
            try:
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                dev["name"] = _text(nvml.nvmlDeviceGetName(h))
                dev["memory_bytes"] = int(nvml.nvmlDeviceGetMemoryInfo(h).total)
                try:
                    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
                    cc = f"{major}.{minor}"
                    dev["compute_capability"] = cc
                    dev["architecture"] = _arch_name(cc)
                except Exception:
                    dev["compute_capability"] = None
            except Exception as exc:
                dev["error"] = str(exc) or type(exc).__name__
            devices.append(dev)
        out["count"] = count
        out["devices"] = devices
        if count:
            out["available"] = True
        else:
            out["reason"] = "the NVIDIA driver reports no GPUs"
        return out
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _unavailable(reason: str, **extra) -> dict:
    return {"available": False, "reason": reason, "count": 0, **extra}


class GpuProbe:
    """One NVML query in a background thread; ``result()`` waits a bounded time."""

    def __init__(self, load_nvml: Callable[[], Any] = import_pynvml) -> None:
        self._load_nvml = load_nvml
        self._result: dict | None = None
        self._started = time.monotonic()
        self._thread: threading.Thread | None = None
        with _stuck_lock:
            if _stuck is not None and _stuck.is_alive():
                self._result = _unavailable("an earlier NVML query is still stuck; not asking again")
                return
        self._thread = threading.Thread(target=self._run, name="ogrefs-nvml-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            nvml = self._load_nvml()
        except ImportError as exc:
            self._result = _unavailable(f"pynvml (nvidia-ml-py) is not installed: {exc}")
            return
        except Exception as exc:
            self._result = _unavailable(f"pynvml failed to import: {exc}")
            return
        try:
            self._result = _query(nvml)
        except Exception as exc:
            msg = str(exc) or type(exc).__name__
            self._result = _unavailable(f"NVML: {msg}")

    def result(self, timeout_s: float) -> dict:
        global _stuck
        if self._thread is not None:
            self._thread.join(max(0.0, timeout_s))
            if self._thread.is_alive():
                with _stuck_lock:
                    _stuck = self._thread
                waited = time.monotonic() - self._started
                return _unavailable(f"NVML did not answer within {waited:.1f} s", timed_out=True)
        res = dict(self._result or _unavailable("NVML probe gave no answer"))
        res.setdefault("count", 0)
        return res


def probe_gpus(timeout_s: float = 5.0, load_nvml: Callable[[], Any] = import_pynvml) -> dict:
    """GPU model, memory, driver and CUDA driver version; never raises."""
    return GpuProbe(load_nvml).result(timeout_s)
