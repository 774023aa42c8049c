"""Hand-made environment files and manifests: checkpoints, virtualenvs, GPU records."""

from __future__ import annotations

import json
import os
import struct


def write(path, data: bytes | str = b"") -> str:
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return str(path)


def safetensors(path, nbytes: int = 16) -> str:
    h = json.dumps({"w": {"dtype": "F32", "shape": [nbytes // 4], "data_offsets": [0, nbytes]}}).encode()
    return write(path, struct.pack("<Q", len(h)) + h + b"\0" * nbytes)


def hf_ckpt(run, step: int) -> str:
    d = os.path.join(str(run), f"checkpoint-{step}")
    safetensors(os.path.join(d, "model.safetensors"))
    write(os.path.join(d, "trainer_state.json"), json.dumps({"global_step": step, "epoch": 1.0}))
    return d


def venv(root, packages: dict[str, str]) -> str:
    v = os.path.join(str(root), "venv")
    write(os.path.join(v, "pyvenv.cfg"), "home = /usr/bin\nversion = 3.11.4\n")
    site = os.path.join(v, "lib", "python3.11", "site-packages")
    os.makedirs(site, exist_ok=True)
    for name, ver in packages.items():
        write(os.path.join(site, f"{name}-{ver}.dist-info", "METADATA"), f"Name: {name}\nVersion: {ver}\n")
    return v


def manifest(gpus=None, arch="x86_64", torch_cuda="12.1") -> dict:
    return {
        "machine": {"arch": arch, "hostname": "h"},
        "gpus": gpus if gpus is not None else h100(8),
        "python_envs": [{"path": "/opt/venv", "packages": {}, "torch": {"version": "2.1.0+cu121", "cuda": torch_cuda}}],
    }


def h100(n, name="NVIDIA H100 80GB HBM3", cc="9.0", cuda="12.4", driver="550.54.15") -> dict:
    return {
        "available": True, "count": n, "driver_version": driver, "cuda_driver_version": cuda,
        "devices": [{"index": i, "name": name, "memory_bytes": 80 << 30, "compute_capability": cc} for i in range(n)],
    }
