"""The pax tar writer of ``dump`` (tier 1: bytes in memory, read back with tarfile)."""

from __future__ import annotations

import io
import tarfile

from ogrefs.maint.tarstream import PaxWriter, pax_record


def test_a_pax_record_counts_its_own_length_across_powers_of_ten():
    for n in range(0, 1100):
        rec = pax_record(b"k", b"v" * n)
        length, _, rest = rec.partition(b" ")
        assert int(length) == len(rec) and rest == b"k=" + b"v" * n + b"\n"


def test_fields_ustar_cannot_hold_come_back_exactly():
    buf = io.BytesIO()
    tar = PaxWriter(buf)
    info = tarfile.TarInfo()
    info.type, info.mode, info.uid, info.gid, info.size = tarfile.REGTYPE, 0o640, 2 ** 31, 7, 3
    info.uname, info.gname = "u" * 40, "gr\u00fcppe"
    name = b"d/" + b"x" * 200 + b"\xff"
    tar.add(info, name=name, mtime_ns=-1_500_000_001, xattrs=[(b"user.a", b"\x00")], data=[b"ab", b"c"])
    tar.close()
    assert len(buf.getvalue()) % tarfile.RECORDSIZE == 0
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as t:
        (m,) = t.getmembers()
        assert m.name.encode("utf-8", "surrogateescape") == name and m.uid == 2 ** 31 and m.gid == 7
        assert (m.uname, m.gname, m.mode) == ("u" * 40, "gr\u00fcppe", 0o640)
        assert m.pax_headers["mtime"] == "-1.500000001" and t.extractfile(m).read() == b"abc"
        assert m.pax_headers["SCHILY.xattr.user.a"] == "\x00"
