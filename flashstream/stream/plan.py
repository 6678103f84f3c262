"""An epoch's plan: which samples each rank and each DataLoader worker delivers, in which order.

Everything here is a pure function of the shard list, (seed, epoch), the number of ranks and,
for the shard plan only, the number of workers. No I/O, no timing.

Two plans:

- **Shard plan** (no index): the epoch's shard order is split by rank (every ``world_size``-th
  shard from ``rank``), then by worker, as webdataset does. Each worker reads its shards
  through its own shuffle buffer; a DataLoader interleaves the workers.
- **Sample plan** (every shard's samples known): the epoch's samples, in shard order, form one
  global sequence ``G``; rank ``r`` takes a contiguous slice of ``G`` (sizes equal to within
  one, or exactly equal under ``equal_ranks``), passes it through one shuffle buffer seeded
  from (seed, epoch, rank), and its positions are dealt to the ``W`` workers in turn,
  ``batch_size`` at a time (after a resume: the positions not delivered yet, again from worker
  0). A DataLoader takes one item (or one batch) from each worker in turn, so it delivers the
  rank's sequence itself, whatever ``W``.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import AbstractSet, Iterator, List, Optional, Sequence, Tuple

from .shuffle import rng_for

__all__ = ["EQUAL_RULES", "RankPlan", "positions", "rank_plan", "shard_order"]

#: ``equal_ranks`` rules: drop the remainder of the epoch, or repeat from its start.
EQUAL_RULES = ("drop", "repeat")


def shard_order(n_shards: int, *, shuffle: bool, seed: int, epoch: int) -> List[int]:
    """Shard indices in this epoch's order (reshuffled every epoch from (seed, epoch))."""
    order = list(range(n_shards))
    if shuffle:
        rng_for("shards", seed, epoch).shuffle(order)
    return order


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """A rank's input sequence: ``units[i] = (shard, first, end)`` sample ranges in order;
    input number ``q`` is sample ``first + (q - starts[i])`` of unit ``i``'s shard."""

    units: Tuple[Tuple[int, int, int], ...]
    starts: Tuple[int, ...]
    length: int

    def ref(self, q: int) -> Tuple[int, int]:
        """(shard, sample number in that shard) of input ``q``."""
        i = bisect.bisect_right(self.starts, q) - 1
        shard, first, _end = self.units[i]
        return shard, first + (q - self.starts[i])


def _slice(total: int, world_size: int, rank: int, equal: Optional[str]) -> Tuple[int, int]:
    """(start, length) of the rank's share of ``total`` global samples; may wrap ("repeat")."""
    if equal == "drop":
        share = total // world_size
        return rank * share, share
    if equal == "repeat":
        share = -(-total // world_size)
        return (rank * share) % total if total else 0, share
    base, extra = divmod(total, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def rank_plan(counts: Sequence[int], order: Sequence[int], *, world_size: int, rank: int,
              equal: Optional[str]) -> RankPlan:
    """The rank's slice of the global sequence (shards in ``order``, samples in file order)."""
    total = sum(counts)
    start, length = _slice(total, world_size, rank, equal)
    if equal == "drop" and total and length == 0:
        raise ValueError(f"equal_ranks='drop': {total} samples cannot give each of "
                         f"{world_size} ranks one; use equal_ranks='repeat' or fewer ranks")
    # length <= total, so the share wraps past the end of G at most once ("repeat").
    spans = [(start, min(start + length, total))]
    if start + length > total:
        spans.append((0, start + length - total))
    units: List[Tuple[int, int, int]] = []
    starts: List[int] = []
    taken = 0
    for lo, hi in spans:
        cursor = 0
        for shard in order:
            a, b = max(lo, cursor), min(hi, cursor + counts[shard])
            if a < b:
                units.append((shard, a - cursor, b - cursor))
                starts.append(taken)
                taken += b - a
            cursor += counts[shard]
    return RankPlan(tuple(units), tuple(starts), length)


def positions(length: int, worker: int, workers: int, block: int, *, base: int = 0,
              skip: AbstractSet[int] = frozenset(), start: int = 0) -> Iterator[int]:
    """The worker's positions ``>= start`` of a rank sequence of ``length``, in order.

    The positions still to deliver, those ``>= base`` and not in ``skip`` (delivered before a
    resume), are dealt to the workers in turn, ``block`` at a time, starting with worker 0:
    a fresh DataLoader, which also starts its round-robin at worker 0, delivers them in order.
    """
    if not skip:
        first = max(start - base, 0)  # j: rank among the positions to deliver
        b = first // block
        b += (worker - b) % workers  # the first block of ours at or after `first`
        for j in range(b * block, length - base, workers * block):
            yield from range(base + max(j, first), base + min(j + block, length - base))
        return
    j = 0
    for p in range(base, length):
        if p in skip:
            continue
        if p >= start and (j // block) % workers == worker:
            yield p
        j += 1
