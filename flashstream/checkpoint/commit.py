"""The commit of one rank's checkpoint file, and of the step once every rank's is there.

The order is the crash-safety rule (store.py has the directory protocol): the data file is
complete and synced under its temporary name, renamed to its final name, the directory
synced, and only then the rank's marker written (atomically); rank 0 points ``latest`` at a
step only once every rank's marker is there, and prunes after that. A crash anywhere leaves
either the previous checkpoint or the whole new one.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

from .. import engine
from .store import StepDir, atomic_write_text, fsync_dir, inspect_step, prune, write_latest

__all__ = ["commit_rank_file", "finish_step"]

POLL_S = 0.05  # how often rank 0 looks for the other ranks' markers


def commit_rank_file(step_dir: StepDir, tmp: Path, *, rank: int, world_size: int,
                     file_size: int, header: bytes) -> Path:
    """Renames the synced ``tmp`` to the rank's file and writes its marker; its final path."""
    final = step_dir.rank_file(rank, world_size)
    os.replace(tmp, final)
    fsync_dir(step_dir.path)
    marker = {"file": final.name, "size": file_size, "step": step_dir.step,
              "rank": rank, "world_size": world_size,
              "header_crc32c": f"{engine.crc32c(header):08x}", "time": time.time()}
    atomic_write_text(step_dir.marker(rank, world_size), json.dumps(marker))
    return final


def finish_step(directory: Path, step_dir: StepDir, *, world_size: int, timeout: float,
                keep: Optional[int], gradual: bool, recycle: bool) -> Optional[float]:
    """Rank 0: once every rank's marker is there, point ``latest`` at the step and prune.
    Returns the seconds pruning took (None: nothing was pruned). Raises TimeoutError naming
    the ranks that did not commit within ``timeout`` seconds (the step stays incomplete)."""
    deadline = time.monotonic() + timeout
    while True:
        info = inspect_step(step_dir.path)
        if info is not None and info.complete:
            break
        if time.monotonic() > deadline:
            missing = info.missing_ranks if info else list(range(world_size))
            raise TimeoutError(f"checkpoint step {step_dir.step}: ranks {missing} did not "
                               f"commit within {timeout} s; the step stays incomplete")
        time.sleep(POLL_S)
    write_latest(directory, info)
    started = time.perf_counter()
    if prune(directory, keep, gradual=gradual, newest=step_dir.step, recycle=recycle):
        return time.perf_counter() - started
    return None
