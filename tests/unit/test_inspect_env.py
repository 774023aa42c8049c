"""Python environments, CUDA files and machine facts, read from disk."""

from __future__ import annotations

import json
import os

from ogrefs.inspect import capture_environment
from ogrefs.inspect.cuda import cuda_library_name, read_header_version, read_toolkit
from ogrefs.inspect.machine import machine_info, read_os_release
from ogrefs.inspect.pyenv import read_dist_headers, read_torch_version

TORCH_VERSION_PY = '''\
from typing import Optional

__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip']
__version__ = '2.1.0+cu121'
debug = False
cuda: Optional[str] = '12.1'
git_version = '7bcf7da3a268b435777fe87c7794c382f444e86d'
hip: Optional[str] = None
open({marker!r}, 'w')  # must never run: version.py is read as text
'''


def write(path, text="") -> str:
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def dist_info(site, name: str, version: str, dir_name: str | None = None) -> None:
    d = os.path.join(str(site), dir_name or f"{name.replace('-', '_')}-{version}.dist-info")
    write(os.path.join(d, "METADATA"),
          f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: x\n\nVersion: 9.9.9 (in the body)\n")


def make_venv(root, *, torch_cuda="'12.1'", marker="/nonexistent") -> str:
    venv = os.path.join(str(root), "venv")
    write(os.path.join(venv, "pyvenv.cfg"), "home = /usr/bin\ninclude-system-site-packages = false\nversion = 3.11.4\n")
    write(os.path.join(venv, "bin", "python3"))
    os.symlink("python3", os.path.join(venv, "bin", "python"))
    write(os.path.join(venv, "bin", "pip"))
    site = os.path.join(venv, "lib", "python3.11", "site-packages")
    dist_info(site, "numpy", "1.26.0")
    dist_info(site, "torch", "2.1.0+cu121")
    dist_info(site, "nvidia-cudnn-cu12", "8.9.2.26")
    dist_info(site, "Foo.Bar", "0.3", dir_name="Foo_Bar-0.3.dist-info")
    write(os.path.join(site, "legacy_pkg-1.0-py3.11.egg-info", "PKG-INFO"), "Metadata-Version: 1.0\nName: legacy-pkg\nVersion: 1.0\n")
    write(os.path.join(site, "old_single-0.5-py3.11.egg-info"), "Metadata-Version: 1.0\nName: old-single\nVersion: 0.5\n")
    write(os.path.join(site, "torch", "version.py"),
          TORCH_VERSION_PY.format(marker=marker).replace("'12.1'", torch_cuda))
    write(os.path.join(site, "torch", "_C.cpython-311-x86_64-linux-gnu.so"))
    write(os.path.join(site, "torch", "lib", "libtorch_cuda.so"))
    write(os.path.join(site, "nvidia", "cudnn", "lib", "libcudnn.so.8"))
    write(os.path.join(site, "nvidia", "__init__.py"))
    write(os.path.join(site, "numpy", "core", "_multiarray_umath.cpython-311-x86_64-linux-gnu.so"))
    return venv


def test_venv_packages_and_torch_cuda(tmp_path):
    marker = tmp_path / "version-py-ran"
    venv = make_venv(tmp_path, marker=str(marker))
    env = capture_environment([str(tmp_path)], deadline_s=20)
    assert not marker.exists()
    [pe] = env["python_envs"]
    site = os.path.join(venv, "lib", "python3.11", "site-packages")
    assert pe["path"] == venv and pe["kind"] == "venv" and pe["python"] == "3.11.4"
    assert pe["home"] == "/usr/bin" and pe["system_site_packages"] is False
    assert pe["packages"] == {
        "foo-bar": "0.3", "legacy-pkg": "1.0", "numpy": "1.26.0",
        "nvidia-cudnn-cu12": "8.9.2.26", "old-single": "0.5", "torch": "2.1.0+cu121",
    }
    assert pe["torch"] == {"version": "2.1.0+cu121", "cuda": "12.1", "hip": None,
                           "path": os.path.join(site, "torch", "version.py")}
    assert pe["interpreters"] == [os.path.join(venv, "bin", "python"), os.path.join(venv, "bin", "python3")]
    assert env["cuda"]["torch"] == [{"env": venv, "version": "2.1.0+cu121", "cuda": "12.1"}]
    assert env["cuda"]["wheels"] == [{"env": venv, "name": "nvidia-cudnn-cu12", "version": "8.9.2.26"}]

    py = set(env["hints"]["python"])
    assert {site, os.path.join(venv, "bin", "python3"),
            os.path.join(site, "torch", "_C.cpython-311-x86_64-linux-gnu.so"),
            os.path.join(site, "torch", "lib", "libtorch_cuda.so"),
            os.path.join(site, "numpy", "core", "_multiarray_umath.cpython-311-x86_64-linux-gnu.so")} <= py
    cuda = set(env["hints"]["cuda"])
    assert os.path.join(site, "nvidia", "cudnn", "lib", "libcudnn.so.8") in cuda
    assert os.path.join(site, "nvidia", "cudnn") in cuda
    assert os.path.join(site, "nvidia", "cudnn", "lib", "libcudnn.so.8") not in py
    assert not any(p.endswith("__init__.py") for p in cuda)
    json.dumps(env)


def test_cpu_only_torch(tmp_path):
    make_venv(tmp_path, torch_cuda="None")
    env = capture_environment([str(tmp_path)], deadline_s=20)
    assert env["python_envs"][0]["torch"]["cuda"] is None


def test_conda_and_system_envs(tmp_path):
    conda = tmp_path / "opt" / "conda"
    for n in ("python-3.10.13-h955ad1f_0.json", "numpy-1.24.3-py310h5f9d8c6_1.json",
              "ca-certificates-2023.08.22-h06a4308_0.json", "history"):
        write(conda / "conda-meta" / n, "{}")
    dist_info(conda / "lib" / "python3.10" / "site-packages", "requests", "2.31.0")
    inner = conda / "envs" / "train"
    write(inner / "conda-meta" / "python-3.11.5-h1_0.json", "{}")
    dist_info(inner / "lib" / "python3.11" / "site-packages", "torch", "2.2.0")
    system = tmp_path / "usr" / "local" / "lib" / "python3.10" / "dist-packages"
    dist_info(system, "accelerate", "0.25.0")
    user = tmp_path / "home" / "me" / ".local" / "lib" / "python3.10" / "site-packages"
    dist_info(user, "wandb", "0.16.0")

    env = capture_environment([str(tmp_path)], deadline_s=20)
    envs = {e["path"]: e for e in env["python_envs"]}
    assert set(envs) == {str(conda), str(inner), str(tmp_path / "usr" / "local"), str(tmp_path / "home" / "me" / ".local")}
    base = envs[str(conda)]
    assert base["kind"] == "conda" and base["python"] == "3.10.13"
    assert base["conda_packages"] == {"ca-certificates": "2023.08.22", "numpy": "1.24.3", "python": "3.10.13"}
    assert base["packages"] == {"requests": "2.31.0"}
    assert envs[str(inner)]["packages"] == {"torch": "2.2.0"} and envs[str(inner)]["python"] == "3.11.5"
    sysenv = envs[str(tmp_path / "usr" / "local")]
    assert sysenv["kind"] == "system" and sysenv["python"] == "3.10" and sysenv["packages"] == {"accelerate": "0.25.0"}
    assert envs[str(tmp_path / "home" / "me" / ".local")]["kind"] == "user"


def test_metadata_headers_stop_at_body(tmp_path):
    p = write(tmp_path / "METADATA", "Name: a\nSummary: s\n\nName: b\nVersion: 2\n")
    assert read_dist_headers(p) == ("a", None)
    assert read_dist_headers(str(tmp_path / "missing")) == (None, None)


def test_torch_version_text_forms(tmp_path):
    p = write(tmp_path / "v.py", '__version__ = "2.0.1"\ncuda = "11.8"\nhip = None\n')
    assert read_torch_version(p) == {"version": "2.0.1", "cuda": "11.8", "hip": None}
    assert read_torch_version(write(tmp_path / "junk.py", "x = 1\n")) is None


def test_cuda_toolkits_and_headers(tmp_path):
    local = tmp_path / "usr" / "local"
    write(local / "cuda-12.1" / "version.json", json.dumps({"cuda": {"name": "CUDA SDK", "version": "12.1.1"}}))
    write(local / "cuda-12.1" / "lib64" / "libcudart.so.12.1.105")
    write(local / "cuda-12.1" / "include" / "cudnn_version.h",
          "#define CUDNN_MAJOR 8\n#define CUDNN_MINOR 9\n#define CUDNN_PATCHLEVEL 2\n")
    write(local / "cuda-11.8" / "version.txt", "CUDA Version 11.8.89\n")
    os.symlink("cuda-12.1", local / "cuda")
    write(tmp_path / "opt" / "nccl" / "include" / "nccl.h",
          "#define NCCL_MAJOR 2\n#define NCCL_MINOR 18\n#define NCCL_PATCH 3\n#define NCCL_SUFFIX \"\"\n")
    env = capture_environment([str(tmp_path)], deadline_s=20)
    c = env["cuda"]
    tk = {t["path"]: t for t in c["toolkits"]}
    assert tk[str(local / "cuda-12.1")]["version"] == "12.1.1" and tk[str(local / "cuda-12.1")]["source"] == "version.json"
    assert tk[str(local / "cuda-11.8")]["version"] == "11.8.89"
    assert tk[str(local / "cuda")]["link_target"] == "cuda-12.1" and tk[str(local / "cuda")]["version"] == "12.1.1"
    assert c["cudnn"] == [{"path": str(local / "cuda-12.1" / "include" / "cudnn_version.h"), "version": "8.9.2"}]
    assert c["nccl"] == [{"path": str(tmp_path / "opt" / "nccl" / "include" / "nccl.h"), "version": "2.18.3"}]
    assert c["libraries"] == [{"name": "cudart", "path": str(local / "cuda-12.1" / "lib64" / "libcudart.so.12.1.105"),
                               "version": "12.1.105"}]
    assert str(local / "cuda-12.1" / "lib64" / "libcudart.so.12.1.105") in env["hints"]["cuda"]


def test_cudnn9_headers_side_by_side_are_one_cudnn(tmp_path):
    """The nvidia-cudnn-cu13 wheel ships cudnn_version.h and cudnn_version_v9.h with the same version (seen on
    an H200 box's torch 2.11+cu130 venv, where `show` listed cuDNN 9.19.0 twice); another version beside them,
    or the same version in another directory, is still listed."""
    nine = "#define CUDNN_MAJOR 9\n#define CUDNN_MINOR 19\n#define CUDNN_PATCHLEVEL 0\n"
    inc = tmp_path / "venv" / "lib" / "python3.12" / "site-packages" / "nvidia" / "cudnn" / "include"
    write(inc / "cudnn_version.h", nine)
    write(inc / "cudnn_version_v9.h", nine)
    write(inc / "cudnn_version_v8.h", "#define CUDNN_MAJOR 8\n#define CUDNN_MINOR 9\n#define CUDNN_PATCHLEVEL 7\n")
    write(tmp_path / "other" / "include" / "cudnn_version.h", nine)
    c = capture_environment([str(tmp_path)], deadline_s=20)["cuda"]
    assert sorted((x["path"], x["version"]) for x in c["cudnn"]) == sorted([
        (str(inc / "cudnn_version.h"), "9.19.0"), (str(inc / "cudnn_version_v8.h"), "8.9.7"),
        (str(tmp_path / "other" / "include" / "cudnn_version.h"), "9.19.0")])


def test_toolkit_version_fallbacks(tmp_path):
    write(tmp_path / "a" / "dist-info" / "nvidia_cuda_nvcc-13.0.88.dist-info" / "METADATA")
    write(tmp_path / "a" / "dist-info" / "nvidia_cuda_runtime-13.0.96.dist-info" / "METADATA")
    assert read_toolkit(str(tmp_path / "a"))["version"] == "13.0.96"
    write(tmp_path / "b" / "include" / "cuda_runtime_api.h", "#define CUDART_VERSION  12040\n")
    assert read_toolkit(str(tmp_path / "b")) == {"path": str(tmp_path / "b"), "version": "12.4", "source": "include/cuda_runtime_api.h"}
    assert read_toolkit(str(tmp_path / "none"))["version"] is None


def test_library_names_and_headers(tmp_path):
    assert cuda_library_name(b"libcublasLt.so.12.1.3.1") == "cublasLt"
    assert cuda_library_name(b"libcudart-d0da41ae.so.11.0") == "cudart"
    assert cuda_library_name(b"libcudnn_ops_infer.so.8") == "cudnn_ops_infer"
    assert cuda_library_name(b"libcuda.so.1") is None  # the driver, not the toolkit
    assert cuda_library_name(b"libfoo.so") is None
    p = write(tmp_path / "cudnn.h", "#define CUDNN_MAJOR 7\n#define CUDNN_MINOR 6\n")
    assert read_header_version(p, "CUDNN") == "7.6"


def test_machine_info_fields(tmp_path):
    p = write(tmp_path / "os-release", 'PRETTY_NAME="Ubuntu 22.04.3 LTS"\nNAME="Ubuntu"\nID=ubuntu\nVERSION_ID="22.04"\n# c\n')
    assert read_os_release(p) == {"pretty_name": "Ubuntu 22.04.3 LTS", "id": "ubuntu", "version_id": "22.04"}
    assert read_os_release(str(tmp_path / "missing")) == {}
    m = machine_info()
    assert m["hostname"] and m["kernel"] == os.uname().release and m["arch"] == os.uname().machine
    assert m["cpu"]["count"] == os.cpu_count()
    assert m["memory_bytes"] is None or m["memory_bytes"] > 1 << 20
