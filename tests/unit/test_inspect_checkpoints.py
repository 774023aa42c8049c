"""Checkpoint detection: real file layouts built by hand under tmp_path.

torch is normally not installed, so ``torch.save`` files are built the way
torch builds them: an uncompressed zip holding ``archive/data.pkl`` (a
protocol-2 pickle whose tensors are persistent ids
``('storage', torch.FloatStorage, '<key>', 'cpu', numel)`` rebuilt through
``torch._utils._rebuild_tensor_v2``), ``archive/data/<key>``,
``archive/version`` and ``archive/byteorder``.  To get exactly torch's
GLOBAL names into the pickle, stand-in ``torch`` modules are put in
``sys.modules`` only while pickling.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import struct
import sys
import types
import zipfile
from collections import OrderedDict
from dataclasses import dataclass

import pytest

from ogrefs.inspect import capture_environment
from ogrefs.inspect.deadline import Deadline
from ogrefs.inspect.checkpoints import analyze_checkpoints
from ogrefs.inspect.ckptfiles import TORCH_LEGACY_MAGIC, check_file
from ogrefs.inspect.pickle_scan import scan_pickle

# ---------------------------------------------------------------- builders


class FakeStorage:
    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.data = b"\0" * (4 * numel)


class FakeTensor:
    def __init__(self, numel: int) -> None:
        self.storage = FakeStorage(numel)
        self.numel = numel

    def __reduce__(self):
        rebuild = sys.modules["torch._utils"]._rebuild_tensor_v2
        return (rebuild, (self.storage, 0, (self.numel,), (1,), False, OrderedDict()))


def T(n: int = 4) -> FakeTensor:
    return FakeTensor(n)


@contextlib.contextmanager
def _torch_names():
    """Stand-in torch modules so pickle writes torch's own GLOBAL names."""
    if "torch" in sys.modules and not isinstance(sys.modules["torch"], types.ModuleType):
        raise RuntimeError("unexpected torch entry")
    saved = {k: sys.modules.get(k) for k in ("torch", "torch._utils")}
    torch_mod = types.ModuleType("torch")
    utils = types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args):  # pragma: no cover - never called
        raise AssertionError("a checkpoint was unpickled")

    _rebuild_tensor_v2.__module__ = "torch._utils"
    _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    torch_mod.FloatStorage = type("FloatStorage", (), {"__module__": "torch"})
    torch_mod._utils = utils
    sys.modules["torch"], sys.modules["torch._utils"] = torch_mod, utils
    try:
        yield torch_mod
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def torch_pickle(obj) -> tuple[bytes, dict[str, bytes]]:
    buf = io.BytesIO()
    storages: dict[int, tuple[str, FakeStorage]] = {}
    with _torch_names() as torch_mod:

        class P(pickle.Pickler):
            def persistent_id(self, o):
                if isinstance(o, FakeStorage):
                    key = storages.setdefault(id(o), (str(len(storages)), o))[0]
                    return ("storage", torch_mod.FloatStorage, key, "cpu", o.numel)
                return None

        P(buf, protocol=2).dump(obj)
    return buf.getvalue(), {k: s.data for k, s in storages.values()}


def write_torch(path, obj, *, prefix: str = "archive", drop_storage: str | None = None, pickled=None) -> str:
    """A file laid out like torch.save's zip format."""
    data, storages = torch_pickle(obj) if pickled is None else pickled
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{prefix}/data.pkl", data)
        z.writestr(f"{prefix}/byteorder", "little")
        for key, raw in storages.items():
            if key != drop_storage:
                z.writestr(f"{prefix}/data/{key}", raw)
        z.writestr(f"{prefix}/version", "3\n")
        z.writestr(f"{prefix}/.data/serialization_id", "0123456789")
    return str(path)


def write_safetensors(path, tensors: dict[str, tuple[str, list[int]]], *, data_bytes: int | None = None) -> str:
    width = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8}
    header, off = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = width[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"\0" * (off if data_bytes is None else data_bytes))
    return str(path)


def model_sd():
    return OrderedDict([("layer.weight", T(8)), ("layer.bias", T(2))])


