"""ogrefs.supervise: a job's path calls wait for files that arrive while it runs (seccomp user notification).

The files exist only once the fake daemon (tests/arrivals.py) is asked for
them, after a delay: a job that succeeds and reads the full content waited.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from ogrefs.mount.run import run_in_place
from ogrefs.supervise.supervisor import supervise
from tests.arrivals import Arrivals

PY = sys.executable
WRAPPER = b"#!/bin/sh\nexec /bin/sh \"$@\"\n"


def run(arrivals: Arrivals, script: str, cwd: Path | None = None, **kw) -> tuple[int, list[str]]:
    """Run a Python ``script`` supervised; its exit code and the lines it printed to stderr's file."""
    out = Path(arrivals.root).parent / "job.out"
    lines: list[str] = []
    argv = [PY, "-c", textwrap.dedent(script), str(out)]
    code = supervise(argv, None, arrivals.needs, arrivals.ensure, cwd=str(cwd) if cwd else None,
                     report=lines.append, **kw)
    return code, (out.read_text().splitlines() if out.exists() else []) + [f"report: {x}" for x in lines]


@pytest.fixture
def box(tmp_path):
    root = tmp_path / "box"
    root.mkdir()
    (root / "lib64").symlink_to("lib")  # on this box already, as /lib -> usr/lib on a merged-usr image
    return root


def test_open_stat_list_and_exec_wait_for_late_files(box):
    a = Arrivals(box, {"data/weights.bin": b"w" * 300_000, "data/ckpt/": None, "data/ckpt/step1.pt": b"one",
                       "data/ckpt/step2.pt": b"two", "rel/note.txt": b"relative", "at/inside.txt": b"via dirfd",
                       "lib/libx.so": b"library", "bin/tool": ("exec", b"#!/bin/sh\necho tool ran\n"),
                       "bin/wrapper": ("exec", WRAPPER),
                       "bin/wrapped": ("exec", f"#!{box}/bin/wrapper\necho wrapped ran\n".encode()),
                       "out/old/huge.bin": b"not needed by a stat or a mkdir of out/"})
    code, lines = run(a, f"""
        import os, subprocess, sys
        box = {str(box)!r}
        out = open(sys.argv[1], "w")
        print(len(open(box + "/data/weights.bin", "rb").read()), file=out)
        print(os.stat(box + "/data/ckpt/step1.pt").st_size, file=out)
        print(sorted(os.listdir(box + "/data/ckpt")), file=out)
        print(open("rel/note.txt").read(), file=out)
        d = os.open(box + "/at", os.O_RDONLY | os.O_DIRECTORY)
        print(os.read(os.open("inside.txt", os.O_RDONLY, dir_fd=d), 100).decode(), file=out)
        print(open(box + "/lib64/libx.so").read(), file=out)
        print(subprocess.run([box + "/bin/tool"], capture_output=True, text=True).stdout.strip(), file=out)
        print(subprocess.run([box + "/bin/wrapped"], capture_output=True, text=True).stdout.strip(), file=out)
        print(open("/proc/self/status").read().split("NoNewPrivs:")[1].split()[0], file=out)
        os.makedirs(box + "/out", exist_ok=True)
        print(os.path.isdir(box + "/out/old"), file=out)
    """, cwd=box)
    assert code == 0, lines
    assert lines == ["300000", "3", "['step1.pt', 'step2.pt']", "relative", "via dirfd", "library", "tool ran",
                     "wrapped ran", "0", "True"]  # no_new_privs only where the kernel asks for it (no CAP_SYS_ADMIN)
    # lib64/libx.so is lib/libx.so; the wrapper is opened by the kernel itself; an open of a directory asks for
    # it whole (at/ brought inside.txt), a mkdir or a stat only for the directory (out/old/huge.bin never came)
    assert a.asked == [f"{box}/{p}" for p in ("data/weights.bin (whole)", "data/ckpt/step1.pt", "data/ckpt (whole)",
                                              "rel/note.txt (whole)", "at (whole)",
                                              "lib/libx.so (whole)", "bin/tool", "bin/wrapped", "bin/wrapper",
                                              "out", "out/old")]


