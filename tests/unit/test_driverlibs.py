"""This box's driver libraries through its linker cache, as nvidia-container-toolkit finds them (issue 47)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from ogrefs.inspect.driverlibs import driver_libraries, read_ld_cache, running_version

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("ldconfig") is None,
                                reason="needs gcc and ldconfig")


def _lib(path, soname: str) -> None:
    src = path.parent / "x.c"
    src.write_text("int ogrefs_lab(void) { return 1; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(path), str(src)], check=True,
                   timeout=60)
    src.unlink()


def _cache(tmp_path, dirs: list, fmt: str | None = None):
    conf = tmp_path / "ld.so.conf"
    conf.write_text("".join(f"{d}\n" for d in dirs))
    cache = tmp_path / f"ld.so.cache{fmt or ''}"
    subprocess.run(["ldconfig", "-X", "-C", str(cache), "-f", str(conf), *(["-c", fmt] if fmt else [])], check=True,
                   timeout=60, capture_output=True)
    return cache


def test_the_cache_reads_as_ldconfig_prints_it():
    if not os.path.exists("/etc/ld.so.cache"):
        pytest.skip("no linker cache on this box")
    printed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=60).stdout.splitlines()[1:]
    want = sorted((ln.split()[0], ln.split(" => ")[1]) for ln in printed if " => " in ln)
    assert sorted(read_ld_cache()) == want and want


def test_the_running_versions_files_and_links_are_found_in_the_caches_driver_directories(tmp_path):
    drv = tmp_path / "usr/lib64/nvidia"  # where the default host rules do not look
    (drv / "vdpau").mkdir(parents=True)
    for name, soname in (("libcuda.so.550.54.15", "libcuda.so.1"), ("libnvidia-ml.so.550.54.15", "libnvidia-ml.so.1"),
                         ("libnvidia-ptxjitcompiler.so.550.54.15", "libnvidia-ptxjitcompiler.so.1"),
                         ("libcuda.so.535.104.05", "libcuda.so.1"), ("vdpau/libvdpau_nvidia.so.550.54.15",
                                                                     "libvdpau_nvidia.so.1")):
        _lib(drv / name, soname)
    os.symlink("libcuda.so.550.54.15", drv / "libcuda.so.1")
    os.symlink("libcuda.so.1", drv / "libcuda.so")
    os.symlink("libnvidia-ml.so.550.54.15", drv / "libnvidia-ml.so.1")
    other = tmp_path / "usr/lib/other"
    other.mkdir(parents=True)
    _lib(other / "libz.so.1.2.13", "libz.so.1")
    proc = tmp_path / "version"
    proc.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build\n")
    for fmt in (None, "compat"):
        cache = read_ld_cache(str(_cache(tmp_path, [drv, other], fmt)))
        assert ("libcuda.so.1", f"{drv}/libcuda.so.1") in cache and ("libz.so.1", f"{other}/libz.so.1") in cache, [
            c for c in cache if str(tmp_path) in c[1]]
        version, libs = driver_libraries(cache, proc_version=str(proc))
        assert version == "550.54.15"
        assert libs == sorted(f"{drv}/{n}" for n in (
            "libcuda.so", "libcuda.so.1", "libcuda.so.550.54.15", "libnvidia-ml.so.1", "libnvidia-ml.so.550.54.15",
            "libnvidia-ptxjitcompiler.so.550.54.15", "vdpau/libvdpau_nvidia.so.550.54.15"))  # not 535's
    proc.unlink()  # no module loaded: the version libcuda.so.1 points at
    assert driver_libraries(cache, proc_version=str(proc))[0] == "550.54.15"
    assert driver_libraries([], proc_version=str(proc)) == (None, [])


def test_a_damaged_cache_and_a_foreign_version_file_give_nothing(tmp_path):
    bad = tmp_path / "cache"
    bad.write_bytes(b"glibc-ld.so.cache1.1" + b"\xff" * 40)
    assert read_ld_cache(str(bad)) == []
    bad.write_bytes(b"glibc-ld.so.cache1.1" + (2).to_bytes(4, "little") + b"\0" * 24 + (3).to_bytes(4, "little")
                    + (10**6).to_bytes(4, "little") * 2 + b"\0" * 12)  # offsets past the end: skipped
    assert read_ld_cache(str(bad)) == []
    (tmp_path / "v").write_text("not a driver\n")
    assert running_version(str(tmp_path / "v")) is None
    assert read_ld_cache(str(tmp_path / "missing")) == []
