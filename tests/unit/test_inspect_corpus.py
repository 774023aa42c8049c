"""Checkpoints that the frameworks themselves wrote, judged: clean, killed, cut, restarted, planted.

The clean saves are made once per test session by tests/ckpt_corpus.py (the frameworks' own save
APIs on CPU, one process each, the distributed ones with two ranks on gloo).  Each test copies
the clean run it needs (mtimes kept) and damages the copy the way a crash, a disk or a person
does.  A framework that is not installed here skips its tests with the reason.
"""

from __future__ import annotations

import os
import shutil

import pytest

from ogrefs.inspect.checkpoints import analyze_checkpoints, is_candidate_name
from ogrefs.inspect.ckptfiles import check_file
from ogrefs.inspect.deadline import Deadline

@pytest.fixture
def clean(ckpt_corpus, tmp_path):
    """A copy of one framework's clean saves: clean("hf") -> its directory under tmp_path."""
    def copy(name: str) -> str:
        src, skip = ckpt_corpus[name]
        if skip:
            pytest.skip(skip)
        dst = str(tmp_path / name)
        shutil.copytree(src, dst, symlinks=True)
        return dst
    return copy


def analyze(root: str) -> dict:
    cands: dict[str, list[str]] = {}
    for d, dirs, files in os.walk(root):
        names = [n for n in files + dirs if is_candidate_name(os.fsencode(n))]
        if names:
            cands[d] = names
    return analyze_checkpoints(cands, Deadline(60))[0]


def run_of(section: dict, d: str) -> dict:
    return next(r for r in section["runs"] if r["dir"] == d)


def unit(section: dict, path: str) -> dict:
    for r in section["runs"]:
        for c in r["checkpoints"]:
            if c["id"] == path or c["path"] == path:
                return c
    raise AssertionError(f"no checkpoint {path}: {[c['id'] for r in section['runs'] for c in r['checkpoints']]}")


