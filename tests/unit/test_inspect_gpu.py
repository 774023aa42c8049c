"""GPU probing through NVML: fakes everywhere, the real thing where a GPU exists."""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from ogrefs.inspect import gpu as gpu_mod
from ogrefs.inspect.gpu import cuda_version_text, probe_gpus


class NVMLError(Exception):
    pass


def fake_nvml(**overrides):
    calls = []
    devices = [
        {"name": b"NVIDIA H100 80GB HBM3", "mem": 80 * 2**30, "cc": (9, 0)},
        {"name": "NVIDIA H100 80GB HBM3", "mem": 80 * 2**30, "cc": (9, 0)},
    ]
    m = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlSystemGetDriverVersion=lambda: b"550.54.15",
        nvmlSystemGetCudaDriverVersion_v2=lambda: 12040,
        nvmlDeviceGetCount=lambda: len(devices),
        nvmlDeviceGetHandleByIndex=lambda i: devices[i],
        nvmlDeviceGetName=lambda h: h["name"],
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=h["mem"], used=0, free=h["mem"]),
        nvmlDeviceGetCudaComputeCapability=lambda h: h["cc"],
    )
    for k, v in overrides.items():
        setattr(m, k, v)
    return m, calls


def test_fake_nvml_is_parsed(monkeypatch):
    nvml, calls = fake_nvml()
    res = probe_gpus(timeout_s=5, load_nvml=lambda: nvml)
    assert res == {
        "available": True, "source": "nvml", "driver_version": "550.54.15",
        "cuda_driver_version": "12.4", "count": 2,
        "devices": [
            {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 2**30,
             "compute_capability": "9.0", "architecture": "Hopper"},
            {"index": 1, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 2**30,
             "compute_capability": "9.0", "architecture": "Hopper"},
        ],
    }
    assert calls == ["init", "shutdown"]


def test_driver_without_gpus(monkeypatch):
    nvml, _ = fake_nvml(nvmlDeviceGetCount=lambda: 0)
    res = probe_gpus(timeout_s=5, load_nvml=lambda: nvml)
    assert res["available"] is False and res["count"] == 0
    assert res["reason"] == "the NVIDIA driver reports no GPUs" and res["driver_version"] == "550.54.15"


def test_nvml_raising_is_unavailable(monkeypatch):
    def boom():
        raise NVMLError("NVML Shared Library Not Found")

    nvml, _ = fake_nvml(nvmlInit=boom)
    t0 = time.monotonic()
    res = probe_gpus(timeout_s=5, load_nvml=lambda: nvml)
    assert time.monotonic() - t0 < 1
    assert res == {"available": False, "reason": "NVML: NVML Shared Library Not Found", "count": 0}


def test_pynvml_missing_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    t0 = time.monotonic()
    res = probe_gpus(timeout_s=5)
    assert time.monotonic() - t0 < 1
    assert res["available"] is False and res["count"] == 0
    assert res["reason"].startswith("pynvml (nvidia-ml-py) is not installed")


def test_hung_nvml_is_abandoned_quickly(monkeypatch):
    release = threading.Event()
    nvml, _ = fake_nvml(nvmlInit=lambda: release.wait(30))
    try:
        t0 = time.monotonic()
        res = probe_gpus(timeout_s=0.3, load_nvml=lambda: nvml)
        assert time.monotonic() - t0 < 1.5
        assert res["available"] is False and res["timed_out"] is True
        assert res["reason"].startswith("NVML did not answer within")
        # The stuck thread is remembered: the next probe answers at once.
        t0 = time.monotonic()
        again = probe_gpus(timeout_s=5, load_nvml=lambda: nvml)
        assert time.monotonic() - t0 < 0.2
        assert "still stuck" in again["reason"]
    finally:
        release.set()
        stuck = gpu_mod._stuck
        if stuck is not None:
            stuck.join(5)
    # Once it came back, probing works again.
    assert probe_gpus(timeout_s=5, load_nvml=lambda: nvml)["available"] is True


def test_cuda_version_text():
    assert cuda_version_text(12040) == "12.4"
    assert cuda_version_text(11080) == "11.8"
    assert cuda_version_text(13000) == "13.0"


def test_real_probe_is_fast_and_well_formed():
    t0 = time.monotonic()
    res = probe_gpus(timeout_s=10)
    assert time.monotonic() - t0 < 10.5
    assert isinstance(res["available"], bool) and isinstance(res["count"], int)
    if not res["available"]:
        assert isinstance(res["reason"], str) and res["reason"]


def test_real_gpu_is_described():
    res = probe_gpus(timeout_s=10)
    if not res["available"]:
        pytest.skip(f"no usable GPU here: {res['reason']}")
    assert res["count"] >= 1 and len(res["devices"]) == res["count"]
    assert res["driver_version"] and res["cuda_driver_version"]
    for d in res["devices"]:
        assert d["name"] and d["memory_bytes"] > 2**30
        assert d["compute_capability"] and "." in d["compute_capability"]
