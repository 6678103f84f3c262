#!/usr/bin/env python3
"""Write a few WebDataset shards, then train-style iterate them with ShardStream.

    python examples/read_shards.py [DIR]
"""

from __future__ import annotations

import io
import sys
import tarfile
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from flashstream import ShardStream


def write_shards(directory: Path, shards: int = 4, per_shard: int = 64) -> str:
    for s in range(shards):
        with tarfile.open(directory / f"train-{s:06d}.tar", "w") as tar:
            for i in range(per_shard):
                key = f"{s:03d}{i:05d}"
                for ext, data in (("cls", str(i % 10).encode()),
                                  ("pt", torch.randn(16).numpy().tobytes())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(directory / f"train-{{000000..{shards - 1:06d}}}.tar")


def decode(sample: dict) -> tuple:
    features = torch.frombuffer(bytearray(sample["pt"]), dtype=torch.float32)
    return features, int(sample["cls"])


def main() -> None:
    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as tmp:
        pattern = write_shards(Path(tmp))
        stream = ShardStream(pattern, shuffle=True, seed=0)
        loader = DataLoader(stream, batch_size=32, num_workers=2,
                            collate_fn=lambda batch: [decode(s) for s in batch])
        for epoch in range(2):
            stream.set_epoch(epoch)
            batches = list(loader)
            n = sum(len(b) for b in batches)
            print(f"epoch {epoch}: {n} samples in {len(batches)} batches")


if __name__ == "__main__":
    main()
