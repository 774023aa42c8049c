"""Make a Debian root look like one GPU provider's image (boxes A and B of the lab).

Everything a provider's image sets per box differs between A and B:
identity (hostname, machine-id, /etc/hosts), name resolution, network
config, fstab (other disk UUIDs, a second disk at /mnt/scratch), cloud-init's
instance, ssh host keys, the login user (another name with uid 1000, its
authorized key, its sudoers file), the kernel, and an NVIDIA driver
userspace of another version (``fake_nvidia/``: libcuda, libnvidia-ml and
nvidia-smi refusing a kernel module of another version, registered in the
dynamic linker's cache, a dkms tree, a kernel module file and dpkg records).
Box A also carries a training project (``/opt/project``: a venv, code, data,
a checkpoint and ``train.py``) that box B must get back exactly.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ogrefs.snapshot.selection import box_name

FAKE_NVIDIA = Path(__file__).resolve().parent / "fake_nvidia"
LIBDIR = "usr/lib/x86_64-linux-gnu"


@dataclass(frozen=True)
class Provider:
    hostname: str
    machine_id: str
    nameserver: str
    search: str
    user: str
    root_uuid: str
    scratch_uuid: str
    iface: str
    instance_id: str
    kernel: str
    driver: str
    cuda: int  # CUDA driver API version, e.g. 12020

    @property
    def box(self) -> str:
        """The box ogrefs names a snapshot taken on this machine (host name, machine id, instance id)."""
        return box_name(self.hostname, self.machine_id.encode(), self.instance_id.encode())

    @property
    def cuda_text(self) -> str:
        return f"{self.cuda // 1000}.{self.cuda % 1000 // 10}"

    def kmod_line(self) -> str:
        """The line /proc/driver/nvidia/version shows when this driver's kernel module is loaded."""
        return (f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {self.driver}  "
                "Wed Nov  1 00:00:00 UTC 2023\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")


PROVIDERS = {
    "a": Provider("gpu-a-7f3e", "a1" * 16, "10.10.0.2", "a-cloud.internal", "ubuntu",
                  "3f1c2a9e-1111-4a5b-9c7d-aaaaaaaaaaaa", "3f1c2a9e-2222-4a5b-9c7d-aaaaaaaaaaaa",
                  "ens3", "i-0aaaaaaaaaaaaaaa1", "6.1.0-18-amd64", "535.104.05", 12020),
    "b": Provider("node-b-42", "b2" * 16, "10.20.0.53", "b-cloud.example", "admin",
                  "8e2d4b7f-3333-4c6d-8e9f-bbbbbbbbbbbb", "8e2d4b7f-4444-4c6d-8e9f-bbbbbbbbbbbb",
                  "enp5s0", "b-instance-000042", "6.1.0-25-amd64", "550.54.15", 12040),
}


def _write(root: Path, rel: str, text: str, mode: int = 0o644) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.exists():
        path.unlink()
    path.write_text(text)
    path.chmod(mode)


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)


def make_provider_box(root: Path, p: Provider) -> None:
    _identity(root, p)
    _network(root, p)
    _disks(root, p)
    _cloud_init(root, p)
    _ssh_host_keys(root, p)
    _login_user(root, p)
    _nvidia_driver(root, p)
    if p is PROVIDERS["a"]:
        _training_project(root)


def _identity(root: Path, p: Provider) -> None:
    _write(root, "etc/hostname", f"{p.hostname}\n")
    _write(root, "etc/machine-id", f"{p.machine_id}\n", 0o444)
    _write(root, "etc/hosts", f"127.0.0.1\tlocalhost\n127.0.1.1\t{p.hostname}.{p.search}\t{p.hostname}\n"
                              "::1\tlocalhost ip6-localhost ip6-loopback\n")


