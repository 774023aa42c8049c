"""Build source trees with every kind of entry, and compare trees exactly.

Used by the snapshot/restore tests and by the mount tests: ``compare_trees``
is the single definition of "restored bit for bit".
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

GiB = 1024**3


def make_fidelity_tree(root: Path, big: bool = False) -> None:
    """Every kind of entry the repository must reproduce (root only for some)."""
    root.mkdir(parents=True, exist_ok=True)
    r = os.fsencode(root)
    (root / "empty").write_bytes(b"")
    (root / "small.txt").write_bytes(b"hello ogrefs\n")
    (root / "random.bin").write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    (root / "dup1.bin").write_bytes(b"A" * (2 * 1024 * 1024))
    (root / "dup2.bin").write_bytes(b"A" * (2 * 1024 * 1024))
    sub = root / "dir" / "nested" / "deeper"
    sub.mkdir(parents=True)
    (sub / "leaf.py").write_text("print('leaf')\n")
    os.symlink("../small.txt", root / "dir" / "link-rel")
    os.symlink("/nonexistent/target", root / "dangling")
    os.symlink("loop-b", root / "loop-a")
    os.symlink("loop-a", root / "loop-b")
    os.link(root / "small.txt", root / "dir" / "hardlink-to-small")
    os.mkfifo(root / "fifo")
    if os.geteuid() == 0:
        os.mknod(root / "null-dev", stat.S_IFCHR | 0o644, os.makedev(1, 3))
        os.mknod(root / "blk-dev", stat.S_IFBLK | 0o600, os.makedev(7, 200))
    # names that are not UTF-8, contain newlines, are long
    os.close(os.open(r + b"/bad-\xff\xfe-name", os.O_CREAT | os.O_WRONLY, 0o644))
    (root / "new\nline").write_bytes(b"nl")
    (root / ("L" * 255)).write_bytes(b"long name")
    # permissions
    for name, mode in (("setuid", 0o4755), ("setgid", 0o2750), ("sticky-dir", 0o1777), ("private", 0o600)):
        p = root / name
        if name.endswith("dir"):
            p.mkdir()
        else:
            p.write_bytes(name.encode())
        os.chmod(p, mode)
    owned = root / "owned"
    owned.write_bytes(b"owned by 1234:5678")
    if os.geteuid() == 0:
        os.chown(owned, 1234, 5678)
        os.lchown(root / "dangling", 4321, 8765)
    os.utime(root / "small.txt", ns=(1_600_000_000_123_456_789, 1_500_000_000_987_654_321))
    # xattrs
    x = root / "xattrs"
    x.write_bytes(b"x")
    os.setxattr(x, "user.comment", b"ogrefs keeps this")
    os.setxattr(x, "user.binary", bytes(range(256)))
    if os.geteuid() == 0:
        # a capability: cap_net_bind_service+ep (vfs_cap_data revision 2)
        cap = bytes.fromhex("0100000200040000000000000000000000000000")
        try:
            os.setxattr(x, "security.capability", cap)
        except OSError:
            pass
    # sparse: holes must stay holes
    with open(root / "sparse", "wb") as fh:
        fh.seek(10 * 1024 * 1024)
        fh.write(b"middle")
        fh.seek(30 * 1024 * 1024)
        fh.write(b"end")
    if big:
        with open(root / "sparse-5g", "wb") as fh:
            fh.seek(5 * GiB - 4)
            fh.write(b"tail")
        with open(root / "over-4g", "wb") as fh:
            fh.write(os.urandom(1024 * 1024))
            fh.seek(4 * GiB + 100)
            fh.write(os.urandom(1024 * 1024))
    os.utime(root / "dir", ns=(1_400_000_000_000_000_001, 1_400_000_000_000_000_002))


def _xattrs(path: bytes) -> dict:
    try:
        return {n: os.getxattr(path, n, follow_symlinks=False) for n in os.listxattr(path, follow_symlinks=False)}
    except OSError:
        return {}


def _content_digest(path: bytes, layout: bool = True) -> str:
    """Digest of (offset, bytes) of every data extent: equal for equal content
    *and* equal hole layout, and quick on multi-GiB sparse files.  With
    ``layout=False``, the plain bytes (for file systems that cannot report
    holes through SEEK_DATA, such as a FUSE mount)."""
    h = hashlib.blake2b()
    if not layout:
        with open(path, "rb") as fh:
            while block := fh.read(4 * 1024 * 1024):
                h.update(block)
        return h.hexdigest()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            h.update(start.to_bytes(8, "little"))
            while start < end:
                block = os.pread(fd, min(4 * 1024 * 1024, end - start), start)
                if not block:
                    break
                h.update(block)
                start += len(block)
            pos = end
        h.update(size.to_bytes(8, "little"))
    finally:
        os.close(fd)
    return h.hexdigest()


def describe(root: Path | bytes, *, times: bool = True, check_holes: bool = True,
             seek_holes: bool = True) -> dict[bytes, tuple]:
    """Everything restore must reproduce, keyed by path relative to root.

    ``seek_holes=False``: file contents are compared as plain bytes even when holes are checked (by
    st_blocks), for a tree whose file system cannot answer SEEK_DATA/SEEK_HOLE (a FUSE mount).
    """
    root_b = os.fsencode(root)
    out: dict[bytes, tuple] = {}
    inode_group: dict[tuple[int, int], bytes] = {}
    for dirpath, dirnames, filenames in os.walk(root_b):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root_b)
            st = os.lstat(p)
            kind = stat.S_IFMT(st.st_mode)
            content: object = None
            if stat.S_ISREG(st.st_mode):
                content = (st.st_size, _content_digest(p, layout=check_holes and seek_holes))
                if check_holes:
                    content += (st.st_blocks * 512 < st.st_size // 2 if st.st_size > 1024 * 1024 else None,)
            elif stat.S_ISLNK(st.st_mode):
                content = os.readlink(p)
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                content = st.st_rdev
            link_group = None
            if not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1:
                link_group = inode_group.setdefault((st.st_dev, st.st_ino), rel)
            out[rel] = (
                kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, content, link_group,
                st.st_mtime_ns if times and not stat.S_ISLNK(st.st_mode) else None,
                tuple(sorted(_xattrs(p).items())),
            )
    return out


def compare_trees(a: Path | bytes, b: Path | bytes, **kw) -> list[str]:
    """Differences between two trees, as readable lines; empty means identical."""
    da, db = describe(a, **kw), describe(b, **kw)
    diffs = []
    for key in sorted(set(da) | set(db)):
        if key not in da:
            diffs.append(f"extra {key!r}")
        elif key not in db:
            diffs.append(f"missing {key!r}")
        elif da[key] != db[key]:
            diffs.append(f"differs {key!r}: {da[key]} != {db[key]}")
    return diffs
