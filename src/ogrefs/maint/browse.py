"""Look inside a snapshot without FUSE: read files, write a tar, count sizes, retag.

What ``ogrefs ls``, ``dump``, ``stats`` and ``tag`` need below the command
line. Every chunk read here is verified against its id by the repository's
codec (a failure is CorruptObject, never wrong bytes). Single-threaded: each
function runs in the calling thread and owns what it creates.
"""

from __future__ import annotations

import os
import secrets
import stat
import tarfile
from dataclasses import dataclass, field
from typing import IO, Any, Iterator

from ogrefs.maint.tarstream import PaxWriter
from ogrefs.repo.catalog import Catalog, Inode, file_chunks
from ogrefs.errors import OgrefsError
from ogrefs.repo import Repository

#: Holes are written as zeros in pieces of this size (a sparse 100 GiB file must not need 100 GiB of memory).
_ZEROS = bytes(1 << 20)


class NotInSnapshot(OgrefsError):
    """A path the user named is not in the snapshot."""


def lookup(cat: Catalog, path: bytes, snap_id: str) -> Inode:
    node = cat.resolve(path)
    if node is None:
        raise NotInSnapshot(f"{path.decode(errors='replace')}: no such path in snapshot {snap_id[:12]}")
    return node


def file_data(repo: Repository, cat: Catalog, node: Inode) -> Iterator[bytes]:
    """A regular file's bytes in order, holes as zeros, each chunk verified."""
    pos = 0
    for ext, raw_len in file_chunks(cat, node.ino):
        yield from _zeros(ext.offset - pos)
        blob = repo.read_pack_range(ext.pack, ext.pack_offset, ext.stored_len)
        data = repo.codec.decode_blob(blob, raw_len, ext.chunk)
        yield data[:ext.length]
        pos = ext.offset + ext.length
    yield from _zeros(node.size - pos)


def _zeros(n: int) -> Iterator[bytes]:
    while n > 0:
        piece = min(n, len(_ZEROS))
        yield _ZEROS[:piece]
        n -= piece


def write_tar(repo: Repository, cat: Catalog, path: bytes, node: Inode, out: IO[bytes]) -> int:
    """Stream the tree at ``path`` as a POSIX (pax) tar to ``out``; names are relative to ``/``. Returns entries.

    Extended attributes go in as ``SCHILY.xattr.*`` records (what ``tar --xattrs`` restores)."""
    seen: dict[int, bytes] = {}  # inode -> first name (later names become hard links)
    count = 0
    tar = PaxWriter(out)
    for p, n in [(path, node), *cat.walk(node.ino, path.rstrip(b"/"))]:
        name = p.lstrip(b"/") or b"."
        info = _tar_info(name, n)
        common = {"name": name, "mtime_ns": n.mtime_ns, "xattrs": cat.xattrs(n.ino)}
        if n.is_reg and n.nlink > 1 and n.ino in seen:
            info.type, info.size = tarfile.LNKTYPE, 0
            tar.add(info, link=seen[n.ino], **common)
        elif n.is_reg:
            seen[n.ino] = name
            tar.add(info, data=file_data(repo, cat, n), **common)
        else:
            tar.add(info, link=(n.target or b"") if n.is_lnk else b"", **common)
        count += 1
    tar.close()
    return count


_TAR_TYPES = {stat.S_IFDIR: tarfile.DIRTYPE, stat.S_IFLNK: tarfile.SYMTYPE, stat.S_IFIFO: tarfile.FIFOTYPE,
              stat.S_IFCHR: tarfile.CHRTYPE, stat.S_IFBLK: tarfile.BLKTYPE, stat.S_IFREG: tarfile.REGTYPE}


def _tar_info(name: bytes, n: Inode) -> tarfile.TarInfo:
    """Type, mode, owner and size of an entry (names, link target and mtime go to :class:`PaxWriter` raw)."""
    info = tarfile.TarInfo()
    kind = stat.S_IFMT(n.mode)
    if kind not in _TAR_TYPES:
        raise OgrefsError(f"{name.decode(errors='replace')}: cannot be written to a tar (file type {kind:o})")
    info.type = _TAR_TYPES[kind]
    info.mode = stat.S_IMODE(n.mode)
    info.uid, info.gid = n.uid, n.gid
    info.uname, info.gname = n.user or "", n.grp or ""
    info.mtime = n.mtime_ns // 1_000_000_000
    info.size = n.size if n.is_reg else 0
    if kind in (stat.S_IFCHR, stat.S_IFBLK):
        info.devmajor, info.devminor = os.major(n.rdev), os.minor(n.rdev)
    return info


@dataclass
class Stats:
    mode: str
    snapshots: int = 0
    files: int = 0
    bytes: int = 0  # restore-size: bytes a restore writes; raw: plaintext of the unique chunks
    chunks: int = 0
    stored_bytes: int = 0  # raw: bytes the unique chunks take in packs (compressed, encrypted)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = {"mode": self.mode, "snapshots": self.snapshots, "total_size": self.bytes}
        if self.mode == "restore-size":
            d["total_file_count"] = self.files
        else:
            d.update(total_blob_count=self.chunks, total_stored_size=self.stored_bytes,
                     compression_ratio=round(self.bytes / self.stored_bytes, 3) if self.stored_bytes else None)
        return d


def restore_size(cats: list[Catalog]) -> Stats:
    """Entries and bytes a restore of these snapshots writes (hard links counted once), as restic's restore-size."""
    st = Stats("restore-size", snapshots=len(cats))
    for cat in cats:
        seen: set[int] = set()
        for _path, node in cat.walk():
            if node.ino in seen:
                continue
            seen.add(node.ino)
            st.files += 1
            st.bytes += node.size if node.is_reg else 0
    return st


def raw_size(cats: list[Catalog]) -> Stats:
    """The unique chunks these snapshots reference: plaintext and stored bytes, as restic's raw-data."""
    st = Stats("raw", snapshots=len(cats))
    seen: set[bytes] = set()
    for cat in cats:
        for chunk, _pack, _off, stored_len, raw_len in cat.all_blobs():
            if chunk not in seen:
                seen.add(chunk)
                st.chunks += 1
                st.bytes += raw_len
                st.stored_bytes += stored_len
    return st


def retag(repo: Repository, manifest: dict[str, Any], tags: list[str]) -> dict[str, Any]:
    """Store the snapshot again under a new id with ``tags``, then remove the old one (as restic's ``tag``).

    A new id rather than an overwrite: manifests are cached by id on every box
    that read them, and a cached manifest is never checked again. The new
    manifest names the first id in ``original``; the access traces go with
    it (a mount of the retagged snapshot replays them). Order: catalog,
    traces, manifest, then the old manifest, catalog and traces go, so a
    crash leaves at worst both.
    """
    from ogrefs.maint.remove import carry_traces, remove_snapshot

    old, new = manifest["id"], secrets.token_hex(32)
    catalog = repo.codec.open(f"catalogs/{old}", repo.store.get(f"catalogs/{old}"))
    repo.store.put(f"catalogs/{new}", repo.codec.seal(f"catalogs/{new}", catalog))
    carry_traces(repo, old, new)
    moved = {**manifest, "id": new, "tags": tags, "original": manifest.get("original") or old}
    repo.put_manifest(moved)
    remove_snapshot(repo, old)
    return moved
