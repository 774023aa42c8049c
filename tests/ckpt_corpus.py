"""Real checkpoints made by the frameworks' own save APIs, on CPU, for the checkpoint tests.

:func:`build_all` (the ``ckpt_corpus`` fixture of tests/conftest.py, once per test session)
runs this file as ``python ckpt_corpus.py BUILD OUT_DIR``, one process per build so that one
framework's imports and global state cannot leak into another's, two at a time.  Each writes
a small training run's saves under OUT_DIR and exits 0, or exits 3 with one line on stderr
when the framework is not installed here.  The tests (tests/unit/test_inspect_corpus.py)
build the damaged cases from these clean saves.

Every run trains a few steps of a tiny model; the saves are what the framework writes,
not imitations.  The frameworks with a distributed save run two processes on gloo.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


_HERE = os.path.dirname(os.path.abspath(__file__))
#: the slowest first, two at a time: about 25 s in all on the project's 2-core machine
_BUILDS = ("hf", "deepspeed", "lightning", "torch", "accelerate")
_WHERE = {"plain": ("torch", "plain"), "planted": ("torch", "planted"), "dcp": ("torch", "dcp"),
          "hf-ddp": ("hf", "ddp")}
_BUILD_TIMEOUT_S = 240


def _build(root: str, name: str) -> tuple[str, str | None, float]:
    """(directory, skip reason or None, seconds) of one framework's clean saves."""
    out = os.path.join(root, name)
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run([sys.executable, os.path.join(_HERE, "ckpt_corpus.py"), name, out], env=env,
                              capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, cwd=root)
    except subprocess.TimeoutExpired:
        return out, f"{name}: its saves took over {_BUILD_TIMEOUT_S} s", time.monotonic() - t0
    if proc.returncode == 3:
        return out, proc.stderr.strip().splitlines()[-1], time.monotonic() - t0
    if proc.returncode != 0:
        raise AssertionError(f"building the {name} corpus failed:\n{proc.stderr[-3000:]}")
    return out, None, time.monotonic() - t0


def build_all(root: str) -> dict[str, tuple[str, str | None]]:
    """framework -> (directory of its clean saves, skip reason or None); built two at a time under ``root``."""
    with ThreadPoolExecutor(2) as pool:
        built = dict(zip(_BUILDS, pool.map(lambda n: _build(root, n), _BUILDS)))
    print("corpus build seconds:", {k: round(v[2], 1) for k, v in built.items()}, file=sys.stderr)
    out = {k: (v[0], v[1]) for k, v in built.items()}
    for name, (build, sub) in _WHERE.items():
        out[name] = (os.path.join(built[build][0], sub), built[build][1])
    return out


def _missing(name: str) -> None:
    print(f"{name} is not installed", file=sys.stderr)
    sys.exit(3)


def plain(out: str) -> None:
    """A hand-written loop: torch.save of a dict every 10 steps and a ``latest`` file naming it."""
    import torch

    def run(d: str, seed: int, steps: int, legacy: bool) -> None:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        os.makedirs(d, exist_ok=True)
        for step in range(1, steps + 1):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            if step % 10 == 0:
                name = f"step_{step}.pt"
                state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
                kw = {"_use_new_zipfile_serialization": False} if legacy else {}
                torch.save(state, os.path.join(d, name), **kw)
                with open(os.path.join(d, "latest"), "w") as f:
                    f.write(name + "\n")

    run(os.path.join(out, "zip"), 0, 40, False)
    run(os.path.join(out, "legacy"), 0, 40, True)
    # restarted in the same directory with a new seed: step_10, step_20 and latest rewritten
    run(os.path.join(out, "restarted"), 0, 40, False)
    run(os.path.join(out, "restarted"), 1, 20, False)