def test_a_path_the_snapshot_lacks_fails_at_once_and_asks_nothing(box):
    a = Arrivals(box, {"data/here.txt": b"x"})
    code, lines = run(a, f"""
        import errno, os, sys
        out = open(sys.argv[1], "w")
        for path in ("{box}/data/missing.txt", "{box}/nodir/missing.txt", "{box}/lib64/missing.so"):
            try:
                open(path)
            except FileNotFoundError:
                print("ENOENT", file=out)
    """)
    assert (code, lines) == (0, ["ENOENT"] * 3)
    assert a.asked == []  # not even data/, which the snapshot has: what it lacks below it is known at once


def test_a_failed_or_endless_wait_is_eio_and_said(box):
    hold = threading.Event()
    a = Arrivals(box, {"bad.bin": b"x", "slow.bin": b"y"}, fail={f"{box}/bad.bin"}, hold=hold)
    try:
        code, lines = run(a, f"""
            import sys
            out = open(sys.argv[1], "w")
            for name in ("bad.bin", "slow.bin"):
                try:
                    open("{box}/" + name)
                except OSError as exc:
                    print(name, exc.errno, file=out)
        """, wait_s=1.0)
    finally:
        hold.set()
    assert code == 0
    assert lines[:2] == ["bad.bin 5", "slow.bin 5"]
    assert any(x.startswith(f"report: {box}/bad.bin: [Errno 5] the store said no; the job was told EIO") for x in lines)
    assert f"report: {box}/slow.bin: not in place after 1 s; the job was told EIO" in lines


def test_subprocesses_and_their_children_are_covered(box):
    a = Arrivals(box, {"deep/file.txt": b"grandchild saw it", "sh/file.txt": b"child saw it"})
    code, lines = run(a, f"""
        import subprocess, sys
        out = open(sys.argv[1], "w")
        print(subprocess.run(["sh", "-c", "cat {box}/sh/file.txt"], capture_output=True, text=True).stdout, file=out)
        inner = "import subprocess; print(subprocess.run(['cat', '{box}/deep/file.txt'], capture_output=True,"
        inner += " text=True).stdout)"
        print(subprocess.run([sys.executable, "-c", inner], capture_output=True, text=True).stdout.strip(), file=out)
    """)
    assert (code, lines) == (0, ["child saw it", "grandchild saw it"])


def test_threads_waiting_for_one_file_ask_once_and_others_run_meanwhile(box):
    """Eight threads wait for one file whose arrival waits for a ninth thread's calls: no deadlock, one ensure."""
    asked, marker = box.parent / "ensure-called", box.parent / "written-by-the-job"

    class Gated(Arrivals):
        def ensure(self, path, whole):
            asked.write_text(path)
            deadline = time.monotonic() + 30
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            super().ensure(path, whole)

    a = Gated(box, {"shared.bin": b"s" * 1000}, delay=0)
    code, lines = run(a, f"""
        import os, sys, threading, time
        out = open(sys.argv[1], "w")
        got = []
        ts = [threading.Thread(target=lambda: got.append(len(open("{box}/shared.bin", "rb").read())))
              for _ in range(8)]
        [t.start() for t in ts]
        deadline = time.monotonic() + 30
        while not os.path.exists("{asked}") and time.monotonic() < deadline:  # stat calls, answered meanwhile
            time.sleep(0.01)
        open("{marker}", "w").write("x")
        [t.join() for t in ts]
        print(got, file=out)
    """)
    assert (code, lines) == (0, [str([1000] * 8)])
    assert a.asked == [f"{box}/shared.bin (whole)"]


@pytest.fixture(params=["c", "python"])
def settled_loop(request, monkeypatch) -> dict:
    """The settled calls answered by the C loop (``_settle.pass_calls``) or by the Python one; counts who did."""
    import ogrefs.supervise.supervisor as sup
    from ogrefs.supervise.seccomp import Listener

    counts = {"loop": request.param, "c": 0, "python": 0}
    if request.param == "python":
        monkeypatch.setattr(sup, "pass_calls", None)
    elif sup.pass_calls is not None:
        real = sup.pass_calls

        def counted(fd: int, ms: int):
            passed, hung_up = real(fd, ms)
            counts["c"] += passed
            return passed, hung_up

        monkeypatch.setattr(sup, "pass_calls", counted)
    real_next = Listener.pass_next

    def pass_next(self):
        counts["python"] += 1
        real_next(self)

    monkeypatch.setattr(Listener, "pass_next", pass_next)
    return counts


