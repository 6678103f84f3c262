#!/usr/bin/env python3
"""Train a small model, checkpoint it in the background every few steps, then resume.

    python examples/checkpoint.py [DIR]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from flashstream import CheckpointWriter, load_checkpoint


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(model, optimizer, steps: range, writer: CheckpointWriter = None, every: int = 10):
    for step in steps:
        x = torch.randn(32, 256, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if writer is not None and step % every == 0:
            # Returns once the tensors are snapshotted; the write goes on in the background.
            writer.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "step": step}, step=step)
    return loss.item()


def main(directory: Path) -> None:
    model, optimizer = make()
    with CheckpointWriter(directory / "ckpt", rate="auto", keep=2) as writer:
        train(model, optimizer, range(1, 31), writer)
        report = writer.wait()
    print(report.format_table())

    state = load_checkpoint(directory / "ckpt")  # the newest complete checkpoint
    resumed, resumed_optimizer = make()
    resumed.load_state_dict(state["model"])
    resumed_optimizer.load_state_dict(state["optimizer"])
    print(f"resumed at step {state['step']}")
    final = train(resumed, resumed_optimizer, range(state["step"] + 1, 41))
    reference = train(model, optimizer, range(31, 41))
    print(f"loss after step 40: resumed {final:.6f}, uninterrupted {reference:.6f}")
    assert final == reference, "resuming from the checkpoint changed the result"


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory(dir=".") as tmp:
            main(Path(tmp))
