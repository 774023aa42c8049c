"""The tree build's child process: its priority, its failures as the materializer reports them, its end with
the daemon.  Real processes throughout (the child is buildchild.main, with a prelude to slow it or break it)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ogrefs.lazy.fetch.fetcher import Fetcher
from ogrefs.lazy.background.materialize.materializer import Materializer

from tests.resume_box import Box, build_child, make_box, run_trio, spinning_build_child
from tests.treegen import compare_trees


@pytest.fixture(scope="module")
def box(tmp_path_factory) -> Box:
    return make_box(tmp_path_factory.mktemp("box"))


def test_the_build_runs_in_a_child_at_idle_priority(box, tmp_path):
    """SCHED_IDLE: a core only when nothing else wants one; and not in the daemon's process (no GIL shared)."""
    seen = tmp_path / "seen"
    spy = build_child(f"""
        import os
        from ogrefs.lazy.background.materialize import build
        real = build.build
        def spying(*args):
            open({str(seen)!r}, "w").write(f"{{os.getpid()}} {{os.sched_getscheduler(0)}}")
            return real(*args)
        build.build = spying
        """)
    fetcher = Fetcher(box.repo.read_pack_range)
    m = Materializer(box.catalog, fetcher, tmp_path / "state", build_command=spy)
    run_trio(fetcher, m.run)
    assert m.complete and compare_trees(box.src, box.tree_of(tmp_path / "state")) == []
    pid, policy = (int(x) for x in seen.read_text().split())
    assert pid != os.getpid() and policy == os.SCHED_IDLE


@pytest.mark.expect_log(r"stopped: the disk of .* is full \(preparing the local tree", level=logging.ERROR)
def test_a_full_disk_in_the_child_stops_the_materializer_with_the_reason_and_nothing_looks_built(box, tmp_path):
    full = build_child("""
        import errno, os
        from ogrefs.localtree import LocalTree
        made = [0]
        real = LocalTree.create_file
        def create_file(self, *args):
            made[0] += 1
            if made[0] > 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(self, *args)
        LocalTree.create_file = create_file
        """)
    fetcher = Fetcher(box.repo.read_pack_range)
    m = Materializer(box.catalog, fetcher, tmp_path / "state", build_command=full)
    run_trio(fetcher, m.run)
    assert m.state == "stopped" and "is full" in m.reason and not m.complete
    assert not m.is_built()  # the child's plan transaction never committed
    m2 = Materializer(box.catalog, Fetcher(box.repo.read_pack_range), tmp_path / "state")
    run_trio(m2.fetcher, m2.run)  # the next run builds it whole
    assert m2.complete and compare_trees(box.src, box.tree_of(tmp_path / "state")) == []


@pytest.mark.parametrize("how,says", [("import os\nos._exit(3)", "exited with status 3"),
                                      ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
                                       "was killed by signal 9"),
                                      ("raise RuntimeError('a bug')", "exited with status 1")])
@pytest.mark.expect_log(r"stopped: preparing the local tree failed \(the tree build process", level=logging.ERROR)
def test_a_child_that_dies_stops_the_materializer_with_a_one_line_reason(box, tmp_path, how, says):
    fetcher = Fetcher(box.repo.read_pack_range)
    m = Materializer(box.catalog, fetcher, tmp_path / "state", build_command=build_child(how))
    run_trio(fetcher, m.run)
    assert m.state == "stopped" and says in m.reason and "\n" not in m.reason and not m.is_built()


def test_the_child_dies_with_the_daemon(box, tmp_path):
    """A daemon killed with SIGKILL leaves no build writing a state directory a later mount reuses."""
    pid_file = tmp_path / "child.pid"
    slow = build_child(f"""
        import os, time
        from ogrefs.lazy.background.materialize import build
        def sleeping(*args):  # (the build itself: the child has asked to die with its parent by then)
            open({str(pid_file)!r}, "w").write(str(os.getpid()))
            time.sleep(60)
        build.build = sleeping
        """)
    daemon = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from ogrefs.lazy.background.materialize.buildproc import build_in_child
        from ogrefs.box.copyplan import Plan
        plan = Plan(Path({str(tmp_path / "plan.sqlite")!r}))
        plan.open("x")
        build_in_child(plan.path, Path({str(box.catalog.path)!r}), {os.fsencode(tmp_path / "tree")!r},
                       None, {slow!r})
        """)
    proc = subprocess.Popen([sys.executable, "-c", daemon], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert os.path.exists(f"/proc/{child}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(child):
            assert time.monotonic() < deadline, "the build's child outlived its daemon"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for init to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_box_whose_every_core_is_busy_still_gets_its_tree_built(box, tmp_path):
    """At idle priority alone the child got ~0.3 % of a core beside a CPU loop on every core (these tests took
    310 s instead of 22 s); starved, it gets a quarter of the time at normal priority, so the build ends."""
    import trio

    slow = spinning_build_child(0.8)  # 0.8 s of the child's own CPU before the build
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(len(os.sched_getaffinity(0)))]
    try:
        fetcher = Fetcher(box.repo.read_pack_range)
        prepared: list[float] = []
        m = Materializer(box.catalog, fetcher, tmp_path / "state", idle_for=lambda: 1e9, build_command=slow)

        async def body() -> None:
            t0 = time.monotonic()
            # ~10 s with the floor on two cores; without it the build alone needs ~270 s
            with trio.fail_after(60):
                await m.run(on_prepared=lambda: prepared.append(time.monotonic() - t0))

        run_trio(fetcher, body)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(timeout=30)
    assert prepared and m.complete and compare_trees(box.src, box.tree_of(tmp_path / "state")) == []