def test_the_settled_loop_in_c_is_built():
    """scripts/setup builds it (gcc, python3-dev): without it a box answers in Python, at twice the cost a call,
    and the C loop's tests below would pass on the Python one."""
    import ogrefs.supervise.supervisor as sup

    assert sup.pass_calls is not None, "ogrefs.supervise._settle was not built (scripts/setup builds it)"


def test_settled_lets_calls_go_without_asking(box, settled_loop):
    """Once settled nothing is asked or looked up; thousands of calls from threads and a child are all let go,
    by the loop chosen (no call left to the other); the exit code comes back and an orphan is reaped first."""
    a = Arrivals(box, {"late.txt": b"x"})
    out, flag = box.parent / "job.out", box.parent / "orphan-done"
    job = f"""
        import os, subprocess, sys, threading
        def stats():
            for _ in range(2000):
                os.stat({str(box)!r})
        ts = [threading.Thread(target=stats) for _ in range(3)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        late = subprocess.run(["cat", {str(box / "late.txt")!r}], capture_output=True).returncode
        subprocess.Popen(["sh", "-c", "sleep 0.3; touch {flag}"])
        open({str(out)!r}, "w").write(str(late))
        sys.exit(7)
    """
    code = supervise([PY, "-c", textwrap.dedent(job)], None, a.needs, a.ensure, settled=lambda: True)
    assert (code, out.read_text(), a.needs_calls, a.asked, flag.exists()) == (7, "1", 0, [], True)
    other = "python" if settled_loop["loop"] == "c" else "c"
    assert settled_loop[settled_loop["loop"]] >= 6000 and settled_loop[other] == 0, settled_loop


def test_sigterm_reaches_a_busy_settled_job(box, settled_loop):
    """A job making path calls without a pause keeps the settled loop answering; a SIGTERM to the supervisor
    still reaches it (the C loop hands back to Python's handlers every REAP_EVERY_S). Without it the job
    would stop by itself after 60 s with 0, not 42."""
    a = Arrivals(box, {})
    ready = box / "ready"
    job = f"""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))
        open({str(ready)!r}, "w").close()
        end = time.monotonic() + 60
        while time.monotonic() < end:
            os.stat("/")
        sys.exit(0)
    """

    def signal_when_ready():
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # (in the loop's stats by then)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=signal_when_ready)
    sender.start()
    code = supervise([PY, "-c", textwrap.dedent(job)], None, a.needs, a.ensure, settled=lambda: True)
    sender.join(timeout=30)
    assert code == 42
    assert settled_loop[settled_loop["loop"]] > 1000, settled_loop


def _children() -> set[int]:
    """This process's children (the session's own, e.g. a SeaweedFS server, are there before the test)."""
    out: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            out |= {int(p) for p in f.read().split()}
    return out


def test_exit_codes_and_nothing_left_when_the_job_ends(box):
    before = _children()
    threads_before = set(threading.enumerate())  # earlier tests' process-wide threads (the store's deadlines)
    a = Arrivals(box, {"late": b"7"})
    assert run_in_place(["sh", "-c", f"exit $(cat {box}/late)"], a.needs, a.ensure, lambda: False) == 7
    assert supervise(["sh", "-c", "kill -9 $$"], None, a.needs, a.ensure) == 128 + signal.SIGKILL
    # an orphan of the job is reaped, and the call returns only once it has gone (it carries the filter)
    flag = box / "orphan-done"
    code = supervise(["sh", "-c", f"(sleep 0.3; touch {flag}) & exit 3"], None, a.needs, a.ensure)
    assert code == 3 and flag.exists()
    assert _children() <= before  # nothing of the job's is left (not even a zombie: it would be listed)
    ours = [t for t in threading.enumerate() if t.name.startswith("ogrefs-") and t not in threads_before]
    for t in ours:  # a waiter may still be returning from its answer as the job ends
        t.join(timeout=30)
    assert not [t for t in ours if t.is_alive()]