def _network(root: Path, p: Provider) -> None:
    _write(root, "etc/resolv.conf", f"nameserver {p.nameserver}\nsearch {p.search}\n")
    _write(root, "etc/network/interfaces", "source /etc/network/interfaces.d/*\nauto lo\niface lo inet loopback\n"
                                           f"auto {p.iface}\niface {p.iface} inet dhcp\n")
    if p is PROVIDERS["a"]:
        _write(root, "etc/netplan/50-cloud-init.yaml",
               f"network:\n  version: 2\n  ethernets:\n    {p.iface}:\n      dhcp4: true\n", 0o600)
    else:
        _write(root, "etc/systemd/network/10-cloud.network", f"[Match]\nName={p.iface}\n\n[Network]\nDHCP=yes\n"
                                                            f"DNS={p.nameserver}\nDomains={p.search}\n")


def _disks(root: Path, p: Provider) -> None:
    _write(root, "etc/fstab", f"UUID={p.root_uuid}\t/\text4\terrors=remount-ro\t0\t1\n"
                              f"UUID={p.scratch_uuid}\t/mnt/scratch\text4\tdefaults,nofail\t0\t2\n")
    (root / "mnt/scratch").mkdir(parents=True, exist_ok=True)
    (root / "srv").mkdir(exist_ok=True)


def _cloud_init(root: Path, p: Provider) -> None:
    inst = f"var/lib/cloud/instances/{p.instance_id}"
    _write(root, f"{inst}/instance-id", f"{p.instance_id}\n")
    _write(root, f"{inst}/user-data.txt", f"#cloud-config\nhostname: {p.hostname}\n")
    _write(root, "var/lib/cloud/data/instance-id", f"{p.instance_id}\n")
    link = root / "var/lib/cloud/instance"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(f"/{inst}")


def _ssh_host_keys(root: Path, p: Provider) -> None:
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    for kind in ("ed25519", "ecdsa"):
        _run(["ssh-keygen", "-q", "-N", "", "-t", kind, "-C", f"root@{p.hostname}",
              "-f", str(root / f"etc/ssh/ssh_host_{kind}_key")])


def _login_user(root: Path, p: Provider) -> None:
    """The provider's login user with uid 1000, its authorized key and its sudoers file."""
    _run(["chroot", str(root), "useradd", "-m", "-u", "1000", "-U", "-s", "/bin/bash", "-G", "sudo", p.user])
    ssh = root / f"home/{p.user}/.ssh"
    ssh.mkdir(mode=0o700)
    _run(["ssh-keygen", "-q", "-N", "", "-t", "ed25519", "-C", f"provider-key@{p.hostname}", "-f", str(ssh / "provider")])
    (ssh / "authorized_keys").write_text((ssh / "provider.pub").read_text())
    (ssh / "provider").unlink()
    (ssh / "provider.pub").unlink()
    (ssh / "authorized_keys").chmod(0o600)
    _run(["chown", "-R", "1000:1000", str(ssh)])
    _write(root, "etc/sudoers.d/90-cloud-init-users", f"# Created by cloud-init\n{p.user} ALL=(ALL) NOPASSWD:ALL\n",
           0o440)


