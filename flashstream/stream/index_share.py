"""Scanning shards once per job, not once per rank: each rank scans its share of the shards
that lack a sidecar and a cache entry, and the ranks exchange the indexes through
torch.distributed's collectives on the job's own process group (gloo or NCCL), so every rank
ends with the same full index, as if it had scanned everything itself.

Collectives need every rank to take part: each rank must build the stream over the same shards
(as distributed training scripts do). ``FLASHSTREAM_INDEX_SHARE=0`` turns sharing off (each
rank then scans what it lacks itself), e.g. for a stream built on one rank only. Ranks whose
lists of shards to scan differ (their caches differ) find out in the first exchange and each
scan their own.
"""

from __future__ import annotations

import hashlib
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..world import process_group

__all__ = ["SHARE_ENV", "share_scan"]

#: "0" (or "off") keeps every rank scanning for itself.
SHARE_ENV = "FLASHSTREAM_INDEX_SHARE"

# scan(positions) -> (ShardIndex by position, error text by position, what it raised or None);
# all of it travels through all_gather_object (pickled)
Scan = Callable[[List[int]], Tuple[Dict[int, object], Dict[int, str], Optional[BaseException]]]


def _group_size() -> Optional[Tuple[int, int]]:
    if os.environ.get(SHARE_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return None
    group = process_group()
    return group if group is not None and group[1] >= 2 else None


def share_scan(urls: Sequence[str], missing: List[int], scan: Scan
               ) -> Optional[Tuple[Dict[int, object], Dict[int, str], List[int]]]:
    """Scan ``missing`` (positions into ``urls``) across the ranks. ``scan(positions)``
    scans some of them (see ``Scan``; it must not raise: a rank that left the exchange would
    hang the others). Returns every position's index, the errors, and the positions this
    rank scanned; raises on every rank what any rank's scan raised; None when there is no
    process group to share with (the caller scans everything itself)."""
    where = _group_size()
    if where is None:
        return None
    import torch.distributed as dist

    rank, world = where
    fingerprint = hashlib.sha256("\0".join(
        [*urls, "|", *map(str, missing)]).encode("utf-8", "surrogateescape")).hexdigest()
    prints: List[Optional[str]] = [None] * world
    dist.all_gather_object(prints, fingerprint)
    if len(set(prints)) != 1:
        return None  # different shards or caches per rank: nothing to share safely
    mine = missing[rank::world]
    gathered: List[Optional[tuple]] = [None] * world
    dist.all_gather_object(gathered, scan(mine))
    every: Dict[int, object] = {}
    failed: Dict[int, str] = {}
    for indexes, errors, raised in gathered:  # type: ignore[misc]
        if raised is not None:
            raise raised
        every.update(indexes)
        failed.update(errors)
    return every, failed, mine