def _spec(tmp: Path, root: Path, files: dict) -> Path:
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"root": str(root), "files": files, "asked": str(tmp / "asked.json")}))
    return spec


def _gone(pid: int, within: float = 20.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_killed_supervisor_takes_its_job_along(box, tmp_path):
    """A job whose supervisor is gone would get ENOSYS from every path call: it is killed instead."""
    pidfile = tmp_path / "job.pid"
    driver = subprocess.Popen([PY, "-m", "tests.arrivals", str(_spec(tmp_path, box, {})), "--", "sh", "-c",
                               f"echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; exec sleep 600"],
                              cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 30
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        job = int(pidfile.read_text())
        driver.kill()
        driver.wait(timeout=30)
        gone = _gone(job)
        if not gone:
            os.kill(job, signal.SIGKILL)
        assert gone, "the job outlived its supervisor"
    finally:
        driver.kill()


@pytest.mark.skipif(shutil.which("capsh") is None, reason="capsh (package libcap2-bin) is not installed")
def test_in_a_container_without_cap_sys_admin(box, tmp_path):
    """unshare + capsh --drop=cap_sys_admin: the kernel then wants no_new_privs, and the job still waits."""
    spec = _spec(tmp_path, box, {"data/late.txt": "arrived late"})
    job = (f"grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status > {tmp_path}/status; "
           f"cat {box}/data/late.txt > {tmp_path}/got")
    cmd = ["unshare", "--mount", "--propagation", "private", "capsh", "--drop=cap_sys_admin", "--",
           "-c", f"{PY} -m tests.arrivals {spec} -- sh -c \"{job}\""]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == 0, proc.stderr
    status = dict(line.split(":", 1) for line in (tmp_path / "status").read_text().splitlines())
    assert not int(status["CapEff"], 16) & (1 << 21), "CAP_SYS_ADMIN was not dropped"
    assert (status["NoNewPrivs"].strip(), status["Seccomp"].strip()) == ("1", "2")
    assert (tmp_path / "got").read_text() == "arrived late"
    assert json.loads((tmp_path / "asked.json").read_text()) == [f"{box}/data/late.txt (whole)"]


def test_sigterm_is_passed_on_and_ctrl_c_left_to_the_job(box):
    """The supervisor ignores SIGINT (the terminal sends it to the job too) and hands SIGTERM to the job."""
    a = Arrivals(box, {})
    ready = box / "ready"

    def signal_when_ready():
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)  # would end pytest with KeyboardInterrupt if not ignored
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=signal_when_ready)
    sender.start()
    code = supervise(["sh", "-c", f"trap 'exit 42' TERM; touch {ready}; while :; do sleep 0.05; done"], None,
                     a.needs, a.ensure)
    sender.join(timeout=30)
    assert code == 42


