"""EnvironmentProbe as the walker uses it, deadlines, diffs, warnings, text."""

from __future__ import annotations

import copy
import json
import os
import struct
import time

from ogrefs.inspect import (
    EnvironmentProbe,
    capture_environment,
    compatibility_warnings,
    diff_environments,
    format_environment,
    probe_local_machine,
)
from ogrefs.inspect import probe as probe_mod
from ogrefs.inspect import pyenv
from tests.envmaker import h100, hf_ckpt, manifest, safetensors, venv, write


def no_nvml():
    """The NVML loader for a box without pynvml."""
    raise ImportError("no pynvml in this test")


def test_walker_api_with_bytes_paths(tmp_path, monkeypatch):
    """The lead's walker calls observe_dir(bytes, [bytes]) once per directory."""
    run = tmp_path / "run"
    c = hf_ckpt(run, 10)
    probe = EnvironmentProbe(load_nvml=no_nvml)
    for dirpath, dirnames, filenames in os.walk(os.fsencode(str(tmp_path))):
        probe.observe_dir(dirpath, dirnames + filenames)
    env = probe.finish(deadline_s=10)
    assert set(env) >= {"machine", "gpus", "cuda", "python_envs", "git", "checkpoints", "hints", "notes"}
    assert env["complete"] is True and env["notes"] == []
    assert env["checkpoints"]["latest_coherent"]["id"] == c
    assert env["hints"]["checkpoint"] == [os.path.join(c, "model.safetensors"), os.path.join(c, "trainer_state.json")]
    assert env["gpus"]["available"] is False and "no pynvml" in env["gpus"]["reason"]
    assert json.loads(json.dumps(env)) == env


def test_observe_dir_notes_without_reading():
    """observe_dir is pure bookkeeping: paths that do not exist are fine."""
    probe = EnvironmentProbe(load_nvml=no_nvml)
    probe.observe_dir(b"/usr/local", [b"cuda-12.1", b"cuda", b"bin", b"lib"])
    probe.observe_dir(b"/x/lib/python3.11/site-packages/torch/lib", [b"libtorch_cuda.so", b"libcudart-9335f6a2.so.12", b"x.py"])
    probe.observe_dir(b"/x/bin", [b"python3.11", b"python", b"pythonw-config", b"pip"])
    probe.observe_dir(b"/lib/firmware", [b"a.bin", b"b.bin"])
    probe.observe_dir(b"/data/run", [b"model.pt", b"latest", b"notes.txt", b"\xff.pt"])
    assert probe._toolkits == {b"/usr/local/cuda-12.1", b"/usr/local/cuda"}
    assert probe._py_hints == [b"/x/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so"]
    assert probe._cuda_hints == [b"/x/lib/python3.11/site-packages/torch/lib/libcudart-9335f6a2.so.12"]
    assert probe._py_bins == {b"/x/bin": [b"python3.11", b"python"]}
    assert probe._ckpt == {b"/data/run": [b"model.pt", b"latest", b"\xff.pt"]}


def test_non_utf8_names_survive_json(tmp_path, monkeypatch):
    d = os.path.join(os.fsencode(str(tmp_path)), b"run-\xff")
    os.makedirs(d)
    with open(os.path.join(d, b"model.safetensors"), "wb") as f:
        h = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
        f.write(struct.pack("<Q", len(h)) + h + b"\0" * 4)
    env = capture_environment([str(tmp_path)], deadline_s=10, load_nvml=no_nvml)
    text = json.dumps(env)
    back = json.loads(text)["checkpoints"]["latest_coherent"]["path"]
    assert os.fsencode(back) == os.path.join(d, b"model.safetensors")


def test_symlinks_are_not_followed_and_proc_is_skipped(tmp_path, monkeypatch):
    outside = tmp_path / "outside"
    safetensors(outside / "model.safetensors")
    (tmp_path / "root").mkdir()
    os.symlink(outside, tmp_path / "root" / "link")
    env = capture_environment([str(tmp_path / "root")], deadline_s=10, load_nvml=no_nvml)
    assert env["checkpoints"]["count"] == 0
    probe = EnvironmentProbe(load_nvml=no_nvml)
    assert probe_mod._walk(probe, b"/proc", probe_mod.Deadline(5)) is True
    assert probe.dirs_seen == 0


