"""The lab's root cache: a stage appears only complete, is built once, and a failed build leaves nothing."""

from __future__ import annotations

import threading

import pytest

from tests.lab import roots

pytestmark = pytest.mark.lab


def test_stage_is_built_once_and_renamed_into_place_when_complete(tmp_path):
    calls = []

    def build(tmp):
        calls.append(tmp)
        assert not (tmp.parent / "stage").exists()  # not visible while it is being built
        (tmp / "root").mkdir()
        (tmp / "root" / "done").write_text("yes")

    threads = [threading.Thread(target=roots._build_stage, args=(tmp_path / "stage", build, lambda m: None))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1
    assert (tmp_path / "stage/root/done").read_text() == "yes"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_a_failed_build_leaves_nothing_that_looks_complete(tmp_path):
    def build(tmp):
        (tmp / "root").mkdir()
        raise RuntimeError("mirror went away")

    with pytest.raises(RuntimeError, match="mirror went away"):
        roots._build_stage(tmp_path / "stage", build, lambda m: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]


def test_the_recipe_hash_follows_the_project_dependencies(monkeypatch):
    before = roots.base_recipe_hash()
    monkeypatch.setattr(roots, "project_dependencies", lambda: ["pyfuse3>=9"])
    assert roots.base_recipe_hash() != before
