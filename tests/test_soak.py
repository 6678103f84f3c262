"""Soak at small size: many epochs through persistent DataLoader workers leak nothing.

Ten epochs through two persistent workers, on both delivery paths (sample dicts, and tensor
batches in shared-memory slabs): the resident memory and open file descriptors of the main
process and of each worker stay flat once warm, and nothing of ours is left in /dev/shm once
the loader and the stream are gone.
"""

from __future__ import annotations

import gc
import os
import time

import psutil
import pytest
from shardgen import write_shards
from torch.utils.data import DataLoader

from flashstream import ShardStream

EPOCHS = 10
WARM = 3  # epochs before the baseline: allocators, caches and lazy imports settle first
# The last epochs' counts are compared by their least: a descriptor open for an instant (a
# DataLoader queue's pipe as an epoch winds down) once showed as 45 -> 46 in CI and never again
# in isolation, while a leak of even one descriptor per epoch grows every one of them.
LAST = 3
RSS_SLACK = 24 << 20  # per process, over 7 epochs
SHM = "/dev/shm"


def ours_in_shm() -> set:
    if not os.path.isdir(SHM):
        return set()
    return {name for name in os.listdir(SHM) if name.startswith("flashstream")}


def usage(processes):
    """(rss, fds) per process, main first."""
    return [(p.memory_info().rss, p.num_fds()) for p in processes]


@pytest.mark.parametrize("path", ["samples", "tensors"])
def test_ten_epochs_with_persistent_workers_leak_nothing(tmp_path, path):
    urls = [str(p) for p in write_shards(tmp_path / "d", 4, 60, sizes=[3000, 20000])]
    before_shm = ours_in_shm()
    stream = ShardStream(urls)
    if path == "tensors":
        stream = stream.tensors(16)
        loader = DataLoader(stream, batch_size=None, num_workers=2, persistent_workers=True)
    else:
        loader = DataLoader(stream, batch_size=None, num_workers=2, persistent_workers=True,
                            collate_fn=lambda sample: sample["__key__"])
    main = psutil.Process()
    others = {p.pid for p in main.children()}  # e.g. helpers earlier tests left running
    counts, baseline, history = [], None, []
    for epoch in range(EPOCHS):
        counts.append(sum(1 for _ in loader))
        gc.collect()
        workers = [p for p in main.children() if p.is_running() and p.pid not in others]
        assert len(workers) == 2, "persistent workers were restarted"
        now = usage([main, *workers])
        if epoch == WARM - 1:
            baseline = now
        history.append(now)
    expected = 240 if path == "samples" else 240 // 16
    assert counts == [expected] * EPOCHS
    names = ["main", "worker 1", "worker 2"]
    for i, (name, (rss0, fds0)) in enumerate(zip(names, baseline)):
        fds = [epoch[i][1] for epoch in history[-LAST:]]
        rss1 = history[-1][i][0]
        assert min(fds) <= fds0, f"{name}: open descriptors grew from {fds0} to {fds} " \
                                 f"over the last {LAST} epochs"
        assert rss1 - rss0 <= RSS_SLACK, f"{name}: resident memory grew by " \
                                         f"{(rss1 - rss0) >> 20} MiB"

    worker_pids = [p.pid for p in main.children() if p.pid not in others]
    del loader, stream
    gc.collect()
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
              for pid in worker_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ours_in_shm() - before_shm == set()
