#!/usr/bin/env python3
"""Build the resume benchmark's training box: a torch venv, a training script,
data shards and several checkpoints of a few hundred MB each (model + Adam state).

    make_resume_box.py ROOT [--ckpts 3] [--params-m 25] [--shards 40] [--shard-mb 128]

The training script (ROOT/code/train.py) resumes from ROOT/checkpoints/latest,
loads one data shard, runs one optimizer step and prints "step N loss X".
Whatever the box holds, one step needs only: the interpreter and torch's
libraries, the newest checkpoint, and one shard.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

TRAIN = r'''
import os, pathlib, sys, time
t0 = time.time()
import torch
root = pathlib.Path(__file__).resolve().parent.parent
params_m = int(os.environ.get("OGREFS_BENCH_PARAMS_M", "{params_m}"))

def model():
    width = 2048
    layers = max(1, params_m * 1_000_000 // (width * width))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

m = model()
opt = torch.optim.Adam(m.parameters(), lr=1e-4)
name = (root / "checkpoints" / "latest").read_text().strip()
state = torch.load(root / "checkpoints" / name, map_location="cpu", weights_only=True)
m.load_state_dict(state["model"])
opt.load_state_dict(state["optimizer"])
step = state["step"]
shard = root / "data" / f"shard-{{step % {shards}:04d}}.bin"
with open(shard, "rb") as fh:
    raw = torch.frombuffer(bytearray(fh.read(64 * 2048)), dtype=torch.uint8)
x = raw.float().view(64, 2048) / 255.0
loss = m(x).pow(2).mean()
opt.zero_grad()
loss.backward()
opt.step()
print(f"step {{step + 1}} loss {{loss.item():.6f}} ({{time.time() - t0:.2f}} s in python)", flush=True)
if os.environ.get("OGREFS_BENCH_SAVE"):
    torch.save({{"model": m.state_dict(), "optimizer": opt.state_dict(), "step": step + 1}},
               root / "checkpoints" / f"step_{{step + 1:06d}}.pt")
'''

MAKE_CKPT = r'''
import sys, torch
sys.argv = sys.argv
exec(open(sys.argv[1]).read().split("m = model()")[0])
m = model()
opt = torch.optim.Adam(m.parameters(), lr=1e-4)
for p in m.parameters():
    p.grad = torch.randn_like(p)
opt.step()
step = int(sys.argv[3])
torch.save({"model": m.state_dict(), "optimizer": opt.state_dict(), "step": step}, sys.argv[2])
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path)
    ap.add_argument("--ckpts", type=int, default=3)
    ap.add_argument("--params-m", type=int, default=25, help="model parameters, millions (fp32; Adam triples it)")
    ap.add_argument("--shards", type=int, default=40)
    ap.add_argument("--shard-mb", type=int, default=128)
    args = ap.parse_args()
    root: Path = args.root
    venv = root / "venv"
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "torch==2.13.0"], check=True)
    code = root / "code"
    code.mkdir(parents=True, exist_ok=True)
    train = code / "train.py"
    train.write_text(TRAIN.format(params_m=args.params_m, shards=args.shards))
    data = root / "data"
    data.mkdir(exist_ok=True)
    for i in range(args.shards):
        p = data / f"shard-{i:04d}.bin"
        if not p.exists():
            with open("/dev/urandom", "rb") as r, open(p, "wb") as w:
                for _ in range(args.shard_mb):
                    w.write(r.read(1024 * 1024))
    ck = root / "checkpoints"
    ck.mkdir(exist_ok=True)
    helper = root / ".make_ckpt.py"
    helper.write_text(MAKE_CKPT)
    for s in range(1, args.ckpts + 1):
        p = ck / f"step_{s * 1000:06d}.pt"
        if not p.exists():
            subprocess.run([str(venv / "bin" / "python"), str(helper), str(train), str(p), str(s * 1000)], check=True)
    helper.unlink()
    (ck / "latest").write_text(f"step_{args.ckpts * 1000:06d}.pt\n")


if __name__ == "__main__":
    main()
