"""Crash safety: a full disk and SIGKILL at random moments never lose the previous checkpoint."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ckpt_child import state_for
from ckptgen import assert_same
from conftest import child_env

from flashstream import CheckpointWriter, list_checkpoints, load_checkpoint

CHILD = Path(__file__).with_name("ckpt_child.py")
KILL_ROUNDS = int(os.environ.get("FLASHSTREAM_KILL_ROUNDS", "12"))


def temporaries(directory: Path):
    return [p for p in directory.rglob("*") if p.name.endswith(".tmp")]


def test_disk_full_raises_and_keeps_the_previous_checkpoint(small_fs):
    directory = small_fs("24m")
    small = {"w": torch.randn(2 << 20)}  # 8 MiB
    large = {"w": torch.randn(5 << 20)}  # 20 MiB: does not fit beside the first
    with CheckpointWriter(directory, keep=3) as writer:
        writer.save(small, step=1).result()
        with pytest.raises(OSError) as info:
            writer.save(large, step=2).result()
        assert info.value.errno == errno.ENOSPC and ".tmp" in str(info.value.filename)
        assert temporaries(directory) == []
        assert_same(small, load_checkpoint(directory))
        # An error nobody collected surfaces at the next save instead of vanishing.
        writer.save(large, step=3)
        with pytest.raises(RuntimeError, match="step 3 failed") as info:
            writer.save(small, step=4)
        assert isinstance(info.value.__cause__, OSError)
    assert [c.step for c in list_checkpoints(directory) if c.complete] == [1]
    assert_same(small, load_checkpoint(directory))


def test_sigkill_at_random_moments_never_loses_a_checkpoint(tmp_path):
    rng = random.Random(1234)
    directory = tmp_path / "ckpt"
    next_step, committed = 1, 0
    loads = 0
    for round_ in range(KILL_ROUNDS):
        keep, mode = 1 + round_ % 2, ("copy", "cow")[round_ // 2 % 2]
        child = subprocess.Popen([sys.executable, str(CHILD), str(directory), str(next_step),
                                  str(keep), mode], stdout=subprocess.PIPE, text=True,
                                 env=child_env())
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.6))
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate()
        reported = [int(line.split()[1]) for line in out.splitlines() if line.startswith("commit")]
        committed = max([committed] + reported)
        try:
            state = load_checkpoint(directory)
        except FileNotFoundError:
            assert committed == 0, "a committed checkpoint was lost"
            continue
        loads += 1
        step = state["step"]
        assert step >= committed  # never older than one the child saw complete
        assert_same(state_for(step), state, f"step {step}")
        next_step = max(next_step, step + 1) + 10  # steps only grow, as in training
    assert loads > 0
