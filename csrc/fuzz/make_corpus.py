"""Writes the seed corpus of the fuzz harnesses (csrc/fuzz/corpus/). Run from anywhere:
``python csrc/fuzz/make_corpus.py``. The files are committed; rerun only to change the seeds."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def archive(members, fmt=tarfile.USTAR_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for name, payload, kind in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == tarfile.REGTYPE:
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
            else:
                info.linkname = "target" if kind == tarfile.SYMTYPE else ""
                tar.addfile(info)
        end = tar.offset + 1024  # the end-of-archive blocks, not the record padding after them
    return out.getvalue()[:end]


REG, DIR, SYM = tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE
SCANNER = {
    "samples": archive([("s1.jpg", b"\xff\xd8" * 300, REG), ("s1.cls", b"7", REG),
                        ("s2.jpg", b"j" * 512, REG), ("s2.cls", b"3", REG)]),
    "edge_sizes": archive([(f"e{n}.bin", bytes([n % 251]) * n, REG)
                           for n in (0, 1, 511, 512, 513, 1024)]),
    "dirs_links_meta": archive([("d/", b"", DIR), ("d/a.txt", b"a", REG), ("l.txt", b"", SYM),
                                ("__meta__", b"m", REG), ("d/a.json", b"{}", REG)]),
    "gnu_long_name": archive([("x" * 150 + "/k.txt", b"long", REG), ("k2.txt", b"2", REG)],
                             tarfile.GNU_FORMAT),
    "pax": archive([("p" * 120 + ".txt", b"pax", REG), ("\u00e9t\u00e9.txt", b"u", REG)],
                   tarfile.PAX_FORMAT),
    "duplicate": archive([("s.txt", b"1", REG), ("s.TXT", b"2", REG)]),
    "truncated": archive([("t.bin", b"t" * 3000, REG)])[:2000],
    "empty": b"",
}
# Token bytes, count byte and two size bytes per member (see fuzz_grouping.cpp).
GROUPING = {
    "two_samples": bytes([1, 0, 3, 0, 2, 3, 9, 10, 0, 1, 0, 3, 0, 2, 1, 3, 9, 9, 0]),
    "reserved_key": bytes([1, 0, 3, 0, 14, 0, 0]),
    "case_and_kelvin": bytes([2, 0, 3, 9, 1, 0, 2, 0, 3, 10, 1, 0]),
    "dirs_and_dots": bytes([4, 0, 4, 1, 11, 5, 0, 3, 7, 3, 12, 6, 0, 0, 0]),
}


def main() -> None:
    for harness, seeds in (("fuzz_tar_scanner", SCANNER), ("fuzz_grouping", GROUPING)):
        directory = HERE / "corpus" / harness
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in seeds.items():
            (directory / name).write_bytes(data)


if __name__ == "__main__":
    main()
