"""How many CPUs ogrefs sizes its threads to: the affinity, and a container's CPU limit (cgroup v1 and v2).

A RunPod or vast.ai pod limited to 8 CPUs of a 128-core host sees 128 in ``os.cpu_count()``; its restore,
copy and snapshot threads must follow the 8.  The fake trees pin the parsing; the last tests put a real
process in a real cgroup with a real limit, and under a real affinity.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ogrefs import restore
from ogrefs.inspect.machine import cpu_quota
from tests.cli_run import env, run  # noqa: F401  (env is a fixture)
from tests.treegen import compare_trees

PRINT_CPUS = "from ogrefs.inspect.machine import usable_cpus, cpu_quota; print(usable_cpus(), cpu_quota())"


def _tree(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> tuple[str, str]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "self-cgroup").write_text(proc_cgroup)
    return str(tmp_path / "self-cgroup"), str(root)


def test_v2_takes_the_tightest_limit_of_the_process_cgroup_and_those_above_it(tmp_path):
    proc, root = _tree(tmp_path, "0::/pods/pod1/job\n", {
        "cgroup.controllers": "cpu memory\n",
        "pods/cpu.max": "max 100000\n",
        "pods/pod1/cpu.max": "350000 100000\n",  # --cpus 3.5
        "pods/pod1/job/cpu.max": "max 100000\n",
    })
    assert cpu_quota(proc, root) == 3.5
    (Path(root) / "pods/cpu.max").write_text("200000 100000\n")  # a tighter one above
    assert cpu_quota(proc, root) == 2.0


def test_v1_in_a_container_without_a_cgroup_namespace_reads_what_exists_of_its_path(tmp_path):
    """/proc/self/cgroup names /docker/<id>; the container's mount shows that cgroup as the top."""
    proc, root = _tree(tmp_path, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "800000\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    assert cpu_quota(proc, root) == 8.0


def test_no_limit_or_unreadable_files_mean_none(tmp_path):
    proc, root = _tree(tmp_path, "0::/a\n4:cpu,cpuacct:/\n", {
        "cgroup.controllers": "",
        "a/cpu.max": "max 100000\n",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    assert cpu_quota(proc, root) is None
    (Path(root) / "a/cpu.max").write_text("garbage\n")
    assert cpu_quota(proc, root) is None
    assert cpu_quota(str(tmp_path / "missing"), root) is None


@pytest.mark.parametrize(("cpus", "workers"), [(1, 4), (2, 4), (3, 6), (4, 8), (16, 32), (128, 32)])
def test_a_copy_fetches_two_ranges_per_usable_cpu_within_bounds(monkeypatch, cpus, workers):
    monkeypatch.setattr(restore, "usable_cpus", lambda: cpus)
    assert restore.default_workers() == workers


def _run_in(cmd: list[str]) -> list[str]:
    child_env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60, env=child_env).stdout.split()


def test_a_process_pinned_to_one_cpu_counts_one():
    out = _run_in(["taskset", "-c", "0", sys.executable, "-c", PRINT_CPUS])
    assert out[0] == "1"


def _cpu_cgroup_with_limit(quota_us: int, period_us: int) -> tuple[Path, Path]:
    """A real cgroup with a CPU limit (v2 where the box has it, else v1's cpu controller); (dir, its procs)."""
    name = f"ogrefs-test-{uuid.uuid4().hex[:8]}"
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2.exists():
        root = Path("/sys/fs/cgroup")
        if "cpu" not in (root / "cgroup.subtree_control").read_text().split():
            (root / "cgroup.subtree_control").write_text("+cpu")
        d = root / name
        d.mkdir()
        (d / "cpu.max").write_text(f"{quota_us} {period_us}")
    else:
        base = next(p for p in (Path("/sys/fs/cgroup/cpu,cpuacct"), Path("/sys/fs/cgroup/cpu")) if p.is_dir())
        d = base / name
        d.mkdir()
        (d / "cpu.cfs_period_us").write_text(str(period_us))
        (d / "cpu.cfs_quota_us").write_text(str(quota_us))
    return d, d / "cgroup.procs"


def test_a_process_in_a_cgroup_limited_to_half_a_cpu_counts_one_and_reads_the_limit():
    if os.geteuid() != 0:
        pytest.fail("this test makes a cgroup: run the suite as root (scripts/test)")
    d, procs = _cpu_cgroup_with_limit(50_000, 100_000)
    try:
        # the shell joins the cgroup, then becomes Python: the limit is the process's from its first instruction
        out = _run_in(["sh", "-c", f'echo $$ > {procs} && exec "$0" -c "$1"', sys.executable, PRINT_CPUS])
    finally:
        d.rmdir()
    assert out == ["1", "0.5"]


def test_a_restore_fetches_as_many_ranges_as_the_cpus_it_may_use_allow(tmp_path, env):
    """The real CLI: pinned to one CPU its restore runs 4 workers; --workers still decides; the tree is exact.
    On a box of 3 cores or more, three CPUs give 6 (on two, the affinity cannot give three)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(20):
        (src / f"f{i}").write_bytes(os.urandom(3000 + i))
    run(["init"], env)
    run(["snapshot", str(src)], env)

    def restore(cpus: str, *extra: str) -> dict:
        out = tmp_path / f"out-{cpus}-{len(extra)}"
        proc = subprocess.run(["taskset", "-c", cpus, sys.executable, "-m", "ogrefs", "restore", "--json", *extra,
                               "latest", str(out)], env=env, capture_output=True, text=True, timeout=120, check=True)
        assert compare_trees(src, out / str(src).lstrip("/")) == []
        return json.loads(proc.stdout)

    assert restore("0")["workers"] == 4
    assert restore("0", "--workers", "7")["workers"] == 7
    if len(os.sched_getaffinity(0)) >= 3:
        assert restore("0-2")["workers"] == 6
