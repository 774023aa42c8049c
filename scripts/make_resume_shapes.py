#!/usr/bin/env python3
"""Build the resume benchmark's other box shapes (issue 17); `classic` is make_resume_box.py.

    make_resume_shapes.py pointer ROOT [--scale 1.0]
    make_resume_shapes.py hf ROOT [--scale 1.0]

pointer -- like a hand-written training loop: ten checkpoints of ~300 MB
    (model + Adam state + RNG) named ``ckpt-NNNNNN.pt`` with a ``latest``
    pointer file, 240 data shards of 8 MiB as ``.npy``; the step imports torch
    and numpy, ``torch.load``s the checkpoint the pointer names, opens one
    shard with ``np.load(mmap_mode="r")`` and trains one step.
hf -- like a Hugging Face Trainer run: ``checkpoint-N/`` directories (the
    three newest, as ``save_total_limit=3`` keeps) holding
    ``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``,
    ``rng_state.pth``, ``trainer_state.json``, and a ``tokenizer/``
    directory; 32 data shards of 64 MiB. The step picks the newest
    checkpoint as ``get_last_checkpoint`` does (highest N), loads the model
    with safetensors, the optimizer, scheduler and RNG with torch, reads the
    tokenizer and one shard, and trains one step.

Both print ``step N loss X`` like the classic box, so bench_resume's checks
apply. ``--scale`` shrinks counts and sizes for a quick try (0.05 builds a
few hundred MB). Building is idempotent: what exists is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MODEL = r'''
import torch
WIDTH = 2048
def model(params_m):
    layers = max(1, params_m * 1_000_000 // (WIDTH * WIDTH))
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
'''

POINTER_TRAIN = MODEL + r'''
import pathlib, sys, time
t0 = time.time()
import numpy as np
root = pathlib.Path(__file__).resolve().parent.parent
m = model({params_m})
opt = torch.optim.Adam(m.parameters(), lr=1e-4)
name = (root / "checkpoints" / "latest").read_text().strip()
state = torch.load(root / "checkpoints" / name, map_location="cpu", weights_only=True)
m.load_state_dict(state["model"])
opt.load_state_dict(state["optimizer"])
torch.set_rng_state(state["rng"])
step = state["step"]
shard = np.load(root / "data" / f"shard-{{step % {shards}:04d}}.npy", mmap_mode="r")
x = torch.from_numpy(np.ascontiguousarray(shard[:64])).float() / 255.0
loss = m(x).pow(2).mean()
opt.zero_grad(); loss.backward(); opt.step()
print(f"step {{step + 1}} loss {{loss.item():.6f}} ({{time.time() - t0:.2f}} s in python)", flush=True)
'''

HF_TRAIN = MODEL + r'''
import json, pathlib, re, time
t0 = time.time()
from safetensors.torch import load_file
root = pathlib.Path(__file__).resolve().parent.parent
out = root / "output"
ckpt = max((p for p in out.iterdir() if re.fullmatch(r"checkpoint-\d+", p.name)),
           key=lambda p: int(p.name.split("-")[1]))
m = model({params_m})
m.load_state_dict(load_file(ckpt / "model.safetensors"))
opt = torch.optim.Adam(m.parameters(), lr=1e-4)
opt.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True))
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
sched.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=True))
torch.set_rng_state(torch.load(ckpt / "rng_state.pth", weights_only=True)["cpu"])
state = json.loads((ckpt / "trainer_state.json").read_text())
vocab = json.loads((root / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
step = state["global_step"]
with open(root / "data" / f"train-{{step % {shards}:05d}}-of-{shards:05d}.bin", "rb") as fh:
    raw = torch.frombuffer(bytearray(fh.read(64 * WIDTH)), dtype=torch.uint8)
x = raw.float().view(64, WIDTH) / 255.0
loss = m(x).pow(2).mean() + 0.0 * len(vocab)
opt.zero_grad(); loss.backward(); opt.step(); sched.step()
print(f"step {{step + 1}} loss {{loss.item():.6f}} ({{time.time() - t0:.2f}} s in python)", flush=True)
'''

MAKE_POINTER_CKPT = MODEL + r'''
import sys
m = model(int(sys.argv[3])); opt = torch.optim.Adam(m.parameters(), lr=1e-4)
for p in m.parameters():
    p.grad = torch.randn_like(p)
opt.step()
torch.save({"model": m.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
            "step": int(sys.argv[2])}, sys.argv[1])
'''

MAKE_HF_CKPT = MODEL + r'''
import json, pathlib, sys
from safetensors.torch import save_file
d = pathlib.Path(sys.argv[1]); step = int(sys.argv[2]); d.mkdir(parents=True, exist_ok=True)
m = model(int(sys.argv[3])); opt = torch.optim.Adam(m.parameters(), lr=1e-4)
for p in m.parameters():
    p.grad = torch.randn_like(p)
opt.step()
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
save_file({k: v.contiguous() for k, v in m.state_dict().items()}, d / "model.safetensors")
torch.save(opt.state_dict(), d / "optimizer.pt")
torch.save(sched.state_dict(), d / "scheduler.pt")
torch.save({"cpu": torch.get_rng_state()}, d / "rng_state.pth")
(d / "trainer_state.json").write_text(json.dumps({"global_step": step, "epoch": step / 1000,
                                                 "log_history": [{"step": step, "loss": 1.0}]}))
(d / "training_args.bin").write_bytes(b"\0" * 4096)
'''


def ensure_venv(root: Path, extra: list[str]) -> Path:
    venv = root / "venv"
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "torch==2.13.0", *extra], check=True)
    return py


def random_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as w:
        left = size
        while left:
            n = min(left, 1 << 20)
            w.write(os.urandom(n))
            left -= n
    tmp.rename(path)


def run_helper(py: Path, root: Path, code: str, *args: str) -> None:
    helper = root / ".make_helper.py"
    helper.write_text(code)
    try:
        subprocess.run([str(py), str(helper), *args], check=True)
    finally:
        helper.unlink()


def npy_shard(path: Path, rows: int) -> None:
    """An 8 MiB (at scale 1) uint8 .npy of random bytes, written without numpy in this python."""
    header = "{'descr': '|u1', 'fortran_order': False, 'shape': (%d, 2048), }" % rows
    pad = 64 - (10 + len(header) + 1) % 64
    head = b"\x93NUMPY\x01\x00" + (len(header) + pad + 1).to_bytes(2, "little") + header.encode() + b" " * pad + b"\n"
    if path.exists() and path.stat().st_size == len(head) + rows * 2048:
        return
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as w:
        w.write(head)
        w.write(os.urandom(rows * 2048))
    tmp.rename(path)


def build_pointer(root: Path, scale: float) -> None:
    params_m = max(1, round(25 * scale))
    shards = max(4, round(240 * scale))
    py = ensure_venv(root, ["numpy"])
    (root / "code").mkdir(parents=True, exist_ok=True)
    (root / "code" / "train.py").write_text(POINTER_TRAIN.format(params_m=params_m, shards=shards))
    data = root / "data"
    data.mkdir(exist_ok=True)
    for i in range(shards):
        npy_shard(data / f"shard-{i:04d}.npy", 4096)
    ck = root / "checkpoints"
    ck.mkdir(exist_ok=True)
    n = max(2, round(10 * scale))
    for s in range(1, n + 1):
        p = ck / f"ckpt-{s * 500:06d}.pt"
        if not p.exists():
            run_helper(py, root, MAKE_POINTER_CKPT, str(p), str(s * 500), str(params_m))
    (ck / "latest").write_text(f"ckpt-{n * 500:06d}.pt\n")


def build_hf(root: Path, scale: float) -> None:
    params_m = max(1, round(25 * scale))
    shards = max(2, round(32 * scale))
    py = ensure_venv(root, ["safetensors", "numpy"])
    (root / "code").mkdir(parents=True, exist_ok=True)
    (root / "code" / "train.py").write_text(HF_TRAIN.format(params_m=params_m, shards=shards))
    data = root / "data"
    data.mkdir(exist_ok=True)
    for i in range(shards):
        random_file(data / f"train-{i:05d}-of-{shards:05d}.bin", 64 << 20 if scale >= 1 else max(1, int(64 * scale)) << 20)
    tok = root / "tokenizer"
    tok.mkdir(exist_ok=True)
    vocab = {f"tok{i}": i for i in range(50_000)}
    (tok / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": vocab}}))
    (tok / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    (tok / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))
    out = root / "output"
    out.mkdir(exist_ok=True)
    for s in (3, 4, 5):
        d = out / f"checkpoint-{s * 1000}"
        if not (d / "trainer_state.json").exists():
            run_helper(py, root, MAKE_HF_CKPT, str(d), str(s * 1000), str(params_m))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=["pointer", "hf"])
    ap.add_argument("root", type=Path)
    ap.add_argument("--scale", type=float, default=1.0)
    args = ap.parse_args()
    {"pointer": build_pointer, "hf": build_hf}[args.shape](args.root, args.scale)


if __name__ == "__main__":
    main()
