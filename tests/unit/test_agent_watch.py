"""The agent's new-checkpoint trigger follows the capture's rules (tier 1: real files, no agent process)."""

from __future__ import annotations

import io
import os
import zipfile

from ogrefs.agent.watch import CheckpointWatch


def _save(path, step: int, mtime: float) -> None:
    """A step-numbered checkpoint file of a plain loop: a torch.save zip without tensors."""
    import pickle

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"model": {}, "optimizer": {}, "step": step}, protocol=2))
        z.writestr("archive/version", "3\n")
    path.write_bytes(buf.getvalue())
    os.utime(path, (mtime, mtime))


def _latest(run, name: str, mtime: float) -> None:
    (run / "latest").write_text(name + "\n")
    os.utime(run / "latest", (mtime, mtime))


def test_a_restarted_run_saving_a_lower_step_later_triggers(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for step in (10, 20):
        _save(run / f"step_{step}.pt", step, 1000.0 + step)
    _latest(run, "step_20.pt", 1021.0)
    watch = CheckpointWatch([str(tmp_path)], quiet_s=0.0)
    watch.scan(now=0.0)
    first = watch.scan(now=1.0)
    assert first is not None and first.step == 20
    # restarted with a new seed: step_10.pt rewritten, latest names it; the old step_20.pt stays
    _save(run / "step_10.pt", 10, 2000.0)
    _latest(run, "step_10.pt", 2001.0)
    watch.scan(now=2.0)
    again = watch.scan(now=3.0)
    assert again is not None and again.step == 10 and again.path.endswith("step_10.pt")
    assert watch.scan(now=4.0) is None  # reported once
