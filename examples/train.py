#!/usr/bin/env python3
"""Train on WebDataset shards, checkpoint model + optimizer + data position together, resume.

    python examples/train.py                      # makes shards in a temp dir, trains 2 epochs
    python examples/train.py --workdir run --stop-after 7   # "crash" after step 7's checkpoint
    python examples/train.py --workdir run --resume         # continue exactly, then check it

The data position is torchdata's StatefulDataLoader state, which holds each worker's
ShardStream state (epoch, shard and byte offset of the next sample, shuffle buffer by
reference): plain values that the checkpoint stores next to the tensors. A resumed run sees
exactly the batches the uninterrupted run would have seen, so it ends with the same weights.
"""

from __future__ import annotations

import argparse
import io
import tarfile
import tempfile
from pathlib import Path

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from flashstream import CheckpointWriter, ShardStream, load_checkpoint

FEATURES, CLASSES = 16, 4


def write_shards(directory: Path, counts=(40, 25, 60, 10, 45)) -> str:
    """Shards of uneven size: samples {"pt": 16 float32, "cls": label}."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for s, count in enumerate(counts):
        with tarfile.open(directory / f"train-{s:06d}.tar", "w") as tar:
            for i in range(count):
                label = int(torch.randint(CLASSES, (1,), generator=g))
                x = torch.randn(FEATURES, generator=g) + label  # learnable
                for ext, data in (("pt", x.numpy().tobytes()), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"{s:03d}{i:05d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(directory / f"train-{{000000..{len(counts) - 1:06d}}}.tar")


def collate(samples):
    x = torch.stack([torch.frombuffer(bytearray(s["pt"]), dtype=torch.float32)
                     for s in samples])
    y = torch.tensor([int(s["cls"]) for s in samples])
    return x, y


def make(shards: str, workers: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stream = ShardStream(shards, shuffle=50, seed=0)
    loader = StatefulDataLoader(stream, batch_size=8, num_workers=workers, collate_fn=collate)
    return model, optimizer, stream, loader


def train(args, shards: str, writer=None, resume: bool = False):
    """Train ``args.epochs`` epochs; checkpoint every ``args.every`` steps when ``writer``."""
    model, optimizer, stream, loader = make(shards, args.workers)
    first_epoch = step = 0
    if resume:
        state = load_checkpoint(args.workdir / "ckpt")  # the newest complete checkpoint
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])  # each worker's ShardStream state inside
        first_epoch, step = state["epoch"], state["step"]
        print(f"resumed at epoch {first_epoch} step {step}")
    for epoch in range(first_epoch, args.epochs):
        stream.set_epoch(epoch)  # a loaded position for this epoch stays pending
        loss = None  # stays None for an epoch resumed after its last step
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if writer is not None and (step % args.every == 0 or step == args.stop_after):
                # One checkpoint: the tensors, and where the data stream stands.
                writer.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                             "loader": loader.state_dict(), "epoch": epoch, "step": step},
                            step=step)
            if step == args.stop_after:
                writer.wait()
                print(f"stopped after step {step} (loss {loss.item():.4f})")
                return model
        if loss is not None:
            print(f"epoch {epoch} done at step {step}, loss {loss.item():.4f}")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", help="shards with 'pt' (16 float32) and 'cls' members; "
                                       "default: generate them in the work directory")
    parser.add_argument("--workdir", type=Path, help="checkpoints (and generated data) here")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--stop-after", type=int, default=-1,
                        help="exit right after the checkpoint of this step (a simulated crash)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint, then compare the result "
                             "with an uninterrupted run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args.workdir = args.workdir or Path(tmp)
        shards = args.data or write_shards(args.workdir / "data")
        if not args.resume:
            with CheckpointWriter(args.workdir / "ckpt", keep=2) as writer:
                train(args, shards, writer)
            return
        args.stop_after = -1
        resumed = train(args, shards, resume=True)
        reference = train(args, shards)
        same = all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(),
                                                     reference.state_dict().values()))
        print("final weights: " + ("resumed run matches the uninterrupted run" if same
                                   else "MISMATCH with the uninterrupted run"))
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
