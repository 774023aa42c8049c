#!/usr/bin/env python3
"""A small, deterministic GPU training run that checkpoints as the Hugging Face Trainer does.

Used by scripts/gpu_check to prove that a box snapshotted by ogrefs resumes
training on a GPU, restored or lazily mounted, from the checkpoint the
snapshot's manifest calls the latest coherent one, and continues with the
very losses the original box would have had.

``--run DIR`` holds ``checkpoint-N/`` directories (``model.safetensors``,
``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``,
``trainer_state.json``). The run resumes from the highest complete one,
trains ``--steps`` more steps (each batch drawn from a generator seeded by
the step, so a resumed run sees the batches the original would have) and
saves where ``--save-every`` says. Each step prints one JSON line; the
first carries ``first_step_s``, seconds from the process start (torch's
import included) to the end of the first step. Runs on the CPU where no
GPU is (a dry run of the script); the device is in every line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

T0 = time.monotonic()

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

WIDTH = 2048
LAYERS = 4
BATCH = 256


def model_for(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    layers.append(torch.nn.Linear(WIDTH, 1))
    return torch.nn.Sequential(*layers).to(device)


def latest_checkpoint(run: str) -> tuple[int, str] | None:
    """The highest ``checkpoint-N`` with a trainer_state.json, as transformers' get_last_checkpoint."""
    found = []
    for name in os.listdir(run) if os.path.isdir(run) else []:
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and os.path.exists(os.path.join(run, name, "trainer_state.json")):
            found.append((int(m.group(1)), os.path.join(run, name)))
    return max(found) if found else None


def save(run: str, step: int, model, opt, sched, losses: list[float]) -> None:
    d = os.path.join(run, f"checkpoint-{step}")
    os.makedirs(d, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(d, "model.safetensors"))
    torch.save(opt.state_dict(), os.path.join(d, "optimizer.pt"))
    torch.save(sched.state_dict(), os.path.join(d, "scheduler.pt"))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, os.path.join(d, "rng_state.pth"))
    # written last, as the Trainer does: a directory without it is not a checkpoint yet
    with open(os.path.join(d, "trainer_state.json"), "w") as f:
        json.dump({"global_step": step, "epoch": step / 100, "log_history": [
            {"step": step - len(losses) + i + 1, "loss": v} for i, v in enumerate(losses)]}, f)
        f.flush()
        os.fsync(f.fileno())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--save-every", type=int, default=0, help="save every N steps (0: never)")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = model_for(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000)
    step = 0
    resumed = latest_checkpoint(args.run)
    if resumed:
        step, d = resumed
        model.load_state_dict(load_file(os.path.join(d, "model.safetensors"), device=str(device)))
        opt.load_state_dict(torch.load(os.path.join(d, "optimizer.pt"), map_location=device, weights_only=True))
        sched.load_state_dict(torch.load(os.path.join(d, "scheduler.pt"), weights_only=True))
        rng = torch.load(os.path.join(d, "rng_state.pth"), weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    losses: list[float] = []
    for i in range(args.steps):
        step += 1
        g = torch.Generator(device=device).manual_seed(step)
        x = torch.randn(BATCH, WIDTH, generator=g, device=device)
        y = x[:, :8].sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        v = float(loss.item())  # synchronizes with the device: the step is done
        losses.append(v)
        line = {"step": step, "loss": v.hex(), "device": str(device),
                "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                "resumed_from": resumed[0] if resumed else None}
        if i == 0:
            line["first_step_s"] = round(time.monotonic() - T0, 3)
        print(json.dumps(line), flush=True)
        if args.save_every and step % args.save_every == 0:
            save(args.run, step, model, opt, sched, losses)
            losses = []
    return 0


if __name__ == "__main__":
    sys.exit(main())
