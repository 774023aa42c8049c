#!/usr/bin/env python3
"""Generate a box-like training tree: a venv, code, data shards and checkpoints.

Used by scripts/demo (small) and the benchmarks (large).  Deterministic for a
given seed, so two runs build byte-identical trees.

    make_box.py ROOT [--venv-packages "torch==2.13.0"] [--data-mb 64] [--ckpt-mb 32] [--ckpts 2]
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import subprocess
import sys
import zipfile
from pathlib import Path


def _bytes(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(n)


def weights_like(rng: random.Random, n: int) -> bytes:
    """fp32-looking data: random mantissas, clustered exponents (zstd saves ~10 %)."""
    raw = bytearray(rng.randbytes(n))
    raw[3::4] = bytes(0x3C + (b & 1) for b in raw[3::4])
    return bytes(raw)


def torch_like_checkpoint(path: Path, rng: random.Random, size: int, step: int) -> None:
    """A zip laid out like torch.save output (uncompressed members)."""
    name = path.stem
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        record = {"model": {f"layer{i}.weight": f"storage {i}" for i in range(4)},
                  "optimizer": {"state": {}, "param_groups": [{"lr": 3e-4}]}, "step": step, "epoch": step // 1000}
        zf.writestr(f"{name}/data.pkl", pickle.dumps(record, protocol=2))
        zf.writestr(f"{name}/byteorder", b"little")
        per = max(1, size // 4)
        for i in range(4):
            zf.writestr(f"{name}/data/{i}", weights_like(rng, per))
        zf.writestr(f"{name}/version", b"3\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path)
    ap.add_argument("--venv-packages", default="", help="pip requirement(s) to install into the venv")
    ap.add_argument("--data-mb", type=int, default=16)
    ap.add_argument("--ckpt-mb", type=int, default=8)
    ap.add_argument("--ckpts", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    root: Path = args.root
    root.mkdir(parents=True, exist_ok=True)

    venv = root / "venv"
    if not venv.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        if args.venv_packages:
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *args.venv_packages.split()], check=True)

    code = root / "code"
    code.mkdir(exist_ok=True)
    (code / "train.py").write_text(
        "import json, pathlib\n"
        "ckpts = sorted(pathlib.Path(__file__).parent.parent.glob('checkpoints/step_*.pt'))\n"
        "print('resuming from', ckpts[-1].name if ckpts else None)\n"
    )
    (code / "config.json").write_text(json.dumps({"lr": 3e-4, "batch": 64, "model": "tiny"}, indent=1))
    for i in range(50):
        (code / f"module_{i:02d}.py").write_text(f"# module {i}\n" + "x = 1\n" * rng.randint(10, 400))

    data = root / "data"
    data.mkdir(exist_ok=True)
    shard = 4 * 1024 * 1024
    for i in range(max(1, args.data_mb * 1024 * 1024 // shard)):
        p = data / f"shard-{i:05d}.bin"
        if not p.exists():
            p.write_bytes(_bytes(rng, shard))

    ck = root / "checkpoints"
    ck.mkdir(exist_ok=True)
    for s in range(1, args.ckpts + 1):
        step = s * 1000
        p = ck / f"step_{step:06d}.pt"
        if not p.exists():
            torch_like_checkpoint(p, rng, args.ckpt_mb * 1024 * 1024, step)
    (ck / "latest").write_text(f"step_{args.ckpts * 1000:06d}.pt\n")
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    (logs / "train.log").write_text("".join(f"step {i} loss {1 / (i + 1):.4f}\n" for i in range(5000)))


if __name__ == "__main__":
    main()
