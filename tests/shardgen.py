"""Writing test shards: Python tarfile in each format, GNU tar, and odd members."""

from __future__ import annotations

import io
import os
import random
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

EDGE_SIZES = [0, 1, 511, 512, 513, 4095, 4096, 4097]

Sample = Tuple[str, Dict[str, bytes]]  # key, {ext: data}


def payload(rng: random.Random, size: int) -> bytes:
    return rng.randbytes(size)


def make_samples(n: int, *, sizes: Iterable[int] = (100,), seed: int = 0,
                 exts: Tuple[str, ...] = ("cls", "bin"), prefix: str = "s") -> List[Sample]:
    rng = random.Random(seed)
    sizes = list(sizes)
    out = []
    for i in range(n):
        fields = {}
        for j, ext in enumerate(exts):
            size = sizes[(i + j) % len(sizes)] if ext != "cls" else rng.randrange(1, 8)
            fields[ext] = payload(rng, size) if ext != "cls" else str(i).encode()
        out.append((f"{prefix}{i:06d}", fields))
    return out


def write_tar(path: Path, samples: List[Sample], *, fmt: int = tarfile.GNU_FORMAT,
              extra: Optional[List[tarfile.TarInfo]] = None, mode: str = "w") -> Path:
    """Write samples as members key.ext in order; ``extra`` members are prepended."""
    with tarfile.open(path, mode, format=fmt) as tar:
        for info in extra or []:
            tar.addfile(info, io.BytesIO(b"") if info.isreg() else None)
        for key, fields in samples:
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                info.mtime = 1_700_000_000
                tar.addfile(info, io.BytesIO(data))
    return path


def write_shards(directory: Path, n_shards: int, per_shard: int, **kw) -> List[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(n_shards):
        samples = make_samples(per_shard, seed=s, prefix=f"shard{s:03d}/s", **kw)
        paths.append(write_tar(directory / f"shard-{s:06d}.tar", samples))
    return paths


def write_with_gnu_tar(path: Path, workdir: Path, files: Dict[str, bytes], fmt: str,
                       links: bool = True) -> Optional[Path]:
    """Write ``files`` (relative names) with GNU tar in format ``fmt`` (gnu, pax, ustar),
    adding a directory entry, a symlink and a hard link. None when tar is missing."""
    tar = shutil.which("tar")
    if tar is None:
        return None
    root = workdir / f"src-{fmt}"
    for name, data in files.items():
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    names = sorted(files)
    if links and names:
        first = names[0]
        os.symlink(os.path.basename(first), root / (first + ".symlink.txt"))
        os.link(root / first, root / (first + ".hardlink.txt"))
    subprocess.run([tar, f"--format={fmt}", "--sort=name", "-cf", str(path), "-C", str(root),
                    "."], check=True)
    return path


def wds_samples(urls, **kw) -> List[dict]:
    import webdataset as wds

    return list(wds.WebDataset(urls, shardshuffle=False, **kw))