def test_deadline_keeps_partial_results(tmp_path, monkeypatch):
    venv(tmp_path, {f"pkg{i}": f"1.{i}" for i in range(40)})
    c = hf_ckpt(tmp_path / "run", 5)
    real = pyenv.read_dist_headers

    def slow(path):
        time.sleep(0.1)
        return real(path)

    monkeypatch.setattr(pyenv, "read_dist_headers", slow)
    t0 = time.monotonic()
    env = capture_environment([str(tmp_path)], deadline_s=1.0, load_nvml=no_nvml)
    took = time.monotonic() - t0
    assert took < 2.0
    assert env["complete"] is False
    assert env["notes"][0] == "capture cut short by the 1 s deadline; what was found so far is kept"
    [pe] = env["python_envs"]
    assert pe["partial"] is True
    # every package is still listed: late ones from their directory names
    assert len(pe["packages"]) == 40 and pe["packages"]["pkg39"] == "1.39"
    # the checkpoint found by the walk is kept, though unexamined
    assert env["checkpoints"]["latest_coherent"] is None
    assert env["checkpoints"]["incomplete"][0]["id"] == c
    assert "deadline reached: 2 checkpoint file(s) were not examined" in env["notes"]


def test_walk_deadline(tmp_path, monkeypatch):
    for i in range(30):
        (tmp_path / f"d{i:02d}").mkdir()
    real = EnvironmentProbe.observe_dir

    def slow(self, path, names):
        time.sleep(0.05)
        real(self, path, names)

    monkeypatch.setattr(EnvironmentProbe, "observe_dir", slow)
    t0 = time.monotonic()
    env = capture_environment([str(tmp_path)], deadline_s=0.6, load_nvml=no_nvml)
    assert time.monotonic() - t0 < 1.5
    assert env["complete"] is False
    assert env["notes"][0].startswith("directory walk cut short after ")


def test_probe_local_machine_shape():
    here = probe_local_machine(gpu_timeout_s=5)
    assert set(here) == {"version", "machine", "gpus", "cuda"}
    assert here["machine"]["arch"] == os.uname().machine
    assert isinstance(here["cuda"]["toolkits"], list)
    json.dumps(here)


# ----------------------------------------------------------------- diff


def test_diff_of_two_captures(tmp_path, monkeypatch):
    venv(tmp_path, {"numpy": "1.26.0", "torch": "2.1.0", "tqdm": "4.0", "oldpkg": "1.0"})
    hf_ckpt(tmp_path / "run", 100)
    a = capture_environment([str(tmp_path)], deadline_s=10, load_nvml=no_nvml)

    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    os.rename(site / "numpy-1.26.0.dist-info", site / "numpy-2.0.0.dist-info")
    write(site / "numpy-2.0.0.dist-info" / "METADATA", "Name: numpy\nVersion: 2.0.0\n")
    os.rename(site / "torch-2.1.0.dist-info", site / "torch-2.0.1.dist-info")
    write(site / "torch-2.0.1.dist-info" / "METADATA", "Name: torch\nVersion: 2.0.1\n")
    import shutil

    shutil.rmtree(site / "oldpkg-1.0.dist-info")
    write(site / "newpkg-0.1.dist-info" / "METADATA", "Name: newpkg\nVersion: 0.1\n")
    c200 = hf_ckpt(tmp_path / "run", 200)
    b = capture_environment([str(tmp_path)], deadline_s=10, load_nvml=no_nvml)

    d = diff_environments(a, b)
    assert d["python_envs"] == {"changed": {str(tmp_path / "venv"): {
        "added": {"newpkg": "0.1"}, "removed": {"oldpkg": "1.0"},
        "upgraded": {"numpy": ["1.26.0", "2.0.0"]}, "downgraded": {"torch": ["2.1.0", "2.0.1"]},
    }}}
    assert d["checkpoints"] == {"added": [c200], "latest_coherent": [str(tmp_path / "run" / "checkpoint-100"), c200]}
    assert "machine" not in d and "gpus" not in d
    assert diff_environments(a, a) == {}


def test_diff_reports_gpu_and_driver_changes():
    a, b = manifest(), manifest(gpus=h100(4, name="NVIDIA A100-SXM4-80GB", cc="8.0", cuda="12.2", driver="535.104.05"))
    d = diff_environments(a, b)
    assert d["gpus"] == ["8x NVIDIA H100 80GB HBM3", "4x NVIDIA A100-SXM4-80GB"]
    assert d["driver_version"] == ["550.54.15", "535.104.05"]
    assert d["cuda_driver_version"] == ["12.4", "12.2"]


