"""Who am I in the job: rank, world size, DataLoader worker. The only place that asks.

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

__all__ = ["World", "current_world", "job_rank"]

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


def job_rank() -> Tuple[int, int]:
    """(rank, world size) from torch.distributed, else the RANK/WORLD_SIZE variables."""
    return _rank_and_size()


def _rank_and_size() -> Tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        raise ValueError("RANK and WORLD_SIZE must be integers when set") from None


def current_world(job: Optional[Tuple[int, int]] = None) -> World:
    """Rank from torch.distributed (else RANK/WORLD_SIZE), worker from the DataLoader. In a
    DataLoader worker, ``job`` (the rank and world size the parent saw) wins when given."""
    rank, size = _rank_and_size()
    worker, workers = 0, 1
    try:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is not None:
            worker, workers = info.id, info.num_workers
            if job is not None:
                rank, size = job
    except ImportError:
        pass
    return World(rank=rank, world_size=size, worker=worker, num_workers=workers)