def test_a_kernel_that_refuses_the_filter_is_one_line_and_no_job(tmp_path):
    """Under a filter that refuses seccomp(2) itself (a stricter container profile) the job is not started."""
    marker = tmp_path / "ran"
    code = f"""
        import ctypes, errno, struct, sys
        from ogrefs.supervise import seccomp
        from ogrefs.supervise.supervisor import SupervisionUnavailable, supervise
        arch = seccomp.this_arch()
        prog = (struct.pack("=HBBI", 0x20, 0, 0, 0) + struct.pack("=HBBI", 0x15, 0, 1, arch.seccomp_nr)
                + struct.pack("=HBBI", 0x06, 0, 0, seccomp.SECCOMP_RET_ERRNO | errno.EPERM)
                + struct.pack("=HBBI", 0x06, 0, 0, seccomp.SECCOMP_RET_ALLOW))
        buf = ctypes.create_string_buffer(prog, len(prog))
        fprog = ctypes.create_string_buffer(struct.pack("=HxxxxxxQ", 4, ctypes.addressof(buf)), 16)
        seccomp.prctl(seccomp.PR_SET_NO_NEW_PRIVS, 1)
        libc = ctypes.CDLL(None)
        libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
        assert libc.prctl(22, 2, ctypes.addressof(fprog), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        try:
            supervise(["touch", "{marker}"], None, lambda p: False, lambda p, w: None)
        except SupervisionUnavailable as exc:
            print(exc)
    """
    proc = subprocess.run([PY, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ("cannot supervise the job: seccomp(SECCOMP_FILTER_FLAG_NEW_LISTENER): "
                           "Operation not permitted\n")
    assert not marker.exists()


def test_openat2_and_o_path(box):
    """openat2 keeps its flags in memory (read there); an O_PATH open is no listing: the directory is only made."""
    a = Arrivals(box, {"two/file.txt": b"through openat2", "held/big.bin": b"never needed"})
    code, lines = run(a, f"""
        import ctypes, os, struct, sys
        out = open(sys.argv[1], "w")
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        how = ctypes.create_string_buffer(struct.pack("=QQQ", os.O_RDONLY, 0, 0), 24)
        fd = libc.syscall(437, ctypes.c_long(-100), b"{box}/two/file.txt", how, ctypes.c_size_t(24))
        print(os.read(fd, 100).decode() if fd >= 0 else os.strerror(ctypes.get_errno()), file=out)
        held = os.open("{box}/held", os.O_PATH | os.O_DIRECTORY)
        print(os.path.isdir(f"/proc/self/fd/{{held}}"), file=out)
    """)
    assert (code, lines) == (0, ["through openat2", "True"])
    assert a.asked == [f"{box}/two/file.txt (whole)", f"{box}/held"]


def test_a_failing_needs_lets_the_call_go_on_and_says_so(box):
    class Broken(Arrivals):
        def needs(self, path):
            if path.endswith("boom"):
                raise KeyError(path)
            return super().needs(path)

    a = Broken(box, {"late.txt": b"still served"})
    code, lines = run(a, f"""
        import sys
        out = open(sys.argv[1], "w")
        try:
            open("{box}/boom")
        except FileNotFoundError:
            print("ENOENT", file=out)
        print(open("{box}/late.txt").read(), file=out)
    """)
    assert code == 0
    assert lines[:2] == ["ENOENT", "still served"]
    assert f"report: needs({box}/boom) failed: '{box}/boom'" in lines


def test_a_child_the_caller_had_before_is_neither_waited_for_nor_reaped(box):
    a = Arrivals(box, {})
    other = subprocess.Popen(["sleep", "60"])
    try:
        assert supervise(["true"], None, a.needs, a.ensure) == 0
        assert other.poll() is None  # still running, still the caller's to wait for
    finally:
        other.kill()
        assert other.wait(timeout=30) == -signal.SIGKILL


def test_an_older_copy_on_the_box_is_waited_for_under_any_spelling(box):
    """The image's copy of a file the snapshot has newer is not in place: read directly or through lib64."""
    (box / "lib").mkdir()
    (box / "lib" / "libv.so").write_text("old")
    (box / "lib" / "libw.so").write_text("old")
    a = Arrivals(box, {"lib/libv.so": b"new v", "lib/libw.so": b"new w"})
    code, lines = run(a, f"""
        import sys
        out = open(sys.argv[1], "w")
        print(open("{box}/lib64/libv.so").read(), file=out)
        print(open("{box}/lib/libw.so").read(), file=out)
    """)
    assert (code, lines) == (0, ["new v", "new w"])


def test_a_supervisor_that_breaks_takes_its_job_along(box):
    """An error out of the serving loop itself (here: the caller's report raising) ends the job, never leaves it
    running with ENOSYS from every path call."""
    pidfile = box.parent / "job.pid"

    def needs(path):
        if path.endswith("boom"):
            raise KeyError(path)
        return False

    def report(line):
        raise RuntimeError(f"cannot report: {line}")

    with pytest.raises(RuntimeError, match="cannot report"):
        supervise(["sh", "-c", f"echo $$ > {pidfile}; cat {box}/boom; exec sleep 600"], None, needs,
                  lambda p, w: None, report=report)
    assert _gone(int(pidfile.read_text()))