def optim_sd():
    return {"state": {0: {"step": T(1), "exp_avg": T(8)}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}


def sched_sd(step: int):
    return {"base_lrs": [0.1], "last_epoch": step, "_step_count": step + 1, "_last_lr": [0.1]}


def rng_sd():
    return {"python": (3, (1, 2, 3), None), "numpy": ("MT19937", T(4), 624, 0, 0.0), "cpu": T(4), "cuda": [T(4)]}


def hf_checkpoint(run, step: int, *, trainer_state: bool = True, state_step: int | None = None) -> str:
    d = os.path.join(str(run), f"checkpoint-{step}")
    write_safetensors(os.path.join(d, "model.safetensors"), {"layer.weight": ("F32", [2, 4]), "layer.bias": ("F32", [2])})
    write_torch(os.path.join(d, "optimizer.pt"), optim_sd())
    write_torch(os.path.join(d, "scheduler.pt"), sched_sd(step))
    write_torch(os.path.join(d, "rng_state.pth"), rng_sd())
    write_torch(os.path.join(d, "training_args.bin"), {"output_dir": str(run)})
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "toy"}, f)
    if trainer_state:
        with open(os.path.join(d, "trainer_state.json"), "w") as f:
            json.dump({"global_step": step if state_step is None else state_step, "epoch": step / 100, "log_history": []}, f)
    return d


def analyze(root) -> dict:
    """Candidates the way the walker would note them, then the analysis."""
    env = capture_environment([str(root)], deadline_s=20)
    return env["checkpoints"]


def unit(section: dict, cid: str) -> dict:
    for run in section["runs"]:
        for c in run["checkpoints"]:
            if c["id"] == cid:
                return c
    raise AssertionError(f"{cid} not found in {[c['id'] for r in section['runs'] for c in r['checkpoints']]}")


# ------------------------------------------------------------ pickle scan


def test_scan_reads_top_level_keys_not_nested_ones():
    data, _ = torch_pickle({
        "epoch": 2, "global_step": 300, "pytorch-lightning_version": "2.1.0",
        "state_dict": model_sd(), "optimizer_states": [optim_sd()], "lr_schedulers": [sched_sd(300)],
    })
    s = scan_pickle(data)
    assert s.error is None
    assert s.top_type == "dict"
    assert s.top_keys["epoch"] == 2 and s.top_keys["global_step"] == 300
    assert s.top_keys["state_dict"] == "dict"
    # 'step' exists only inside the optimizer state; it is not a top-level key
    assert "step" not in s.top_keys and "last_epoch" not in s.top_keys
    assert set(s.storages) == {"0", "1", "2", "3"}
    assert "torch._utils._rebuild_tensor_v2" in s.globals and s.unusual_globals == []