def _hf_train(run_dir: str) -> "object":
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    model = GPT2LMHeadModel(cfg)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (16, 8))]
    args = TrainingArguments(
        output_dir=run_dir, max_steps=40, save_steps=20, per_device_train_batch_size=2,
        report_to=[], use_cpu=True, logging_steps=1000, disable_tqdm=True, dataloader_num_workers=0,
    )
    Trainer(model=model, args=args, train_dataset=data).train()
    return model


def _hf_rank(rank: int, run_dir: str, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _hf_train(run_dir)


def hf(out: str) -> None:
    """HF Trainer on a 2-layer GPT-2 built from a config, checkpoint-20 and checkpoint-40: one process
    (``run``), and DDP with 2 processes on gloo (``ddp/run``: each writes its rng_state_<rank>.pth)."""
    try:
        import torch
        import transformers  # noqa: F401  (imported once, before the ranks fork)
    except ImportError:
        _missing("transformers")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the ranks first: the one-process run below sets up accelerate's process state, which a fork would copy
    mp.start_processes(_hf_rank, args=(os.path.join(out, "ddp", "run"), port), nprocs=2, start_method="fork")
    model = _hf_train(os.path.join(out, "run"))
    # a finished model from save_pretrained, and data tensors written after it
    model.save_pretrained(os.path.join(out, "pretrained", "model"))
    os.makedirs(os.path.join(out, "pretrained", "data"))
    torch.save(torch.randint(0, 64, (256,)), os.path.join(out, "pretrained", "data", "tokens.pt"))


def accel(out: str) -> None:
    """accelerate ``save_state`` with automatic checkpoint naming: checkpoints/checkpoint_0..3, every 10 steps."""
    try:
        import torch
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration
    except ImportError:
        _missing("accelerate")

    class Progress:
        """A registered custom state, as accelerate's examples keep their step count."""

        def __init__(self) -> None:
            self.step = 0

        def state_dict(self) -> dict:
            return {"step": self.step}

        def load_state_dict(self, d: dict) -> None:
            self.step = d["step"]

    def train(project: str, with_progress: bool) -> None:
        torch.manual_seed(0)
        config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
        acc = Accelerator(cpu=True, project_config=config)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
        model, opt, sched = acc.prepare(model, opt, sched)
        progress = Progress()
        if with_progress:
            acc.register_for_checkpointing(progress)
        for step in range(1, 41):
            # with progress: accumulate() moves accelerate's own step counter too; without, only the scheduler counts
            with acc.accumulate(model) if with_progress else contextlib.nullcontext():
                acc.backward(model(torch.randn(3, 4)).sum())
                opt.step()
                sched.step()
                opt.zero_grad()
            progress.step = step
            if step % 10 == 0:
                acc.save_state()

    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the processes first: an Accelerator made here sets up the process state, which a fork would copy
    mp.start_processes(_accel_rank, args=(port, os.path.join(out, "ddp")), nprocs=2, start_method="fork")
    train(out, True)
    train(os.path.join(out, "bare"), False)  # no registered state: random_states_0.pkl is written last


def _accel_rank(rank: int, port: int, out: str) -> None:
    """One of 2 processes (gloo): each save_state writes random_states_0.pkl and random_states_1.pkl."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=out, automatic_checkpoint_naming=True))
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    model, opt, sched = acc.prepare(model, opt, sched)
    for step in range(1, 21):
        acc.backward(model(torch.randn(3, 4)).sum())
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 10 == 0:
            acc.save_state()


def lightning(out: str) -> None:
    """Lightning ModelCheckpoint every 20 steps with last.ckpt; then a restarted run (new seed) in the same dir."""
    try:
        import torch
        import lightning as L
        from lightning.pytorch.callbacks import ModelCheckpoint
    except ImportError:
        _missing("lightning")
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, _i):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(d: str, seed: int, steps: int) -> None:
        L.seed_everything(seed, verbose=False)
        ck = ModelCheckpoint(dirpath=d, filename="{step}", every_n_train_steps=20, save_top_k=-1, save_last=True)
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", callbacks=[ck], logger=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
        trainer.fit(Tiny(), torch.utils.data.DataLoader(torch.randn(64, 4), batch_size=2))

    fit(os.path.join(out, "clean"), 0, 40)
    fit(os.path.join(out, "restarted"), 0, 40)
    fit(os.path.join(out, "restarted"), 1, 20)


def _dcp_rank(rank: int, out: str, init: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(1, 41):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        if step % 20 == 0:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=os.path.join(out, f"step_{step}"))
            dist.barrier()
    dist.destroy_process_group()


def dcp(out: str) -> None:
    """torch.distributed.checkpoint, 2 ranks (FSDP2 on gloo): step_20/, step_40/."""
    import torch.distributed.checkpoint  # noqa: F401  (imported once, before the ranks fork)
    import torch.distributed.fsdp  # noqa: F401
    import torch.multiprocessing as mp

    init = "file://" + os.path.join(out, ".rendezvous")
    os.makedirs(out, exist_ok=True)
    mp.start_processes(_dcp_rank, args=(out, init), nprocs=2, start_method="fork")
    os.unlink(os.path.join(out, ".rendezvous"))


class _RunsCode:
    """Pickled as a call of os.system: loading the file would create ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def planted(out: str) -> None:
    """A plain loop's step_10.pt, then a step_20.pt whose pickle would run os.system, named by ``latest``.

    In both torch.save formats.  ``RAN`` beside them appears if anything ever loads one.
    """
    import torch

    for sub, kw in (("zip", {}), ("legacy", {"_use_new_zipfile_serialization": False})):
        d = os.path.join(out, sub)
        os.makedirs(d)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, extra in ((10, {}), (20, {"hook": _RunsCode(os.path.join(out, "RAN"))})):
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, **extra}
            torch.save(state, os.path.join(d, f"step_{step}.pt"), **kw)
        with open(os.path.join(d, "latest"), "w") as f:
            f.write("step_20.pt\n")


