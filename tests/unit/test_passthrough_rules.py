"""FUSE passthrough's parts that need no mount (mount/gotslot.py, mount/passthrough.py).

The kernel side is tested through a real writable mount in tests/system/test_passthrough.py.
"""

from __future__ import annotations

import ctypes
import os
import subprocess

import pytest

from ogrefs.mount.gotslot import GotSlot, loaded_path, slot_offset
from ogrefs.mount.passthrough import Passthrough

pyfuse3 = pytest.importorskip("pyfuse3")  # maps libfuse3 into this process


def _readelf_slot(path: str, symbol: str) -> int:
    out = subprocess.run(["readelf", "-rW", path], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[4].split("@")[0] == symbol:
            return int(fields[0], 16)
    raise AssertionError(f"readelf lists no relocation of {symbol} in {path}")


def test_the_slot_found_is_the_one_readelf_lists():
    libfuse = loaded_path("libfuse3.so")
    assert slot_offset(libfuse, "writev") == _readelf_slot(libfuse, "writev")
    binding = os.path.realpath(pyfuse3.__file__)
    assert slot_offset(binding, "fuse_reply_open") == _readelf_slot(binding, "fuse_reply_open")
    with pytest.raises(OSError, match="does not import"):
        slot_offset(libfuse, "no_such_function_anywhere")


def test_a_redirected_slot_holds_the_new_address_and_is_given_back():
    libfuse = loaded_path("libfuse3.so")
    slot = GotSlot(libfuse, "writev")
    libc_writev = ctypes.cast(ctypes.CDLL(None).writev, ctypes.c_void_p).value
    assert slot.original == libc_writev and not slot.redirected
    other = ctypes.cast(ctypes.CDLL(None).readv, ctypes.c_void_p).value  # never called: the slot is restored first
    slot.point_at(other)
    try:
        assert slot.redirected and ctypes.c_uint64.from_address(slot.address).value == other
        with pytest.raises(OSError, match="does not hold"):  # a slot someone else redirected is refused
            GotSlot(libfuse, "writev")
    finally:
        slot.restore()
    assert not slot.redirected and ctypes.c_uint64.from_address(slot.address).value == libc_writev


class _Kernel(Passthrough):
    """A Passthrough whose ioctls are recorded instead of made."""

    def __init__(self) -> None:
        super().__init__()
        self.state, self.dev_fd = "asked", -1
        self.next_id, self.closed = 1, []

    def _backing_open(self, fd: int) -> int | None:
        self.next_id += 1
        self.stats.backing_opens += 1
        self.state = "on"
        return self.next_id

    def _backing_close(self, backing_id: int) -> None:
        self.closed.append(backing_id)


def test_an_inode_is_passed_through_only_with_no_other_handle_and_then_for_every_open():
    pt = _Kernel()
    assert not pt.choose(7, fh=1, other_handles=0, local_fd=None)  # no verified copy
    assert not pt.choose(7, fh=2, other_handles=1, local_fd=5)  # a cached handle is open: the kernel would EIO
    assert pt.stats.declined == 1
    assert pt.choose(8, fh=3, other_handles=0, local_fd=5)
    pt._armed = None  # (the reply was sent)
    # the inode is in passthrough mode: a new open goes through with the same backing id, verified copy or not
    assert pt.serves(8) and pt.choose(8, fh=4, other_handles=1, local_fd=None)
    assert pt._armed == (4, 2)
    pt._armed = None
    pt.released(3)
    assert pt.serves(8) and pt.closed == []  # fh 4 still open
    pt.released(4)
    assert not pt.serves(8) and pt.closed == [2]  # closed with the inode's last passthrough handle
    pt.released(99)  # a handle that never went through: nothing to do
    assert pt.closed == [2]


def test_a_mount_without_passthrough_declines_every_open():
    pt = Passthrough()
    assert pt.state == "off" and not pt.usable
    assert not pt.choose(8, fh=1, other_handles=0, local_fd=5)