def test_scan_survives_garbage_and_truncation():
    data, _ = torch_pickle({"global_step": 5, "model": model_sd()})
    s = scan_pickle(data[: len(data) // 2])
    assert s.error and "malformed" in s.error
    assert s.top_keys.get("global_step") == 5  # what came before the cut is kept
    assert scan_pickle(b"\x80\x02garbage!!").error


# ------------------------------------------------------ never unpickle


class _OpenPayload:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


class _SystemPayload:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_malicious_pickle_is_never_loaded(tmp_path):
    # Control: the payload really does create a file when unpickled.
    control = tmp_path / "control-marker"
    pickle.loads(pickle.dumps(_OpenPayload(str(control)), protocol=2)).close()
    assert control.exists()

    m1, m2, m3 = (tmp_path / f"pwned-{i}" for i in (1, 2, 3))
    run = tmp_path / "run"
    run.mkdir()
    # torch zip whose data.pkl runs open() / os.system() when loaded
    # payloads first: a loader reaches them before any tensor
    evil = torch_pickle({"x": _OpenPayload(str(m1)), "y": _SystemPayload(str(m2)), "model": model_sd()})
    write_torch(run / "model_step5.pt", None, pickled=evil)
    # a bare pickle with a .pt name, and a DCP .metadata
    (run / "evil.pt").write_bytes(pickle.dumps({"model": _OpenPayload(str(m3))}, protocol=2))
    dcp = run / "step_7"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(pickle.dumps(_SystemPayload(str(m3)), protocol=2))
    (dcp / "__0_0.distcp").write_bytes(b"\0" * 16)

    fc = check_file(str(run / "model_step5.pt"))
    section = analyze(tmp_path)

    for m in (m1, m2, m3):
        assert not m.exists(), f"{m.name} was created: a pickle was loaded"
    assert "torch" not in sys.modules or sys.modules["torch"].__spec__ is not None
    assert fc.ok is True and "model" in fc.components
    assert any("open" in g for g in fc.unusual_globals)
    assert any("system" in g for g in fc.unusual_globals)
    c = unit(section, str(run / "model_step5.pt"))
    assert c["coherent"] is False and any("weights_only" in p for p in c["problems"])
    assert (section["latest_coherent"] or {}).get("id") != c["id"]


# ------------------------------------------------------- file verdicts


def test_truncated_zip_is_incomplete(tmp_path):
    p = write_torch(tmp_path / "ckpt_100.pt", {"model": model_sd(), "optimizer": optim_sd(), "step": 100})
    good = check_file(p)
    assert good.ok is True and good.kind == "torch-zip"
    assert "zip central directory intact (8 members)" in good.evidence
    assert good.components == {"model", "optimizer", "progress"} and good.step == 100

    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.truncate(size - 40)
    bad = check_file(p)
    assert bad.ok is False
    assert "central directory unreadable" in bad.problems[0]


def test_member_past_end_of_file_is_detected(tmp_path):
    p = write_torch(tmp_path / "m.pt", {"model": model_sd()})
    with zipfile.ZipFile(p) as z:
        cd = z.start_dir
    raw = bytearray(open(p, "rb").read())
    # Make the central directory claim a bigger size for archive/data/0.
    while True:
        assert raw[cd: cd + 4] == b"PK\x01\x02"
        name_len = struct.unpack_from("<H", raw, cd + 28)[0]
        name = bytes(raw[cd + 46: cd + 46 + name_len])
        if name == b"archive/data/0":
            break
        extra, comment = struct.unpack_from("<HH", raw, cd + 30)
        cd = cd + 46 + name_len + extra + comment
    struct.pack_into("<I", raw, cd + 20, 10_000_000)  # compressed size
    struct.pack_into("<I", raw, cd + 24, 10_000_000)  # uncompressed size
    open(p, "wb").write(raw)
    fc = check_file(p)
    assert fc.ok is False
    assert "archive/data/0: data ends at byte" in fc.problems[0]


def test_missing_storage_member_is_detected(tmp_path):
    p = write_torch(tmp_path / "m.pt", {"model": model_sd()}, drop_storage="1")
    fc = check_file(p)
    assert fc.ok is False
    assert "missing from the zip (e.g. data/1)" in fc.problems[0]


def test_safetensors_truncated_and_padded(tmp_path):
    ok = check_file(write_safetensors(tmp_path / "ok.safetensors", {"w": ("F32", [250])}))
    assert ok.ok is True and ok.components == {"model"}
    assert "1 tensors, 1000 data bytes, matches file size" in ok.evidence[0]

    short = check_file(write_safetensors(tmp_path / "short.safetensors", {"w": ("F32", [250])}, data_bytes=600))
    assert short.ok is False
    assert short.problems == ["safetensors header says 1000 bytes of tensor data but the file has 600; truncated"]

    long = check_file(write_safetensors(tmp_path / "long.safetensors", {"w": ("F32", [250])}, data_bytes=1010))
    assert long.ok is False and "10 bytes after the last tensor" in long.problems[0]

    (tmp_path / "tiny.safetensors").write_bytes(b"\x10\0\0")
    assert check_file(str(tmp_path / "tiny.safetensors")).ok is False


def test_legacy_torch_file_that_stops_after_its_magic_number_is_torn(tmp_path):
    p = tmp_path / "old.pt"
    p.write_bytes(b"\x80\x02\x8a\x0a" + TORCH_LEGACY_MAGIC.to_bytes(10, "little") + b".\x80\x02}q\x00.")
    fc = check_file(str(p))
    assert fc.kind == "torch-legacy" and fc.ok is False and "cut off" in fc.problems[0]
    p.write_bytes(b"\x80\x02\x8a")  # cut inside the magic number's opcode: a verdict, not an IndexError
    assert check_file(str(p)).ok is not True


# -------------------------------------------------------- HF Trainer


def test_hf_trainer_latest_by_step_not_mtime(tmp_path):
    run = tmp_path / "out"
    c100 = hf_checkpoint(run, 100)
    c200 = hf_checkpoint(run, 200)
    # checkpoint-100 touched last: mtime must not decide
    for root, _dirs, files in os.walk(c100):
        for f in files:
            os.utime(os.path.join(root, f), (2_000_000_000, 2_000_000_000))
    section = analyze(tmp_path)
    latest = section["latest_coherent"]
    assert latest["id"] == c200
    assert latest["format"] == "hf-trainer" and latest["step"] == 200 and latest["epoch"] == 2.0
    assert latest["components"] == ["model", "optimizer", "scheduler", "rng", "progress"]
    assert latest["complete"] is True and latest["coherent"] is True
    assert "trainer_state.json global_step=200" in latest["evidence"]
    assert "optimizer.pt: zip central directory intact (6 members)" in latest["evidence"]
    assert unit(section, c100)["coherent"] is True
    assert section["incomplete"] == []
    run_rec = section["runs"][0]
    assert run_rec["dir"] == str(run) and run_rec["latest_coherent"] == c200
    assert [c["id"] for c in run_rec["checkpoints"]] == [c200, c100]


def test_hf_interrupted_save_falls_back(tmp_path):
    run = tmp_path / "out"
    hf_checkpoint(run, 100)
    c200 = hf_checkpoint(run, 200)
    c300 = hf_checkpoint(run, 300, trainer_state=False)
    st = os.path.join(c300, "model.safetensors")
    with open(st, "r+b") as f:
        f.truncate(os.path.getsize(st) - 8)
    section = analyze(tmp_path)
    assert section["latest_coherent"]["id"] == c200
    bad = unit(section, c300)
    assert bad["complete"] is False and bad["coherent"] is False
    assert bad["step"] == 300
    assert any("model.safetensors: safetensors header says 40 bytes" in p for p in bad["problems"])
    assert any("no trainer_state.json" in p for p in bad["problems"])
    assert [i["id"] for i in section["incomplete"]] == [c300]


def test_progress_points_must_agree(tmp_path):
    run = tmp_path / "out"
    c = hf_checkpoint(run, 500, state_step=499)
    section = analyze(tmp_path)
    u = unit(section, c)
    assert u["coherent"] is False
    assert "progress points disagree: directory 'checkpoint-500' says 500, trainer_state.json says 499" in u["problems"]
    assert section["latest_coherent"] is None


def test_sharded_weights_need_every_shard(tmp_path):
    d = tmp_path / "out" / "checkpoint-10"
    write_safetensors(d / "model-00001-of-00002.safetensors", {"a": ("F32", [4])})
    (d / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": 32},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }))
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    section = analyze(tmp_path)
    u = unit(section, str(d))
    assert u["coherent"] is False
    assert "model.safetensors.index.json lists 1 missing shard(s): model-00002-of-00002.safetensors" in u["problems"]
    assert "missing shard(s): model-00002-of-00002.safetensors" in u["problems"]

    write_safetensors(d / "model-00002-of-00002.safetensors", {"b": ("F32", [4])})
    assert unit(analyze(tmp_path), str(d))["coherent"] is True


# -------------------------------------------------------- loose files


def test_weights_and_optimizer_from_different_steps(tmp_path):
    run = tmp_path / "run"
    write_torch(run / "model_step9.pt", model_sd())
    write_torch(run / "optimizer_step9.pt", optim_sd())
    write_torch(run / "model_step10.pt", model_sd())
    section = analyze(tmp_path)
    s9, s10 = unit(section, f"{run}#step 9"), unit(section, str(run / "model_step10.pt"))
    assert s9["coherent"] is True and s9["components"] == ["model", "optimizer"]
    assert s10["complete"] is True and s10["coherent"] is False
    assert s10["problems"] == ["no optimizer state for step 10; optimizer state exists only for step 9"]
    assert section["latest_coherent"]["id"] == f"{run}#step 9"
    assert {i["id"] for i in section["incomplete"]} == {str(run / "model_step10.pt")}


def test_no_coherent_checkpoint_when_nothing_matches(tmp_path):
    run = tmp_path / "run"
    write_torch(run / "optimizer_step9.pt", optim_sd())
    write_torch(run / "model_step10.pt", model_sd())
    section = analyze(tmp_path)
    assert section["latest_coherent"] is None
    s9 = unit(section, str(run / "optimizer_step9.pt"))
    assert "no model weights" in s9["problems"]
    s10 = unit(section, str(run / "model_step10.pt"))
    assert "no optimizer state for step 10; optimizer state exists only for step 9" in s10["problems"]


def test_latest_symlink_and_truncated_newer_file(tmp_path):
    run = tmp_path / "run"
    write_torch(run / "ckpt_100.pt", {"model": model_sd(), "optimizer": optim_sd(), "step": 100})
    p200 = write_torch(run / "ckpt_200.pt", {"model": model_sd(), "optimizer": optim_sd(), "step": 200})
    with open(p200, "r+b") as f:
        f.truncate(100)
    os.symlink("ckpt_100.pt", run / "latest")
    section = analyze(tmp_path)
    assert section["latest_coherent"]["id"] == str(run / "ckpt_100.pt")
    assert section["latest_coherent"]["format"] == "torch"
    assert "pickle key 'step'=100" in " ".join(section["latest_coherent"]["evidence"])
    ptr = section["runs"][0]["pointers"][0]
    assert ptr["kind"] == "symlink" and ptr["resolves_to"] == str(run / "ckpt_100.pt") and ptr["target_coherent"] is True
    assert unit(section, p200)["complete"] is False


def test_lightning_checkpoint_and_last_link(tmp_path):
    run = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    p = write_torch(run / "epoch=2-step=300.ckpt", {
        "epoch": 2, "global_step": 300, "pytorch-lightning_version": "2.1.0",
        "state_dict": model_sd(), "loops": {"fit_loop": {}}, "callbacks": {},
        "optimizer_states": [optim_sd()], "lr_schedulers": [sched_sd(300)],
    })
    os.symlink("epoch=2-step=300.ckpt", run / "last.ckpt")
    section = analyze(tmp_path)
    latest = section["latest_coherent"]
    assert latest["id"] == p and latest["format"] == "lightning"
    assert latest["step"] == 300 and latest["epoch"] == 2
    assert latest["components"] == ["model", "optimizer", "scheduler", "progress"]
    assert section["runs"][0]["pointers"][0]["resolves_to"] == p


def test_bare_state_dict_counts_as_model(tmp_path):
    p = write_torch(tmp_path / "weights" / "final.pt", model_sd())
    fc = check_file(p)
    assert fc.components == {"model"}
    section = analyze(tmp_path)
    assert section["latest_coherent"]["id"] == p


# ------------------------------------------------- DeepSpeed and FSDP


def deepspeed_step(run, step: int, ranks, world: int = 4) -> str:
    d = os.path.join(str(run), f"global_step{step}")
    write_torch(os.path.join(d, "mp_rank_00_model_states.pt"), {
        "module": model_sd(), "optimizer": None, "lr_scheduler": sched_sd(step),
        "global_steps": step, "global_samples": step * 8, "dp_world_size": world,
        "mp_world_size": 1, "ds_version": "0.12.0",
    })
    for r in ranks:
        write_torch(os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"),
                    {"optimizer_state_dict": {"state": {}, "param_groups": []}, "ds_version": "0.12.0"})
    return d


def test_deepspeed_missing_shard_and_latest_pointer(tmp_path):
    run = tmp_path / "ds"
    d900 = deepspeed_step(run, 900, range(4))
    d1000 = deepspeed_step(run, 1000, [0, 1, 3])
    d1100 = deepspeed_step(run, 1100, [0, 1, 2])
    (run / "latest").write_text("global_step1000")
    section = analyze(tmp_path)
    good = unit(section, d900)
    assert good["coherent"] is True and good["format"] == "deepspeed"
    assert good["step"] == 900 and good["components"] == ["model", "optimizer", "scheduler", "progress"]
    gap = unit(section, d1000)
    assert gap["coherent"] is False
    assert gap["problems"] == [
        "ZeRO optimizer shard rank(s) 2 missing (e.g. zero_pp_rank_2_mp_rank_00_optim_states.pt); present: 0, 1, 3"
    ]
    tail = unit(section, d1100)
    assert tail["problems"] == [
        "model_states records dp_world_size=4 but only 3 ZeRO optimizer shard(s) "
        "(zero_pp_rank_*_mp_rank_00_optim_states.pt) are present"
    ]
    assert section["latest_coherent"]["id"] == d900
    ptr = section["runs"][0]["pointers"][0]
    assert ptr["target"] == "global_step1000" and ptr["resolves_to"] == d1000
    assert ptr["problem"] == "latest points to global_step1000, which is not coherent; latest coherent is global_step900"


def test_hf_checkpoint_with_deepspeed_inside(tmp_path):
    run = tmp_path / "out"
    c = hf_checkpoint(run, 50)
    deepspeed_step(c, 50, range(2), world=2)
    (run / "checkpoint-50" / "latest").write_text("global_step50")
    section = analyze(tmp_path)
    u = unit(section, c)
    assert u["format"] == "hf-trainer+deepspeed" and u["coherent"] is True
    assert "pointer latest -> global_step50" in u["evidence"]
    assert section["count"] == 1


def test_hf_checkpoints_with_deepspeed_inside_are_alike_whatever_their_step(tmp_path):
    # checkpoint-50/global_step50/... and checkpoint-60/global_step60/...: the same files, under step-named dirs
    run = tmp_path / "out"
    for step in (50, 60):
        deepspeed_step(hf_checkpoint(run, step), step, range(2), world=2)
    section = analyze(tmp_path)
    for step in (50, 60):
        u = unit(section, str(run / f"checkpoint-{step}"))
        assert u["coherent"] is True, u["problems"]


def test_megatron_iteration_dirs(tmp_path):
    run = tmp_path / "megatron"
    for it in (100, 200):
        write_torch(run / f"iter_{it:07d}" / "mp_rank_00" / "model_optim_rng.pt", {
            "args": {"lr": 1e-4}, "checkpoint_version": 3.0, "iteration": it, "model": model_sd(),
            "optimizer": optim_sd(), "opt_param_scheduler": sched_sd(it), "rng_state": [rng_sd()],
        })
    # the newest one lost its model-parallel rank 1 file
    write_torch(run / "iter_0000200" / "mp_rank_01" / "model_optim_rng.pt", {"iteration": 200, "model": model_sd()})
    (run / "iter_0000200" / "mp_rank_01" / "model_optim_rng.pt").write_bytes(b"PK\x03\x04 cut short")
    (run / "latest_checkpointed_iteration.txt").write_text("100")
    section = analyze(tmp_path)
    good = unit(section, str(run / "iter_0000100"))
    assert good["format"] == "megatron" and good["step"] == 100 and good["coherent"] is True
    assert good["components"] == ["model", "optimizer", "scheduler", "rng", "progress"]
    assert unit(section, str(run / "iter_0000200"))["complete"] is False
    assert section["latest_coherent"]["id"] == str(run / "iter_0000100")
    ptr = section["runs"][0]["pointers"][0]
    assert ptr["resolves_to"] == str(run / "iter_0000100") and "problem" not in ptr


@dataclass
class _StorageInfo:  # same shape as torch.distributed.checkpoint's
    relative_path: str
    offset: int
    length: int


@dataclass
class _Metadata:
    state_dict_metadata: dict
    storage_data: dict


def dcp_step(run, name: str, sizes: dict[str, int], *, meta_names=None, metadata: bool = True) -> str:
    d = os.path.join(str(run), name)
    os.makedirs(d)
    for fname, size in sizes.items():
        with open(os.path.join(d, fname), "wb") as f:
            f.write(b"\0" * size)
    if metadata:
        names = list(sizes) if meta_names is None else meta_names
        md = _Metadata(
            state_dict_metadata={"model.layer.weight": None, "optimizer.state.layer.weight.exp_avg": None},
            storage_data={i: _StorageInfo(n, 0, 64) for i, n in enumerate(names)},
        )
        with open(os.path.join(d, ".metadata"), "wb") as f, _as_module("torch.distributed.checkpoint.metadata",
                                                                    Metadata=_Metadata, _StorageInfo=_StorageInfo):
            pickle.dump(md, f, protocol=4)
    return d


@contextlib.contextmanager
def _as_module(name: str, **classes):
    """Pickle ``classes`` under ``name`` (the real module's GLOBAL names), without importing it."""
    saved, mod = sys.modules.get(name), types.ModuleType(name)
    olds = {}
    for attr, cls in classes.items():
        olds[cls] = (cls.__module__, cls.__qualname__)
        cls.__module__, cls.__qualname__ = name, attr
        setattr(mod, attr, cls)
    sys.modules[name] = mod
    try:
        yield
    finally:
        for cls, (m, q) in olds.items():
            cls.__module__, cls.__qualname__ = m, q
        if saved is None:
            del sys.modules[name]
        else:
            sys.modules[name] = saved


def test_fsdp_distcp_shards(tmp_path):
    run = tmp_path / "fsdp"
    ok = dcp_step(run, "step_100", {"__0_0.distcp": 64, "__1_0.distcp": 64})
    missing = dcp_step(run, "step_200", {"__0_0.distcp": 64}, meta_names=["__0_0.distcp", "__1_0.distcp"])
    unfinished = dcp_step(run, "step_300", {"__0_0.distcp": 64, "__1_0.distcp": 64}, metadata=False)
    short = dcp_step(run, "step_400", {"__0_0.distcp": 64, "__1_0.distcp": 10})
    section = analyze(tmp_path)
    u = unit(section, ok)
    assert u["coherent"] is True and u["format"] == "torch-dcp"
    assert u["components"] == ["model", "optimizer"]
    assert ".metadata present and all 2 named shard(s) found" in u["evidence"]
    assert unit(section, missing)["problems"] == [".metadata names 1 missing shard(s): __1_0.distcp"]
    assert unit(section, unfinished)["problems"][0].startswith("no .metadata (torch.distributed.checkpoint writes it last")
    assert unit(section, short)["problems"] == ["__1_0.distcp: .metadata needs 64 bytes, file has 10; truncated"]
    assert section["latest_coherent"]["id"] == ok


# ------------------------------------------------------------- misc


def test_files_that_are_not_checkpoints_are_ignored(tmp_path):
    (tmp_path / "notes.bin").write_bytes(b"\x01\x02 random")
    (tmp_path / "data.pt").write_bytes(b"")
    sp = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    sp.mkdir(parents=True)
    write_torch(sp / "pkg" / "weights.pt", model_sd())
    section = analyze(tmp_path)
    assert section == {"latest_coherent": None, "runs": [], "incomplete": [], "count": 0}
    # ... but an empty file named like a checkpoint is an interrupted save
    (tmp_path / "ckpt_100.pt").write_bytes(b"")
    section = analyze(tmp_path)
    assert section["incomplete"] == [
        {"id": str(tmp_path / "ckpt_100.pt"), "path": str(tmp_path / "ckpt_100.pt"), "reason": "ckpt_100.pt: file is empty"}
    ]


def test_deadline_leaves_files_unexamined(tmp_path):
    run = tmp_path / "run"
    write_torch(run / "ckpt_1.pt", {"model": model_sd(), "step": 1})
    section, hints, notes = analyze_checkpoints({str(run): ["ckpt_1.pt"]}, Deadline(0))
    assert notes == ["deadline reached: 1 checkpoint file(s) were not examined"]
    assert section["latest_coherent"] is None and hints == []
    assert section["incomplete"][0]["reason"] == "ckpt_1.pt: not examined: deadline reached"


def test_real_torch_save_is_understood(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    p = str(tmp_path / "run" / "ckpt_step7.pt")
    os.makedirs(os.path.dirname(p))
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7}, p)
    fc = check_file(p)
    assert fc.ok is True and fc.kind == "torch-zip"
    assert fc.components == {"model", "optimizer", "progress"} and fc.step == 7
    assert fc.unusual_globals == []


def test_data_shards_named_bin_are_not_checkpoints(tmp_path):
    """Random-content ``shard-00087.bin`` files are data, not broken checkpoints."""
    from ogrefs.inspect import capture_environment

    data = tmp_path / "data"
    data.mkdir()
    for i in (7, 87):
        (data / f"shard-{i:05d}.bin").write_bytes(bytes([0xCA, 0xFE]) + os.urandom(4096))
    env = capture_environment([str(tmp_path)], deadline_s=10)
    assert env["checkpoints"]["incomplete"] == [] and env["checkpoints"]["count"] == 0
