"""The data sets benchmarks/epoch.py reads, and the loaders timed on each: shards generated on
the drive under test per profile (100 KB and 8 KB samples, small JPEGs), or the shards already
in a directory (the decode chains added where they hold JPEGs)."""

from __future__ import annotations

import dataclasses
import tarfile
from pathlib import Path
from typing import List, Sequence

import _bench
import _loaders
import _verdicts
from tqdm import tqdm

from flashstream.sizes import parse_size

__all__ = ["JPEG", "PROFILES", "DataSet", "data_sets"]

# name -> (sample payload bytes, default data set bytes, shard bytes)
PROFILES = {"100KB": (100_000, 1 << 30, 128 << 20), "8KB": (8_000, 384 << 20, 64 << 20)}
JPEG = _verdicts.JPEG  # small JPEGs for the decode chain
JPEG_SIZES = (64 << 20, 16 << 20)  # the JPEG data set's default bytes, shard bytes


@dataclasses.dataclass
class DataSet:
    name: str
    paths: List[Path]
    loaders: Sequence[str]  # what to time on it (fio is added to plain data sets)

    @property
    def bytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)


def _has_jpeg(path: Path) -> bool:
    try:
        with tarfile.open(path) as tar:
            member = tar.next()
            while member is not None and not member.isfile():
                member = tar.next()
            return member is not None and member.name.lower().endswith((".jpg", ".jpeg"))
    except (tarfile.TarError, OSError):
        return False


def data_sets(args) -> List[DataSet]:
    fio = () if args.no_fio else ("fio",)
    data_loaders = _loaders.DATA_LOADERS if not args.no_webdataset else ("inprocess", "tensors")
    decode = (_loaders.DECODE_LOADERS if not args.no_webdataset
              else _loaders.DECODE_LOADERS[:1])
    if args.data is not None:
        paths = sorted(p for p in args.data.iterdir()
                       if p.suffix in (".tar", ".tgz", ".gz", ".bz2", ".xz") and p.is_file())
        if not paths:
            raise SystemExit(f"no shards (*.tar, *.tgz, ...) in {args.data}")
        loaders = (*fio, *data_loaders) + (decode if _has_jpeg(paths[0]) else ())
        return [DataSet(args.data.name or "data", paths, loaders)]
    out = []
    for name in args.profiles.split(","):
        with tqdm(desc=f"writing {name} shards", unit="shard", leave=False, disable=None) as bar:
            if name == JPEG:
                total = parse_size(args.jpeg_size, name="--jpeg-size") if args.jpeg_size \
                    else JPEG_SIZES[0]
                paths = _bench.write_jpeg_shards(
                    args.workdir / f"jpeg-{total}", total_bytes=total,
                    shard_bytes=min(JPEG_SIZES[1], max(total // 4, 1 << 20)), progress=bar)
                out.append(DataSet(name, paths, decode))
                continue
            sample_size, default_total, shard_bytes = PROFILES[name]
            total = parse_size(args.size, name="--size") if args.size else default_total
            paths = _bench.write_synthetic_shards(
                args.workdir / f"samples-{name}-{total}", sample_size=sample_size,
                total_bytes=total, shard_bytes=min(shard_bytes, max(total // 4, 1 << 20)),
                progress=bar)
            out.append(DataSet(name, paths, (*fio, *data_loaders)))
    return out
