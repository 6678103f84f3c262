#!/usr/bin/env python3
"""Write a few WebDataset shards, then read them the fast ways: tensor batches through
DataLoader workers, and a webdataset-style pipeline.

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

FEATURES = 16


def write_shards(directory: Path, shards: int = 4, per_shard: int = 64) -> str:
    for s in range(shards):
        with tarfile.open(directory / f"train-{s:06d}.tar", "w") as tar:
            for i in range(per_shard):
                key = f"{s:03d}{i:05d}"
                for ext, data in (("cls", str(i % 10).encode()),
                                  ("pt", torch.randn(FEATURES).numpy().tobytes())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(directory / f"train-{{000000..{shards - 1:06d}}}.tar")


def labels(cls_field) -> torch.Tensor:
    """Text labels of a batch ("0".."9"): parse the whole batch at once."""
    if isinstance(cls_field, torch.Tensor):  # [B, n]: every label has n digits
        digits = cls_field.long() - ord("0")
        weights = 10 ** torch.arange(digits.shape[1] - 1, -1, -1)
        return (digits * weights).sum(dim=1)
    return torch.tensor([int(bytes(x.numpy())) for x in cls_field.split()])  # Ragged


def features(pt) -> torch.Tensor:
    return torch.frombuffer(bytearray(pt), dtype=torch.float32)


def main() -> None:
    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as tmp:
        pattern = write_shards(Path(tmp))

        # 1. Tensor batches: payloads copied once from the read buffers into shared memory.
        stream = ShardStream(pattern, shuffle=True, seed=0)
        loader = DataLoader(stream.tensors(32), batch_size=None, num_workers=2)
        for epoch in range(2):
            stream.set_epoch(epoch)
            n = batches = 0
            for batch in loader:
                x = batch["pt"].view(torch.float32)  # [32, 16]: 64 bytes per sample
                y = labels(batch["cls"])
                assert x.shape == (len(y), FEATURES)
                n += len(y)
                batches += 1
            print(f"epoch {epoch}: {n} samples in {batches} batches")

        # 2. webdataset's pipeline methods, run in the workers, resumable.
        pipeline = (ShardStream(pattern, seed=0).shuffle(100).decode()
                    .map_dict(pt=features).to_tuple("pt", "cls").batched(32))
        x, y = next(iter(DataLoader(pipeline, batch_size=None, num_workers=2)))
        print(f"pipeline batch: features {tuple(x.shape)}, labels {tuple(y.shape)}")


if __name__ == "__main__":
    main()
