"""A training loop that checkpoints as fast as it can, for the kill tests.

usage: ckpt_child.py DIRECTORY FIRST_STEP KEEP SNAPSHOT
Prints "ready" once imported, then "committed N" after each checkpoint N is known complete.
"""

from __future__ import annotations

import sys

import torch

from flashstream import CheckpointWriter


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"weights": torch.randn(3 << 20, generator=g), "bias": torch.full((1000,), step),
            "step": step, "meta": {"name": f"step {step}", "lr": [0.1 * step]}}


def main() -> None:
    directory, step, keep, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    writer = CheckpointWriter(directory, keep=keep, snapshot=mode)
    print("ready", flush=True)
    while True:
        state = state_for(step)
        handle = writer.save(state, step=step)
        state["weights"].mul_(-1)  # training goes on; the checkpoint must not see this
        if step % 2:  # alternate: wait for the commit, or go on training while it writes
            handle.result()
            print(f"committed {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