def _nvidia_driver(root: Path, p: Provider) -> None:
    lib = root / LIBDIR
    flags = [f'-DDRIVER_VERSION="{p.driver}"', f"-DCUDA_VERSION={p.cuda}", f'-DCUDA_VERSION_TEXT="{p.cuda_text}"',
             f"-I{FAKE_NVIDIA}", "-O2", "-Wall"]
    for src, soname in (("libcuda.c", "libcuda.so.1"), ("libnvml.c", "libnvidia-ml.so.1")):
        real = f"{soname[:-2]}.{p.driver}"
        _run(["gcc", "-shared", "-fPIC", *flags, f"-Wl,-soname,{soname}", "-o", str(lib / real), str(FAKE_NVIDIA / src)])
        for name in (soname, soname[:-2]):
            (lib / name).unlink(missing_ok=True)
            (lib / name).symlink_to(soname if name != soname else real)
    _run(["gcc", *flags, "-o", str(root / "usr/bin/nvidia-smi"), str(FAKE_NVIDIA / "nvidia_smi.c"), "-ldl"])
    _run(["ldconfig", "-r", str(root)])
    files = [f"/{LIBDIR}/libcuda.so.{p.driver}", f"/{LIBDIR}/libcuda.so.1", f"/{LIBDIR}/libcuda.so",
             f"/{LIBDIR}/libnvidia-ml.so.{p.driver}", f"/{LIBDIR}/libnvidia-ml.so.1", f"/{LIBDIR}/libnvidia-ml.so",
             "/usr/bin/nvidia-smi"]
    _write(root, "var/lib/dpkg/info/nvidia-driver-lab:amd64.list", "".join(f"{f}\n" for f in files))
    with open(root / "var/lib/dpkg/status", "a") as status:
        status.write(f"\nPackage: nvidia-driver-lab\nStatus: install ok installed\nPriority: optional\n"
                     f"Section: non-free/libs\nInstalled-Size: 64\nMaintainer: ogrefs lab <lab@ogrefs.invalid>\n"
                     f"Architecture: amd64\nVersion: {p.driver}-1\n"
                     f"Description: NVIDIA driver userspace {p.driver} (fake, for the ogrefs lab)\n")
    _write(root, f"usr/src/nvidia-{p.driver}/dkms.conf",
           f'PACKAGE_NAME="nvidia"\nPACKAGE_VERSION="{p.driver}"\nBUILT_MODULE_NAME[0]="nvidia"\n'
           'DEST_MODULE_LOCATION[0]="/updates/dkms"\nAUTOINSTALL="yes"\n')
    dkms = root / f"var/lib/dkms/nvidia/{p.driver}"
    dkms.mkdir(parents=True, exist_ok=True)
    (dkms / "source").symlink_to(f"/usr/src/nvidia-{p.driver}")
    _write(root, f"lib/modules/{p.kernel}/updates/dkms/nvidia.ko", f"fake nvidia.ko version {p.driver}\n")


TRAIN_PY = '''\
"""Tiny training loop: resume from the newest checkpoint, run steps, save a new one."""
import json, pathlib, sys
import tinytrain

ckpts = pathlib.Path("/opt/project/checkpoints")
latest = max(ckpts.glob("step-*.json"), key=lambda p: int(p.stem.split("-")[1]))
state = json.loads(latest.read_text())
print(f"resumed from step {state['step']} loss {state['loss']}")
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 10):
    state = tinytrain.step(state, pathlib.Path("/opt/project/data/shard-0.bin").read_bytes())
(ckpts / f"step-{state['step']}.json").write_text(json.dumps(state))
print(f"saved step {state['step']} loss {state['loss']}")
'''

TINYTRAIN = '''\
def step(state, data):
    """One deterministic 'optimizer step' over the data."""
    loss = round(state["loss"] * 0.9 + (sum(data[:256]) % 7) * 0.001, 6)
    return {"step": state["step"] + 1, "loss": loss}
'''


def _training_project(root: Path) -> None:
    proj = root / "opt/project"
    _run(["chroot", str(root), "/usr/bin/python3", "-m", "venv", "--without-pip", "/opt/project/.venv"])
    site = next((proj / ".venv/lib").glob("python3*/site-packages"))
    _write(root, str((site / "tinytrain/__init__.py").relative_to(root)), TINYTRAIN)
    _write(root, "opt/project/train.py", TRAIN_PY)
    _write(root, "opt/project/data/shard-0.bin", "")
    (proj / "data/shard-0.bin").write_bytes(bytes((i * 131 + 7) % 251 for i in range(3 << 20)))
    _write(root, "opt/project/checkpoints/step-100.json", '{"step": 100, "loss": 0.4321}')
    _write(root, "opt/project/checkpoints/step-100.pt", "")
    (proj / "checkpoints/step-100.pt").write_bytes(bytes((i * 7 + 3) % 256 for i in range(5 << 20)))
    _write(root, "root/notes.txt", "box A's notes\n")
    _write(root, "a-provider-top-level.txt", "a file at the top of box A\n")
    shutil.rmtree(root / "opt/project/.venv/include", ignore_errors=True)