def torch_only(out: str) -> None:
    """The frameworks that need nothing but torch, in one process: the plain loop, planted pickles and DCP."""
    plain(os.path.join(out, "plain"))
    planted(os.path.join(out, "planted"))
    dcp(os.path.join(out, "dcp"))


def _ds_rank(rank: int, out: str, init: str, seed: int, steps: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist
    import deepspeed
    import deepspeed.comm.torch as ds_comm

    # DeepSpeed compiles a shared-memory collective for CPU at start (over a minute); gloo needs none.
    ds_comm.build_shm_op = lambda: None
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, dist_init_required=False)
    for step in range(1, steps + 1):
        loss = engine(torch.randn(2, 8)).sum()
        engine.backward(loss)
        engine.step()
        if step % 20 == 0:
            engine.save_checkpoint(out, client_state={"step": step})
    dist.destroy_process_group()


def ds(out: str) -> None:
    """DeepSpeed ZeRO-2, 2 ranks on gloo, CPU: global_step20/, global_step40/ and ``latest``; then a restart."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        _missing("deepspeed")
    import torch.multiprocessing as mp

    import shutil

    for sub, seed, steps in (("clean", 0, 40), ("restarted", 1, 20)):
        d = os.path.join(out, sub)
        if sub == "restarted":  # the first run is the clean one: a copy, mtimes kept, spares a third run
            shutil.copytree(os.path.join(out, "clean"), d)
        os.makedirs(d, exist_ok=True)
        init = "file://" + os.path.join(out, f".rendezvous-{sub}")
        mp.start_processes(_ds_rank, args=(d, init, seed, steps), nprocs=2, start_method="fork")
        os.unlink(init[len("file://"):])


if __name__ == "__main__":
    try:
        import torch  # noqa: F401  (every build needs it)
    except ImportError:
        _missing("torch")
    {"torch": torch_only, "hf": hf, "accelerate": accel, "lightning": lightning, "dcp": dcp, "deepspeed": ds}[
        sys.argv[1]](sys.argv[2])