# -------------------------------------------------------------- warnings


def test_no_warnings_on_the_same_machine():
    assert compatibility_warnings(manifest(), manifest()) == []


def test_each_warning_is_one_sentence():
    cases = {
        "no GPU is usable here": manifest(gpus={"available": False, "reason": "NVML: Driver Not Loaded", "count": 0}),
        "supports CUDA only up to 11.8": manifest(gpus=h100(8, cuda="11.8", driver="520.61.05")),
        "differ in architecture": manifest(gpus=h100(8, name="NVIDIA A100-SXM4-80GB", cc="8.0")),
        "the architecture matches": manifest(gpus=h100(8, name="NVIDIA H200")),
        "has 2 GPU(s) where the snapshot had 8": manifest(gpus=h100(2)),
        "this one is aarch64": manifest(arch="aarch64"),
    }
    for needle, here in cases.items():
        warnings = compatibility_warnings(manifest(), here)
        assert len(warnings) == 1, (needle, warnings)
        w = warnings[0]
        assert needle in w
        assert w.endswith(".") and w.count(". ") == 0 and w[0].isupper()


def test_cuda_warning_names_the_env_and_versions():
    [w] = compatibility_warnings(manifest(torch_cuda="12.4"), manifest(gpus=h100(8, cuda="12.2", driver="535.1")))
    assert w == ("PyTorch 2.1.0+cu121 in /opt/venv was built for CUDA 12.4, but this machine's driver 535.1 "
                 "supports CUDA only up to 12.2; upgrade the driver or expect CUDA initialisation errors.")
    assert compatibility_warnings(manifest(torch_cuda=None), manifest(gpus=h100(8, cuda="11.0"))) == []


# ------------------------------------------------------------------ text


def test_format_puts_latest_checkpoint_first(tmp_path, monkeypatch):
    venv(tmp_path, {"torch": "2.1.0"})
    c = hf_ckpt(tmp_path / "run", 100)
    bad = hf_ckpt(tmp_path / "run", 200)
    os.remove(os.path.join(bad, "trainer_state.json"))
    env = capture_environment([str(tmp_path)], deadline_s=10, load_nvml=no_nvml)
    lines = format_environment(env)
    assert lines[0].startswith(f"Latest coherent checkpoint: {c} (hf-trainer; step 100; epoch 1; model, progress;")
    assert any(line.startswith("    because: ") and "global_step=100" in line for line in lines)
    assert f"  {bad}: no trainer_state.json (the HF Trainer writes it when a save completes)" in lines
    # the HF Trainer itself would resume from the torn checkpoint-200 (the highest N): said so, with the fallback
    run = tmp_path / "run"
    assert (f"Run {run} (HF Trainer): resumes from checkpoint-200 (step 200, NOT coherent; the highest checkpoint-N, "
            "as HF Trainer resumes); most advanced coherent: checkpoint-100 (step 100)") in lines
    assert ("  problem: the run would resume from checkpoint-200, which is not coherent; "
            "the most advanced coherent checkpoint is checkpoint-100") in lines
    assert any(line.startswith(f"Python env {tmp_path / 'venv'} (venv, Python 3.11.4, 1 packages") for line in lines)
    assert any(line.startswith("GPUs: no GPU (") for line in lines)
    empty = copy.deepcopy(env)
    empty["checkpoints"] = {"latest_coherent": None, "runs": [], "incomplete": [], "count": 0}
    assert format_environment(empty)[0] == "Checkpoints: none found"


def test_a_snapshot_toolkit_newer_than_this_driver_is_warned_about_before_mounting():
    snap = manifest(torch_cuda=None)
    snap["cuda"] = {"toolkits": [{"path": "/usr/local/cuda-12.4", "version": "12.4.1"}]}
    [w] = compatibility_warnings(snap, manifest(gpus=h100(8, cuda="12.2", driver="535.104.05")))
    assert "CUDA toolkit 12.4.1 at /usr/local/cuda-12.4 needs a newer driver than this machine's 535.104.05" in w
    assert compatibility_warnings(snap, manifest(gpus=h100(8, cuda="12.4"))) == []
