"""The environment manifest through the CLI: show, diff, hints, and the restore-time check."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ogrefs.repo import codec
from ogrefs.repo.catalog import Catalog
from ogrefs.repo import Repository

from tests.cli_run import assert_one_line_error, run
from tests.envmaker import h100, hf_ckpt, venv, write


def _box(root):
    v = venv(root, {"torch": "2.1.0+cu121", "numpy": "1.26.4"})
    write(os.path.join(v, "lib", "python3.11", "site-packages", "torch", "version.py"),
          "__version__ = '2.1.0+cu121'\ncuda = '12.1'\n")
    run_dir = os.path.join(str(root), "out")
    hf_ckpt(run_dir, 100)
    hf_ckpt(run_dir, 200)
    return v


def test_show_diff_and_hints(tmp_path):
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"))
    box = tmp_path / "box"
    v = _box(box)
    run(["init"], env)
    a = json.loads(run(["snapshot", "--json", str(box)], env).stdout)
    envm = a["environment"]
    venvs = {e["path"]: e for e in envm["python_envs"]}
    assert venvs[v]["packages"]["torch"] == "2.1.0+cu121" and venvs[v]["torch"]["cuda"] == "12.1"
    latest = envm["checkpoints"]["latest_coherent"]
    assert latest["step"] == 200 and latest["id"].endswith("checkpoint-200")
    # hints land in the catalog as inodes of the snapshot
    repo = Repository.open(str(tmp_path / "repo"), cache_root=tmp_path / "cache")
    cat = Catalog(repo.catalog_path(a["id"]))
    classes = {k for k, _ino, _rank in cat.hints()}
    assert {"python", "checkpoint"} <= classes
    human = run(["show", "latest"], env).stdout
    assert "checkpoint-200" in human and "torch" in human
    # the next day: torch upgraded, a new checkpoint
    site = os.path.join(v, "lib", "python3.11", "site-packages")
    os.rename(os.path.join(site, "torch-2.1.0+cu121.dist-info"), os.path.join(site, "torch-2.2.0.dist-info"))
    write(os.path.join(site, "torch-2.2.0.dist-info", "METADATA"), "Name: torch\nVersion: 2.2.0\n")
    hf_ckpt(os.path.join(str(box), "out"), 300)
    b = json.loads(run(["snapshot", "--json", str(box)], env).stdout)
    d = json.loads(run(["diff", "--json", a["id"], b["id"]], env).stdout)
    assert any(p.endswith("checkpoint-300") for p in d["files"]["added"])
    flat = json.dumps(d["environment"])
    assert "2.2.0" in flat and "torch" in flat
    assert "environment:" in run(["diff", a["id"], b["id"]], env).stdout


def _snapshot_as_if_taken_with(tmp_path, gpus: list) -> tuple[dict, dict]:
    """A snapshot of a small box whose manifest says it was taken on a machine with ``gpus``."""
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"))
    box = tmp_path / "box"
    _box(box)
    run(["init"], env)
    snap = json.loads(run(["snapshot", "--json", str(box)], env).stdout)
    key = tmp_path / "repo" / "snapshots" / snap["id"]
    m = json.loads(codec.unwrap(key.read_bytes()))
    m["environment"]["gpus"] = gpus
    key.write_bytes(codec.wrap(json.dumps(m).encode()))
    return env, snap


def test_strict_restore_refuses_on_a_box_without_the_gpus(tmp_path):
    # This test box has no GPU; pretend the snapshot came from an 8x H100 machine.
    env, snap = _snapshot_as_if_taken_with(tmp_path, h100(8))
    fresh = dict(env, OGREFS_CACHE_DIR=str(tmp_path / "cache2"))
    proc = run(["restore", snap["id"], str(tmp_path / "out")], fresh)
    assert "warning:" in proc.stderr and "GPU" in proc.stderr
    assert_one_line_error(run(["restore", "--strict", snap["id"], str(tmp_path / "out2")], fresh, check=False),
                          "--strict")
    assert not (tmp_path / "out2").exists()


def test_show_and_diff_report_the_driver_on_both_sides(tmp_path):
    env, snap = _snapshot_as_if_taken_with(tmp_path, h100(8, driver="535.104.05", cuda="12.2"))  # another provider's box
    fresh = dict(env, OGREFS_CACHE_DIR=str(tmp_path / "cache2"))
    shown = run(["show", snap["id"]], fresh).stdout
    assert f"driver of snapshot {snap['id'][:12]}: 535.104.05 (CUDA up to 12.2)" in shown
    assert "driver of this box: no NVIDIA driver" in shown  # this test box has none
    diffed = run(["diff", snap["id"], snap["id"]], fresh).stdout
    assert diffed.count("535.104.05") == 2 and "driver of this box:" in diffed


def test_show_names_each_frameworks_step_and_resume_target(ckpt_corpus, tmp_path):
    """show, text and JSON, on the clean saves the frameworks made (tests/ckpt_corpus.py)."""
    box = tmp_path / "box"
    for name in ("hf", "accelerate", "lightning", "dcp", "deepspeed", "plain"):
        src, skip = ckpt_corpus[name]
        if not skip:
            shutil.copytree(src, box / name, symlinks=True)
    if not box.exists():
        pytest.skip("no framework installed")
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"))
    run(["init"], env)
    snap = json.loads(run(["snapshot", "--json", str(box)], env).stdout)
    shown = json.loads(run(["show", "--json", snap["id"]], env).stdout)
    runs = {r["dir"]: r for r in shown["environment"]["checkpoints"]["runs"]}
    text = run(["show", snap["id"]], env).stdout
    expect = {
        "hf/run": ("HF Trainer", "checkpoint-40", 40), "accelerate/checkpoints": ("accelerate", "checkpoint_3", 40),
        "lightning/clean": ("Lightning", "last.ckpt", 40), "dcp": ("torch.distributed.checkpoint", "step_40", 40),
        "deepspeed/clean": ("DeepSpeed", "global_step40", 40), "plain/zip": ("torch", "step_40.pt", 40),
    }
    for sub, (fw, target, step) in expect.items():
        if ckpt_corpus[sub.split("/")[0]][1]:
            continue
        d = str(box / sub)
        resume = runs[d]["resume"]
        assert resume["name"] == target and resume["step"] == step and resume["coherent"]
        assert runs[d]["framework"] and not runs[d]["problems"]
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(f"Run {d} "))
        assert f"({fw})" in line and f"resumes from {target} (step {step}, coherent" in line