def cut(path: str, keep: float = 0.5) -> None:
    """Truncate a file as a killed writer or a full disk leaves it (mtime kept)."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.truncate(int(st.st_size * keep))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def damaged(d: str, ckpt: str, spec: str) -> dict:
    """Apply ``spec`` ("no NAME": removed, "cut NAME": cut in half) to ``d/ckpt/NAME``; the analysis of ``d``."""
    how, name = spec.split(" ", 1)
    path = os.path.join(d, ckpt, name)
    os.unlink(path) if how == "no" else cut(path)
    section = analyze(d)
    assert unit(section, os.path.join(d, ckpt))["coherent"] is False, spec
    return section


def latest(section: dict) -> dict:
    assert section["latest_coherent"] is not None
    return section["latest_coherent"]


# ---------------------------------------------------------------- plain torch.save loop


def test_plain_loop_clean_and_legacy(clean):
    root = clean("plain")
    for sub in ("zip", "legacy"):
        d = os.path.join(root, sub)
        r = run_of(analyze(d), d)
        assert r["resume"]["name"] == "step_40.pt" and r["resume"]["step"] == 40 and r["resume"]["coherent"]
        assert r["latest_coherent"] == os.path.join(d, "step_40.pt") and not r["problems"]
    c = unit(analyze(root), os.path.join(root, "legacy", "step_40.pt"))
    assert c["format"] == "torch-legacy" and c["files"][0]["ok"] is True
    assert set(c["components"]) == {"model", "optimizer", "progress"}


# pickletools warns of invalid escapes in a mutated STRING opcode's text while parsing it
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_legacy_torch_file_cut_at_any_byte_is_torn_and_damage_never_raises(clean, tmp_path):
    import random

    data = open(os.path.join(clean("plain"), "legacy", "step_40.pt"), "rb").read()
    probe = tmp_path / "probe.pt"
    for n in range(1, len(data)):
        probe.write_bytes(data[:n])
        fc = check_file(str(probe))
        assert fc.ok is False, (n, fc.kind, fc.problems)
    rng = random.Random(50)
    for _ in range(2000):  # flipped bytes anywhere: a verdict, never an exception
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        probe.write_bytes(bytes(b))
        check_file(str(probe))


@pytest.mark.parametrize("sub", ["zip", "legacy"])
def test_plain_loop_torn_file_that_latest_names(clean, sub):
    d = os.path.join(clean("plain"), sub)
    cut(os.path.join(d, "step_40.pt"))
    section = analyze(d)
    c = unit(section, os.path.join(d, "step_40.pt"))
    assert c["complete"] is False and c["coherent"] is False and c["files"][0]["ok"] is False
    r = run_of(section, d)
    assert r["latest_coherent"] == os.path.join(d, "step_30.pt")
    assert "not coherent" in r["pointers"][0]["problem"]
    assert any("resume from step_40.pt, which is not coherent" in p for p in r["problems"])


def test_plain_loop_restarted_in_the_same_directory(clean):
    d = os.path.join(clean("plain"), "restarted")
    section = analyze(d)
    r = run_of(section, d)
    # the restart (new seed) rewrote step_10, step_20 and latest; step_30 and step_40 are the old run's
    assert r["resume"]["name"] == "step_20.pt" and r["latest_coherent"] == os.path.join(d, "step_20.pt")
    assert r["most_advanced_coherent"] == os.path.join(d, "step_40.pt")
    assert any("more advanced" in p and "step_40.pt" in p for p in r["problems"])
    assert latest(section)["step"] == 20


@pytest.mark.parametrize("sub", ["zip", "legacy"])
def test_pickle_that_would_run_code_is_never_loaded_nor_coherent(clean, ckpt_corpus, sub):
    d = os.path.join(clean("planted"), sub)
    section = analyze(d)
    marker = os.path.join(ckpt_corpus["planted"][0], "RAN")  # the path the pickles were built to touch
    assert not os.path.exists(marker), "a planted pickle was loaded"
    c = unit(section, os.path.join(d, "step_20.pt"))
    assert c["files"][0]["ok"] is True  # whole, yet refused by torch.load(weights_only=True)
    assert c["coherent"] is False and any("weights_only" in p and "system" in p for p in c["problems"])
    r = run_of(section, d)
    assert r["latest_coherent"] == os.path.join(d, "step_10.pt") and r["resume"]["coherent"] is False
    assert "not coherent" in r["pointers"][0]["problem"]


# ---------------------------------------------------------------- HF Trainer


def test_hf_trainer_clean(clean):
    d = os.path.join(clean("hf"), "run")
    section = analyze(d)
    r = run_of(section, d)
    assert r["framework"] == "hf-trainer" and r["resume"]["name"] == "checkpoint-40" and r["resume"]["coherent"]
    c = latest(section)
    assert c["id"] == os.path.join(d, "checkpoint-40") and c["step"] == 40
    assert c["components"] == ["model", "optimizer", "scheduler", "rng", "progress"]


@pytest.mark.parametrize("damage", ["no rng_state.pth", "no trainer_state.json", "cut model.safetensors",
                                    "cut optimizer.pt", "cut rng_state.pth", "cut trainer_state.json"])
def test_hf_trainer_damaged_latest_falls_back(clean, damage):
    d = os.path.join(clean("hf"), "run")
    section = damaged(d, "checkpoint-40", damage)
    r = run_of(section, d)
    assert r["latest_coherent"] == os.path.join(d, "checkpoint-20")
    # the HF Trainer itself would pick checkpoint-40 (the highest N): named as a problem
    assert r["resume"]["name"] == "checkpoint-40" and not r["resume"]["coherent"] and r["problems"]


def test_hf_trainer_ddp_needs_every_process_rng_state(clean):
    d = os.path.join(clean("hf-ddp"), "run")
    assert unit(analyze(d), os.path.join(d, "checkpoint-40"))["coherent"] is True
    os.unlink(os.path.join(d, "checkpoint-40", "rng_state_1.pth"))  # the highest rank: no gap left
    section = analyze(d)
    c = unit(section, os.path.join(d, "checkpoint-40"))
    assert c["coherent"] is False and any("rng_state_1.pth" in p for p in c["problems"])
    assert latest(section)["id"] == os.path.join(d, "checkpoint-20")


def test_data_tensors_beside_a_pretrained_model(clean):
    d = os.path.join(clean("hf"), "pretrained")
    section = analyze(d)
    assert latest(section)["id"] == os.path.join(d, "model", "model.safetensors")
    assert all(c["path"] != os.path.join(d, "data", "tokens.pt") for r in section["runs"] for c in r["checkpoints"])


# ---------------------------------------------------------------- accelerate


def test_accelerate_clean_names_the_framework_and_the_training_step(clean):
    d = os.path.join(clean("accelerate"), "checkpoints")
    section = analyze(d)
    r = run_of(section, d)
    assert r["framework"] == "accelerate" and r["resume"]["name"] == "checkpoint_3"
    c = latest(section)
    assert c["format"] == "accelerate" and c["id"].endswith("checkpoint_3") and c["step"] == 40
    assert [unit(section, os.path.join(d, f"checkpoint_{i}"))["step"] for i in range(4)] == [10, 20, 30, 40]


@pytest.mark.parametrize("damage", ["no random_states_0.pkl", "no custom_checkpoint_0.pkl", "cut random_states_0.pkl",
                                    "cut optimizer.bin", "cut model.safetensors", "no scheduler.bin"])
def test_accelerate_unfinished_save(clean, damage):
    d = os.path.join(clean("accelerate"), "checkpoints")
    section = damaged(d, "checkpoint_3", damage)
    assert latest(section)["id"] == os.path.join(d, "checkpoint_2") and latest(section)["step"] == 30


def test_accelerate_without_registered_state_steps_from_the_scheduler(clean):
    d = os.path.join(clean("accelerate"), "bare", "checkpoints")
    section = analyze(d)
    assert latest(section)["id"] == os.path.join(d, "checkpoint_3") and latest(section)["step"] == 40
    section = damaged(d, "checkpoint_3", "no random_states_0.pkl")  # the file it writes last
    assert latest(section)["id"] == os.path.join(d, "checkpoint_2")


def test_accelerate_two_processes_highest_ones_random_states_missing(clean):
    d = os.path.join(clean("accelerate"), "ddp", "checkpoints")
    assert latest(analyze(d))["id"] == os.path.join(d, "checkpoint_1") and latest(analyze(d))["step"] == 20
    # random_states_1.pkl is the last process's: removing it leaves no gap in 0..N-1
    section = damaged(d, "checkpoint_1", "no random_states_1.pkl")
    c = unit(section, os.path.join(d, "checkpoint_1"))
    assert any("random_states_1.pkl missing" in p for p in c["problems"])
    assert latest(section)["id"] == os.path.join(d, "checkpoint_0")


def test_accelerate_lone_save_without_its_random_states(clean):
    d = os.path.join(clean("accelerate"), "checkpoints")
    for i in range(3):
        shutil.rmtree(os.path.join(d, f"checkpoint_{i}"))
    os.unlink(os.path.join(d, "checkpoint_3", "random_states_0.pkl"))
    c = unit(analyze(d), os.path.join(d, "checkpoint_3"))
    assert c["coherent"] is False and any("random_states_0.pkl" in p for p in c["problems"])


# ---------------------------------------------------------------- Lightning


def test_lightning_clean_resumes_from_last(clean):
    d = os.path.join(clean("lightning"), "clean")
    r = run_of(analyze(d), d)
    assert r["framework"] == "lightning" and r["resume"]["name"] == "last.ckpt" and r["resume"]["step"] == 40
    assert not r["problems"]


def test_lightning_restarted_run_resumes_from_last_v1(clean):
    d = os.path.join(clean("lightning"), "restarted")
    section = analyze(d)
    r = run_of(section, d)
    assert r["resume"]["name"] == "last-v1.ckpt" and r["resume"]["step"] == 20
    assert r["latest_coherent"] == os.path.join(d, "last-v1.ckpt")
    assert any("more advanced" in p for p in r["problems"])
    # the two runs' step=20 files are two checkpoints, not one
    for n in ("step=20.ckpt", "step=20-v1.ckpt"):
        assert [f["path"] for f in unit(section, os.path.join(d, n))["files"]] == [os.path.join(d, n)]


def test_lightning_torn_last_ckpt(clean):
    d = os.path.join(clean("lightning"), "clean")
    cut(os.path.join(d, "last.ckpt"))
    r = run_of(analyze(d), d)
    assert r["resume"]["coherent"] is False and r["latest_coherent"] == os.path.join(d, "step=40.ckpt")


# ---------------------------------------------------------------- torch.distributed.checkpoint


def test_dcp_two_ranks(clean):
    d = clean("dcp")
    section = analyze(d)
    c = latest(section)
    assert c["format"] == "torch-dcp" and c["id"] == os.path.join(d, "step_40") and c["step"] == 40
    assert run_of(section, d)["resume"]["name"] == "step_40"


@pytest.mark.parametrize("damage", ["no __1_0.distcp", "no .metadata", "cut __0_0.distcp", "cut __1_0.distcp",
                                    "cut .metadata"])
def test_dcp_damaged(clean, damage):
    d = clean("dcp")
    section = damaged(d, "step_40", damage)
    assert latest(section)["id"] == os.path.join(d, "step_20")


# ---------------------------------------------------------------- DeepSpeed


def test_deepspeed_clean_resumes_from_latest(clean):
    d = os.path.join(clean("deepspeed"), "clean")
    section = analyze(d)
    r = run_of(section, d)
    assert r["framework"] == "deepspeed" and r["resume"]["name"] == "global_step40" and r["resume"]["coherent"]
    assert latest(section)["step"] == 40


@pytest.mark.parametrize("damage", ["no zero_pp_rank_1_mp_rank_00_optim_states.pt",
                                    "cut zero_pp_rank_1_mp_rank_00_optim_states.pt",
                                    "cut mp_rank_00_model_states.pt", "no mp_rank_00_model_states.pt"])
def test_deepspeed_damaged_save_that_latest_names(clean, damage):
    d = os.path.join(clean("deepspeed"), "clean")
    section = damaged(d, "global_step40", damage)
    r = run_of(section, d)
    assert r["latest_coherent"] == os.path.join(d, "global_step20")
    assert "not coherent" in r["pointers"][0]["problem"]


def test_deepspeed_restarted_run(clean):
    d = os.path.join(clean("deepspeed"), "restarted")
    section = analyze(d)
    r = run_of(section, d)
    assert r["resume"]["name"] == "global_step20" and r["latest_coherent"] == os.path.join(d, "global_step20")
    assert any("more advanced" in p and "global_step40" in p for p in r["problems"])
