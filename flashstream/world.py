"""Who am I in the job: rank, world size, DataLoader worker. The only place that asks.

Every rank, worker and process question of the package comes here: the stream's shard split,
the checkpoint's rank files, the index scans shared across ranks and the batches that cross
from DataLoader workers. Nothing else calls ``get_worker_info()`` or ``torch.distributed``'s
rank getters.

Shards are split by rank first, then by DataLoader worker (as webdataset's split_by_node and
split_by_worker do), so every shard is read by exactly one worker of one rank per epoch.

DataLoader worker processes do not see the parent's torch.distributed process group (it is not
initialized there), so a stream remembers the job's rank as its main process saw it and
passes it in as ``job``; without one, workers fall back to RANK/WORLD_SIZE.
"""

from __future__ import annotations

import dataclasses
import os
from typing import List, Optional, Sequence, Tuple, TypeVar

__all__ = ["Worker", "World", "current_world", "dataloader_worker", "in_worker", "job_rank",
           "process_group"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if not 0 <= self.worker < self.num_workers:
            raise ValueError(f"worker must be in [0, {self.num_workers}), got {self.worker}")

    def split(self, items: Sequence[T], *, by_rank: bool = True, by_worker: bool = True) -> List[T]:
        """This process's share: every ``world_size``-th item from ``rank``, then every
        ``num_workers``-th of those from ``worker``."""
        mine = list(items)
        if by_rank:
            mine = mine[self.rank::self.world_size]
        if by_worker:
            mine = mine[self.worker::self.num_workers]
        return mine


@dataclasses.dataclass(frozen=True)
class Worker:
    """This DataLoader worker: its id, how many the loader runs and its base seed."""

    id: int
    num_workers: int
    seed: int


def dataloader_worker() -> Optional[Worker]:
    """This DataLoader worker, or None in the main process (or without torch)."""
    try:
        from torch.utils.data import get_worker_info
    except ImportError:
        return None
    info = get_worker_info()
    return None if info is None else Worker(info.id, info.num_workers, info.seed)


def in_worker() -> bool:
    """True inside a DataLoader worker process."""
    return dataloader_worker() is not None


def process_group() -> Optional[Tuple[int, int]]:
    """(rank, world size) of the initialized torch.distributed process group, else None (no
    group, or no torch.distributed): the ranks that can exchange data."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def job_rank() -> Tuple[int, int]:
    """(rank, world size) from torch.distributed, else the RANK/WORLD_SIZE variables."""
    return _rank_and_size()


def _rank_and_size() -> Tuple[int, int]:
    group = process_group()
    if group is not None:
        return group
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        raise ValueError("RANK and WORLD_SIZE must be integers when set") from None


def current_world(job: Optional[Tuple[int, int]] = None) -> World:
    """Rank from torch.distributed (else RANK/WORLD_SIZE), worker from the DataLoader. In a
    DataLoader worker, ``job`` (the rank and world size the parent saw) wins when given."""
    rank, size = _rank_and_size()
    worker, workers = 0, 1
    info = dataloader_worker()
    if info is not None:
        worker, workers = info.id, info.num_workers
        if job is not None:
            rank, size = job
    return World(rank=rank, world_size=size, worker=worker, num_workers=workers)
