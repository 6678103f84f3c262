"""An epoch's plan: which samples each rank and each DataLoader worker delivers, in which order.

Everything here is a pure function of the shard list, (seed, epoch), the number of ranks and,
for the shard plan only, the number of workers. No I/O, no timing.

Two plans:

- **Shard plan** (no index): the epoch's shard order is split by rank (every ``world_size``-th
  shard from ``rank``), then by worker, as webdataset does. Each worker reads its shards
  through its own shuffle buffer; a DataLoader interleaves the workers.
- **Sample plan** (every shard's samples known): the epoch's samples, in shard order, form one
  global sequence ``G``; rank ``r`` takes a contiguous slice of ``G`` (sizes equal to within
  one, or exactly equal under ``equal_ranks``). The slice is cut into ``K`` contiguous
  **lanes**, each through its own shuffle buffer seeded from (seed, epoch, rank, lane), and
  the rank's sequence takes ``batch_size`` positions from each lane in turn. Its positions are
  dealt to the ``W`` workers in turn, ``batch_size`` at a time (after a resume: the positions
  not delivered yet, again from worker 0). A DataLoader takes one item (or one batch) from
  each worker in turn, so it delivers the rank's sequence itself, whatever ``W``.

  Lanes are what keeps reads long: when ``W`` divides ``K``, worker ``w`` delivers exactly the
  lanes ``w, w + W, ...``, each a contiguous run of the shards, so it reads them front to back.
  (One lane and several workers: each worker would deliver every ``W``-th block of one
  sequence, and read that much scattered.)
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import AbstractSet, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .shuffle import Draws, buffer_order, rng_for

__all__ = ["DEFAULT_LANES", "EQUAL_RULES", "Lanes", "RankPlan", "dealt_positions", "lanes_for",
           "order_key", "position_array", "positions", "rank_plan", "rank_sequence", "read_order",
           "shard_order"]

#: ``equal_ranks`` rules: drop the remainder of the epoch, or repeat from its start.
EQUAL_RULES = ("drop", "repeat")

#: Lanes of a shuffled stream: any worker count dividing it (1, 2, 4, 8, 16) reads whole lanes.
DEFAULT_LANES = 16


def order_key(epoch: int, repeat: int = 0) -> object:
    """What seeds the order of an epoch, or of a pipeline's repetition ``repeat`` of it (each
    repetition is ordered anew; repetition 0 is the epoch itself)."""
    return epoch if not repeat else f"{epoch}+{repeat}"


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


def position_array(length: int, worker: int, workers: int, block: int, *, base: int = 0,
                   skip: AbstractSet[int] = frozenset(), start: int = 0) -> np.ndarray:
    """:func:`positions` as an int64 array; without ``skip``, computed by numpy (an epoch's
    positions are planned before its first read, so this is on the epoch's critical path)."""
    return dealt_positions(length, worker, workers, block, base=base, skip=skip, start=start)[0]


def dealt_positions(length: int, worker: int, workers: int, block: int, *, base: int = 0,
                    skip: AbstractSet[int] = frozenset(), start: int = 0
                    ) -> Tuple[np.ndarray, np.ndarray]:
    """(positions, blocks): :func:`positions` as an int64 array, and the number of the dealt
    block each belongs to (a pipeline's batch is the survivors of one block)."""
    if skip:
        todo = np.arange(base, length, dtype=np.int64)
        todo = todo[~np.isin(todo, np.fromiter(skip, dtype=np.int64, count=len(skip)))]
        blocks = np.arange(len(todo), dtype=np.int64) // block
        mine = (blocks % workers == worker) & (todo >= start)
        return todo[mine], blocks[mine]
    first = max(start - base, 0)
    count = max(length - base, 0)
    numbers = np.arange(worker, -(-count // block), workers, dtype=np.int64)
    out = (numbers[:, None] * block + np.arange(block, dtype=np.int64)).ravel()
    keep = (out >= first) & (out < count)
    return out[keep] + base, np.repeat(numbers, block)[keep]


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


@dataclasses.dataclass(frozen=True)
class Lanes:
    """A rank sequence of ``length`` positions drawn from ``count`` lanes, ``block`` at a time.

    Block ``j`` of positions (``block`` of them) comes from lane ``j % count``, as that lane's
    block ``j // count``; a lane is the run of inputs ``starts[lane]:starts[lane + 1]``. Lane
    lengths are whole blocks, equal to within one block, and the one partial block (if
    ``length`` is not a multiple of ``block``) is the sequence's last: so a worker's blocks stay
    whole blocks and the last batch is the only short one, whatever the number of workers.
    """

    count: int
    block: int
    starts: np.ndarray  # count + 1 input numbers: lane l is starts[l]:starts[l + 1]

    def lane_of(self, p: np.ndarray) -> np.ndarray:
        return (p // self.block) % self.count

    def step_of(self, p: np.ndarray) -> np.ndarray:
        """Position ``p``'s place in its lane."""
        return (p // (self.block * self.count)) * self.block + p % self.block

    def position_of(self, lane: np.ndarray, step: np.ndarray) -> np.ndarray:
        return ((step // self.block) * self.count + lane) * self.block + step % self.block


def lanes_for(length: int, count: int, block: int) -> Lanes:
    """Cut ``length`` inputs into ``count`` lanes for blocks of ``block`` (see :class:`Lanes`)."""
    blocks, tail = divmod(length, block)
    rounds, longer = divmod(blocks, count)
    sizes = [(rounds + (lane < longer)) * block + (tail if lane == longer else 0)
             for lane in range(count)]
    return Lanes(count, block, np.concatenate(([0], np.cumsum(sizes))).astype(np.int64))


def lane_buffer(buffer: int, lanes: int) -> int:
    """Each lane's share of a shuffle buffer of ``buffer`` samples (<= 1: no shuffling)."""
    return max(2, -(-buffer // lanes)) if buffer > 1 else 0


def rank_sequence(lanes: Lanes, buffer: int, *parts: object) -> np.ndarray:
    """The rank's sequence: element ``p`` is the input (number in the rank's slice) delivered
    at position ``p``. Each lane replays its own buffer (``lane_buffer``) over its input
    numbers, seeded from ``parts`` and the lane: pure computation, no I/O."""
    per = lane_buffer(buffer, lanes.count)
    by_lane = []
    for lane in range(lanes.count):
        first, end = int(lanes.starts[lane]), int(lanes.starts[lane + 1])
        if per > 1:
            seed = ("buffer", *parts) + (("lane", lane) if lanes.count > 1 else ())
            order = np.frombuffer(buffer_order(end - first, per, Draws(*seed)), dtype=np.int64)
            by_lane.append(order + first)
        else:
            by_lane.append(np.arange(first, end, dtype=np.int64))
    flat = np.concatenate(by_lane) if by_lane else np.zeros(0, dtype=np.int64)
    p = np.arange(int(lanes.starts[-1]), dtype=np.int64)
    return flat[lanes.starts[lanes.lane_of(p)] + lanes.step_of(p)]


def read_order(inputs: np.ndarray, lanes: Lanes, buffer: int, run: int) -> np.ndarray:
    """The order in which to read a worker's ``inputs`` (listed in delivery order): indices
    into ``inputs``.

    Inputs are read in runs of ``run`` consecutive inputs of a lane, in file order, and runs
    in the order of the earliest position that could need them: a lane's buffer of ``b`` can
    deliver input ``i`` of the lane at its step ``i - b`` at the earliest. So every input is
    read before it is delivered, the samples read ahead of delivery stay within about a buffer
    plus a run per lane, and a worker that owns whole lanes reads each of them front to back."""
    per = lane_buffer(buffer, lanes.count)
    lane = np.searchsorted(lanes.starts, inputs, side="right") - 1
    within = inputs - lanes.starts[lane]
    need = np.maximum((within // run) * run - per, 0)
    return np.lexsort((inputs, lanes.position_of(lane, need)))
