"""ogrefs.supervise without a job: the filter program, path resolution, interpreters, reads of a process's memory."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct

import pytest

from ogrefs.supervise import paths, seccomp

ARCH = seccomp.ARCHES["x86_64"]


def run_bpf(code: bytes, nr: int, arch: int, args=(0,) * 6) -> int:
    """A classic BPF interpreter for the few instructions the filter uses, over one seccomp_data."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *args)
    prog = [struct.unpack_from("=HBBI", code, i) for i in range(0, len(code), 8)]
    pc, acc = 0, 0
    while True:
        op, jt, jf, k = prog[pc]
        if op == 0x20:
            acc = struct.unpack_from("=I", data, k)[0]
        elif op == 0x06:
            return k
        elif op in (0x15, 0x35, 0x45):
            hit = acc == k if op == 0x15 else acc >= k if op == 0x35 else bool(acc & k)
            pc += jt if hit else jf
        else:
            raise AssertionError(f"unexpected instruction {op:#x}")
        pc += 1


@pytest.mark.parametrize("arch_name", sorted(seccomp.ARCHES))
def test_the_filter_stops_path_calls_only(arch_name):
    arch = seccomp.ARCHES[arch_name]
    code = seccomp.program(arch)
    table = seccomp.X86_64 if arch_name == "x86_64" else seccomp.AARCH64
    for name, nr in table.items():
        flags = [0] * 6
        assert run_bpf(code, nr, arch.audit, flags) == seccomp.SECCOMP_RET_USER_NOTIF, name
    for nr, flags_arg in arch.empty_path_flag_arg.items():  # glibc's fstat: newfstatat(fd, "", AT_EMPTY_PATH)
        args = [0] * 6
        args[flags_arg] = seccomp.AT_EMPTY_PATH
        assert run_bpf(code, nr, arch.audit, args) == seccomp.SECCOMP_RET_ALLOW
    others = set(range(0, 460)) - set(table.values()) - {425}
    assert {run_bpf(code, nr, arch.audit) for nr in others} == {seccomp.SECCOMP_RET_ALLOW}
    assert run_bpf(code, 425, arch.audit) == seccomp.SECCOMP_RET_ERRNO | errno.ENOSYS  # io_uring_setup
    assert run_bpf(code, table["openat"], 0x40000003) == seccomp.SECCOMP_RET_ALLOW  # another ABI: escapes (docs)


def test_lexical_and_resolve(tmp_path):
    assert paths.lexical("/a//b/./c/../d/") == "/a/b/d"
    assert paths.lexical("//x") == "/x" and paths.lexical("/a/b") == "/a/b" and paths.lexical("/") == "/"
    assert paths.lexical("/w/.venv/lib/") == "/w/.venv/lib" and paths.lexical("/a/b/..") == "/a"
    assert paths.lexical("/a/./b") == "/a/b" and paths.lexical("/a/.") == "/a" and paths.lexical("/.x/..y") == "/.x/..y"
    (tmp_path / "usr" / "lib").mkdir(parents=True)
    (tmp_path / "lib").symlink_to("usr/lib")
    (tmp_path / "abs").symlink_to(tmp_path / "usr")
    (tmp_path / "loop").symlink_to("loop")
    assert paths.resolve(f"{tmp_path}/lib/x.so") == f"{tmp_path}/usr/lib/x.so"
    assert paths.resolve(f"{tmp_path}/abs/lib/../lib/y") == f"{tmp_path}/usr/lib/y"
    assert paths.resolve(f"{tmp_path}/lib/new/../z") == f"{tmp_path}/usr/lib/z"  # lexical past what is not here
    assert paths.resolve(f"{tmp_path}/loop/a").startswith(f"{tmp_path}/loop")  # no endless walk


def test_interpreter(tmp_path):
    script = tmp_path / "s"
    script.write_bytes(b"#!  /opt/venv/bin/python -u\nprint(1)\n")
    assert paths.interpreter(str(script)) == "/opt/venv/bin/python"
    script.write_bytes(b"plain text")
    assert paths.interpreter(str(script)) is None
    interp = paths.interpreter(os.path.realpath("/bin/sh"))
    assert interp is not None and interp.startswith("/lib") and "ld-linux" in interp


def test_memory_reads_strings_across_pages_and_refuses_unmapped():
    buf = ctypes.create_string_buffer(b"/some/path\0tail")
    mem = paths.Memory()
    try:
        assert mem.string(os.getpid(), ctypes.addressof(buf)) == b"/some/path"
        area = mmap.mmap(-1, 2 * mmap.PAGESIZE)
        area[mmap.PAGESIZE - 3:mmap.PAGESIZE + 4] = b"/ab/cd\0"
        base = ctypes.addressof(ctypes.c_char.from_buffer(area))
        assert mem.string(os.getpid(), base + mmap.PAGESIZE - 3) == b"/ab/cd"
        assert mem.string(os.getpid(), 8) is None and mem.string(os.getpid(), 0) is None
        long = ctypes.create_string_buffer(b"/x" * 1500)  # past the first short read
        endless = ctypes.create_string_buffer(b"y" * (paths.PATH_MAX + 10))
        assert mem.string(os.getpid(), ctypes.addressof(long)) == b"/x" * 1500
        assert mem.string(os.getpid(), ctypes.addressof(endless)) is None  # ENAMETOOLONG is the kernel's to say
        word = ctypes.c_uint64(0o100)
        assert mem.u64(os.getpid(), ctypes.addressof(word)) == 0o100
    finally:
        mem.close()


def test_kernel_version_gate():
    from ogrefs.supervise.supervisor import kernel_version
    assert kernel_version("6.18.44-fc-v1300") == (6, 18)
    assert kernel_version("5.4.0-1103-aws") == (5, 4) < (5, 5)
    assert kernel_version("5.15.0-105-generic") == (5, 15)
    assert kernel_version("garbage") == (0, 0)
