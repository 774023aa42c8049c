"""A large file's last chunks go out when the file ends, not when the walk does (snapshot/packer.py).

The spot loop's snapshot reads one new checkpoint and then walks the rest
of the box from the catalog; the checkpoint's tail (the chunks still with
the hash workers and a partly filled pack) used to wait for the next file
read or for ``finish``, so its last upload started only when the walk ended.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from ogrefs.repo import Repository
from ogrefs.repo.catalog import CatalogWriter
from ogrefs.snapshot.packer import Packer, PackStats

MiB = 1 << 20


def _packer(tmp_path: Path) -> tuple[Packer, Repository]:
    repo = Repository.init(f"memory://tail-{secrets.token_hex(4)}", cache_root=tmp_path / "cache",
                           pack_target_size=16 * MiB)
    repo.index.sync()
    cat = CatalogWriter(tmp_path / "cat.sqlite")
    unreadable = []
    packer = Packer(repo, cat, PackStats(), set(), workers=2, upload_workers=2,
                    unreadable=lambda p, e: unreadable.append(p), tick=lambda: None)
    return packer, repo


def _uploaded(packer: Packer) -> int:
    """Bytes of blobs in sealed packs (submitted or done), none in the open pack or still pending."""
    return packer.stats.stored_bytes - packer._pack.size


def test_a_large_files_tail_is_sealed_and_on_its_way_when_the_file_ends(tmp_path):
    packer, repo = _packer(tmp_path)
    try:
        big = tmp_path / "ckpt.pt"
        # the first pack closes between 16 MiB and 16 MiB + one chunk (<= 8 MiB): a tail of 4-12 MiB is left
        big.write_bytes(os.urandom(28 * MiB))
        packer.read_file(os.fsencode(big), 10, "root", "root")
        assert not packer._pending and len(packer._pack) == 0, "the tail waits for the next file or finish()"
        assert packer.stats.read_bytes == 28 * MiB and _uploaded(packer) == packer.stats.stored_bytes >= 28 * MiB
        assert packer.stats.packs == 2
        packer.finish()
        assert sorted(packer.run_packs) == sorted(k.rsplit("/", 1)[1] for k in repo.store.list("packs/"))
    finally:
        packer.close()


def test_small_files_still_share_one_pack(tmp_path):
    packer, _ = _packer(tmp_path)
    try:
        for i in range(5):
            small = tmp_path / f"s{i}.txt"
            small.write_bytes(os.urandom(2 * MiB))
            packer.read_file(os.fsencode(small), 11 + i, "root", "root")
        assert packer.stats.packs == 0  # nothing sealed after a file smaller than a pack
        packer.finish()
        assert packer.stats.packs == 1
    finally:
        packer.close()
