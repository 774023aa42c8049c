"""Each framework's own rules: which files a finished save holds, and which checkpoint it resumes from.

:mod:`ogrefs.inspect.ckptsets` judges what any set of files needs (shards, rank families,
DCP metadata).  What is written here is what one framework does, read from its source:

* **accelerate** ``save_state`` writes the weights, optimizer, scheduler and sampler files,
  then ``random_states_<process>.pkl`` (every process), then ``custom_checkpoint_<i>.pkl``
  for each registered object.  Rank 0's random states are always written; their absence
  means the save stopped.  With automatic naming the directory is ``checkpoint_<save
  index>``, and ``load_state()`` picks the highest index.
* **HF Trainer** writes the weights, ``optimizer.pt``, ``scheduler.pt``, the RNG state
  (``rng_state.pth`` with one process, ``rng_state_<process>.pth`` per process otherwise),
  then ``trainer_state.json``.  ``training_args.bin`` records the process count (its
  accelerate state's ``num_processes``).  ``resume_from_checkpoint=True`` takes the
  highest ``checkpoint-<N>`` by N, finished or not.
* **Lightning** ``ckpt_path="last"`` takes the newest (by modification time) of the
  ``last*.ckpt`` files of the directory: a restarted run writes ``last-v1.ckpt``.
* **DeepSpeed** ``load_checkpoint`` reads the tag in ``latest``, written after every rank
  has saved; ``mp_rank_*_model_states.pt`` records ``dp_world_size``.
* **torch.distributed.checkpoint** and hand-written loops have no rule of their own: a
  pointer file (``latest``) where there is one, else the highest step.

The functions take the checkpoint units of :mod:`ogrefs.inspect.checkpoints` by duck
typing (``name``, ``checks``, ``step``, ``mtime``, ``coherent``, ``order_key()``).
"""

from __future__ import annotations

import os
import re
from collections import Counter

__all__ = ["framework_problems", "process_count", "sibling_problems", "resume_rule", "FRAMEWORK_NAMES"]

#: How ``show`` names each format.
FRAMEWORK_NAMES = {
    "accelerate": "accelerate",
    "hf-trainer": "HF Trainer",
    "lightning": "Lightning",
    "deepspeed": "DeepSpeed",
    "torch-dcp": "torch.distributed.checkpoint",
    "megatron": "Megatron",
}

_ACC_RNG = re.compile(r"^random_states_(\d+)\.pkl$")
_HF_RNG = re.compile(r"^rng_state(?:_(\d+))?\.pth$")
_LAST_CKPT = re.compile(r"^last(?:-v\d+)?\.ckpt$")
_NUMBER = re.compile(r"(\d+)$")


def framework_problems(fmt: str, checks: list) -> list[str]:
    """Files the framework writes in every finished save that this one lacks."""
    names = {os.path.basename(c.path) for c in checks}
    if fmt == "accelerate":
        if "random_states_0.pkl" not in names:
            return ["no random_states_0.pkl (accelerate writes it after the weights, optimizer and "
                    "scheduler, on every save: the save did not finish)"]
        return []
    if fmt.startswith("hf-trainer"):
        return _hf_problems(names, checks)
    return []


def _hf_problems(names: set[str], checks: list) -> list[str]:
    ranks = {m.group(1) for n in names if (m := _HF_RNG.match(n))}
    world = next((c.facts["num_processes"] for c in checks
                  if os.path.basename(c.path) == "training_args.bin" and "num_processes" in c.facts), None)
    if not ranks:
        # save_only_model skips both; trainer_state.json is written after the RNG state
        if "optimizer.pt" in names and "trainer_state.json" in names:
            return ["no rng_state*.pth (the HF Trainer writes it with the optimizer, before trainer_state.json)"]
        return []
    if world is None:
        world = 1 if ranks == {None} else max(int(r) for r in ranks if r is not None) + 1
        if ranks == {"0"}:
            world = 2  # rng_state_0.pth is only ever written by a run of two or more processes
    if world == 1:
        return [] if None in ranks else ["training_args.bin records 1 process but rng_state.pth is missing"]
    missing = [r for r in range(world) if str(r) not in ranks]
    if missing:
        return [f"RNG state of process(es) {', '.join(map(str, missing[:5]))} missing "
                f"(e.g. rng_state_{missing[0]}.pth): a {world}-process run writes one per process"]
    return []


def process_count(fmt: str, checks: list) -> int | None:
    """How many processes wrote a save, where only its files tell (accelerate: its random_states files)."""
    if fmt != "accelerate":
        return None
    return max((int(m.group(1)) for c in checks if (m := _ACC_RNG.match(os.path.basename(c.path)))), default=-1) + 1


def sibling_problems(fmt: str, checks: list, other_worlds: "Counter[int | None]") -> list[str]:
    """What the run's other finished saves say this one lacks, where the save records no world size.

    ``other_worlds`` counts the other finished saves of the run by :func:`process_count`.
    accelerate writes ``random_states_<process>.pkl`` from every process but records the
    process count nowhere; when every other save of the run has the same count, this one
    must have it too (the highest process's file leaves no gap when it is the one missing).
    """
    worlds = [w for w, k in other_worlds.items() if k > 0]
    if fmt != "accelerate" or len(worlds) != 1 or worlds[0] is None:
        return []  # no other save, or they disagree (a restart with another world): nothing to hold this one to
    world = worlds[0]
    have = {int(m.group(1)) for c in checks if (m := _ACC_RNG.match(os.path.basename(c.path)))}
    missing = sorted(set(range(world)) - have)
    if not missing:
        return []
    return [f"random_states_{missing[0]}.pkl missing ({len(missing)} of {world} processes' random states): every "
            f"other save of this run has {world} (accelerate records no process count; the save did not finish)"]


def resume_rule(fmt: str, members: list, pointer_hits: list) -> tuple[object | None, str]:
    """(the checkpoint the framework resumes from, the rule in words) for one run's members.

    ``pointer_hits`` are the checkpoints the run's pointer files (``latest``) resolve to,
    newest pointer first.  None when the framework would start afresh.
    """
    if not members:
        return None, ""
    if fmt in ("hf-trainer", "accelerate") or fmt.startswith("hf-trainer+"):
        dirs = [m for m in members if _NUMBER.search(m.name)]
        if dirs:
            best = max(dirs, key=lambda m: int(_NUMBER.search(m.name).group(1)))
            what = "checkpoint-N" if fmt != "accelerate" else "checkpoint_N (save index)"
            return best, f"the highest {what}, as {FRAMEWORK_NAMES.get(fmt.split('+')[0], fmt)} resumes"
    if fmt == "lightning":
        last = [m for m in members if _LAST_CKPT.match(m.name)]
        if last:
            return max(last, key=lambda m: m.mtime), 'the newest last*.ckpt, as ckpt_path="last" resumes'
    if pointer_hits:
        return pointer_hits[0], "the checkpoint the latest pointer names"
    if fmt == "deepspeed":
        return None, "no latest file: DeepSpeed's load_checkpoint finds nothing to resume"
    return max(members, key=lambda m: m.order_key()), "the most advanced checkpoint (no pointer file)"
