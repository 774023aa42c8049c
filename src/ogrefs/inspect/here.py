"""This box, for the checks before a restore or mount: machine, GPUs, CUDA.

Kept apart from :mod:`ogrefs.inspect.probe` (the snapshot walk's collector,
which pulls in the Python-env, git and checkpoint readers) so that a mount's
compatibility check imports only what it runs.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from ogrefs.inspect.cuda import HEADER_NAMES, header_versions, local_toolkits
from ogrefs.inspect.gpu import GpuProbe, import_pynvml
from ogrefs.inspect.machine import machine_info

MANIFEST_VERSION = 1
GPU_TIMEOUT_S = 5.0


def probe_local_machine(gpu_timeout_s: float = GPU_TIMEOUT_S, load_nvml: Callable[[], Any] = import_pynvml) -> dict:
    """Machine, GPUs and CUDA of the running box (for restore-time checks)."""
    gpu_probe = GpuProbe(load_nvml)
    machine = machine_info()
    found = header_versions((os.path.join(d, header.decode()), what, macro)
                            for d in ("/usr/include", "/usr/include/x86_64-linux-gnu", "/usr/include/aarch64-linux-gnu",
                                      "/usr/local/cuda/include")
                            for header, (what, macro) in HEADER_NAMES.items())
    return {
        "version": MANIFEST_VERSION,
        "machine": machine,
        "gpus": gpu_probe.result(gpu_timeout_s),
        "cuda": {"toolkits": local_toolkits(), "cudnn": found["cudnn"], "nccl": found["nccl"]},
    }
