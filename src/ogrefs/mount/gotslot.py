"""One imported function of a loaded shared object, redirected for this process (its GOT slot).

A shared object calls a function of another one through a slot of its global
offset table that the dynamic linker fills in (``R_*_JUMP_SLOT`` or
``R_*_GLOB_DAT`` relocations).  :class:`GotSlot` finds that slot for one
library and one symbol (the section headers and the dynamic relocations of the
library's file on disk, the load address from ``/proc/self/maps``) and writes
another function's address into it, then the original back.  Only calls *from
that library* are redirected; everyone else still calls the real function.

ogrefs uses it for FUSE passthrough, which libfuse 3.14 and pyfuse3 3.5 cannot
ask for (mount/passthrough.py): the INIT reply's bytes are amended on their way
to ``/dev/fuse`` and an OPEN reply is sent with the backing file's id.

Refuses (OSError) rather than guesses: an unknown machine, a library that is
not mapped, a symbol it does not import, or a slot that does not hold the
address the dynamic linker gives for the symbol (something else redirected it,
or binding is lazy and the call was never made: then the slot is left alone).
A slot in a read-only page (RELRO, ``BIND_NOW``) is made writable for the
store and read-only again.

Who owns what: a GotSlot is written only by the thread that owns its user
(the mount's trio loop); an aligned 8-byte store is atomic, so a thread that
calls through the slot meanwhile calls either function, never half of one.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct

SHT_RELA = 4
#: relocation types that fill a slot with a symbol's address, by ELF machine
_SLOT_TYPES = {62: (6, 7),          # x86_64: R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT
               183: (1025, 1026)}   # aarch64: R_AARCH64_GLOB_DAT, R_AARCH64_JUMP_SLOT
PROT_READ, PROT_WRITE = 1, 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.dlsym.restype = ctypes.c_void_p
_libc.dlsym.argtypes = (ctypes.c_void_p, ctypes.c_char_p)


def loaded_path(name_start: str) -> str:
    """The path of the mapped shared object whose file name starts with ``name_start``."""
    for path, _start, _end, _perms, _offset in _maps():
        if os.path.basename(path).startswith(name_start):
            return path
    raise OSError(f"no shared object named {name_start}* is loaded")


def _maps() -> list[tuple[str, int, int, str, int]]:
    """This process's file-backed mappings: (path, start, end, permissions, file offset)."""
    rows = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/"):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                rows.append((parts[5].rstrip("\n"), start, end, parts[1], int(parts[2], 16)))
    return rows


def slot_offset(path: str, symbol: str) -> int:
    """The virtual address (before loading) of the slot through which ``path`` calls ``symbol``."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise OSError(f"{path} is not a 64-bit little-endian ELF file")
    machine = struct.unpack_from("<H", data, 18)[0]
    if machine not in _SLOT_TYPES:
        raise OSError(f"{path}: machine {machine} is not supported")
    shoff, = struct.unpack_from("<Q", data, 40)
    shentsize, shnum = struct.unpack_from("<HH", data, 58)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    want = symbol.encode()
    for _name, sh_type, _fl, _addr, offset, size, link, _info, _al, entsize in sections:
        if sh_type != SHT_RELA or entsize != 24 or link >= shnum:
            continue
        symtab = sections[link]
        strtab = sections[symtab[6]]
        for pos in range(offset, offset + size, 24):
            r_offset, r_info, _addend = struct.unpack_from("<QQq", data, pos)
            if r_info & 0xFFFFFFFF not in _SLOT_TYPES[machine] or not r_info >> 32:
                continue
            st_name, = struct.unpack_from("<I", data, symtab[4] + (r_info >> 32) * 24)
            start = strtab[4] + st_name
            if data[start:data.index(b"\0", start)] == want:
                return r_offset
    raise OSError(f"{os.path.basename(path)} does not import {symbol}")


def _load_bias(path: str) -> int:
    for mapped, start, _end, _perms, offset in _maps():
        if mapped == path and offset == 0:
            with open(path, "rb") as f:
                head = f.read(64)
                phoff, = struct.unpack_from("<Q", head, 32)
                phentsize, phnum = struct.unpack_from("<HH", head, 54)
                f.seek(phoff)
                table = f.read(phentsize * phnum)
            for i in range(phnum):
                p_type, _flags, p_offset, p_vaddr = struct.unpack_from("<IIQQ", table, i * phentsize)
                if p_type == 1 and p_offset == 0:  # the PT_LOAD that maps the file's start
                    return start - p_vaddr
            raise OSError(f"{path} has no load segment at its start")
    raise OSError(f"{path} is not mapped")


class GotSlot:
    """The slot through which the loaded library at ``path`` calls ``symbol`` (defined in ``provider``, or in
    a library loaded globally such as libc); see the module docstring."""

    def __init__(self, path: str, symbol: str, provider: str | None = None) -> None:
        if platform.system() != "Linux":
            raise OSError("GOT slots are redirected on Linux only")
        self.path, self.symbol = path, symbol
        self.address = _load_bias(path) + slot_offset(path, symbol)
        self._cell = ctypes.c_uint64.from_address(self.address)
        # the definition the linker bound: in ``provider`` (a library name dlopen takes), else anywhere global
        real = _libc.dlsym(ctypes.CDLL(provider)._handle if provider else None, symbol.encode())
        if not real or self._cell.value != real:
            raise OSError(f"the slot of {symbol} in {os.path.basename(path)} does not hold {symbol}'s address "
                          f"(already redirected, or bound lazily)")
        self.original = real
        # RELRO under BIND_NOW: read-only once relocated, made writable for each store (and never by others)
        self._writable = any(lo <= self.address < hi and "w" in perms for _p, lo, hi, perms, _o in _maps())

    def point_at(self, address: int) -> None:
        """Make the library's calls of the symbol go to ``address`` (the original: :attr:`original`)."""
        page = self.address & ~(mmap.PAGESIZE - 1)
        writable = self._writable
        if not writable and _libc.mprotect(page, mmap.PAGESIZE, PROT_READ | PROT_WRITE) != 0:
            raise OSError(ctypes.get_errno(), f"cannot make the slot of {self.symbol} writable")
        try:
            self._cell.value = address
        finally:
            if not writable:
                _libc.mprotect(page, mmap.PAGESIZE, PROT_READ)

    def restore(self) -> None:
        self.point_at(self.original)

    @property
    def redirected(self) -> bool:
        return self._cell.value != self.original
