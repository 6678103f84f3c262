"""One worker's pass over an epoch, for each plan, with its exact position as plain values.

A pass holds one worker's position in its epoch: ``generate()`` yields its samples and
``state()`` describes the position after the last one yielded. Resuming from that state
delivers exactly the samples that follow, and reads only what it has not delivered: the rest
of the input from the saved byte offset, and the samples that sat in the shuffle buffer, by
reference.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..settings import IOSettings
from .decompress import is_compressed
from .handlers import Handler
from .index import ShardIndex
from .plan import (
    RankPlan,
    dealt_positions,
    lanes_for,
    order_key,
    rank_sequence,
    read_order,
)
from .samples import Piece, ReadStats, Records, plan_read_arrays, plan_reads
from .shuffle import Draws, ShuffleBuffer
from .state import Delivered
from .urls import local_path

__all__ = ["PassContext", "SamplePass", "ShardPass", "WorkerReads", "plan_worker_reads"]

_MISSING = object()

#: Reading by index, a worker reads each lane in runs of about this many bytes (or one read
#: request, if larger): long enough for large reads, short enough that the samples read ahead
#: of delivery stay a few MiB per lane.
RUN_BYTES = 2 << 20

Ref = Tuple[int, int, int]  # shard, offset of the sample's first header, offset past its end


@dataclasses.dataclass(frozen=True)
class PassContext:
    """What every pass of one stream, epoch and worker shares."""

    urls: Sequence[str]
    settings: IOSettings
    handler: Handler
    stats: ReadStats
    on_end: Callable[[ReadStats], None]
    buffer: int  # shuffle buffer size; <= 1: no buffer
    seed: int
    epoch: int
    rank: int
    worker: int
    workers: int
    lanes: int = 1  # sample plan: lanes of the rank's sequence
    block: int = 1  # sample plan: positions dealt to a worker at a time
    repeat: int = 0  # a pipeline's repetition of the epoch (with_epoch / repeat)

    @property
    def order(self) -> object:
        """What seeds this pass's shard order and buffers: the epoch, and for a pipeline's
        later repetitions of it, the repetition too (each repetition is ordered anew)."""
        return order_key(self.epoch, self.repeat)

    def records(self, pieces: List[Piece]) -> Iterator:
        return iter(Records(pieces, self.settings, self.handler, self.stats, self.on_end))


class _Work:
    """One worker's pass: its position, and ``generate()``, the generator of its samples that
    ShardStream.__iter__ returns. The generator's frame references the work, never the other
    way round: no reference cycle, so a dropped pass closes its reader at once."""

    ctx: PassContext

    @property
    def epoch(self) -> int:
        return self.ctx.epoch

    def generate(self) -> Iterator[Dict]:
        raise NotImplementedError

    def state(self) -> Dict[str, object]:
        """The worker entry of the resume state, after the last sample delivered."""
        raise NotImplementedError


class ShardPass(_Work):
    """Shard plan: the worker's shards in order, through its own shuffle buffer.

    ``shards`` is any sequence of shard numbers; an endless one (resampled shards) is read
    ``window`` shards per reader, a finite one all at once."""

    def __init__(self, ctx: PassContext, shards: Sequence[int], entry: Optional[Dict], *,
                 window: Optional[int] = None) -> None:
        self.ctx = ctx
        self.shards = shards
        self.window = window
        entry = entry or {}
        self.position = int(entry.get("position", 0))  # next shard of `shards` to read
        self.offset = int(entry.get("offset", 0))  # where its next sample's headers start
        if entry and entry.get("shard") != self._shard_at(self.position):
            raise ValueError(f"the state's worker {ctx.worker} was reading shard "
                             f"{entry.get('shard')} but this epoch's plan puts shard "
                             f"{self._shard_at(self.position)} there: the plan changed")
        refs = list(entry.get("buffer", []))
        self._restore: List[Ref] = [tuple(refs[i:i + 3]) for i in range(0, len(refs), 3)]
        self.buffer: Optional[ShuffleBuffer] = None
        if ctx.buffer > 1:
            draws = Draws("buffer", ctx.seed, ctx.order, ctx.rank, ctx.worker, ctx.workers,
                          skip=int(entry.get("draws", 0)))
            self.buffer = ShuffleBuffer(ctx.buffer, draws)

    def _shard_at(self, position: int) -> int:
        return self.shards[position] if position < len(self.shards) else -1

    def state(self) -> Dict[str, object]:
        refs: List[int] = []
        held = self._restore if self._restore else (
            [item[:3] for item in self.buffer.items] if self.buffer is not None else [])
        for ref in held:
            refs.extend(ref)
        return {"position": self.position, "shard": self._shard_at(self.position),
                "offset": self.offset, "buffer": refs,
                "draws": self.buffer.draws.count if self.buffer is not None else 0,
                "finished": self.position >= len(self.shards) and not refs}

    def _pieces(self, stop: int) -> Tuple[List[Piece], List[int], int]:
        urls = self.ctx.urls
        compressed: Dict[int, bool] = {}

        def packed(shard: int) -> bool:
            if shard not in compressed:
                compressed[shard] = is_compressed(local_path(urls[shard]))
            return compressed[shard]

        pieces, owners = plan_reads(sorted(self._restore), urls, packed)
        restoring = len(pieces)
        for i in range(self.position, stop):
            shard = self.shards[i]
            start = self.offset if i == self.position else 0
            if start and packed(shard):  # no seeking into a compressed stream
                pieces.append(Piece(urls[shard], 0, skip_below=start))
            else:
                pieces.append(Piece(urls[shard], start))
            owners.append(shard)
        return pieces, owners, restoring

    def _install(self, restored: Dict[Tuple[int, int], Optional[Dict]]) -> None:
        """Put the buffered samples back, in their saved order (lost ones are dropped)."""
        if self.buffer is not None:
            self.buffer.items = [(s, o, e, restored[(s, o)]) for s, o, e in self._restore
                                 if restored.get((s, o)) is not None]
        self._restore = []

    def generate(self) -> Iterator[Dict]:
        push = self.buffer.push if self.buffer is not None else None
        count = len(self.shards)
        try:
            yield from self._windows(push, count)
        finally:
            if self.window is not None:
                self.ctx.on_end(self.ctx.stats)
        while self.buffer is not None and len(self.buffer):
            yield self.buffer.drain()[3]

    def _windows(self, push, count: int) -> Iterator[Dict]:
        while True:
            stop = count if self.window is None else min(count, self.position + self.window)
            pieces, owners, restoring = self._pieces(stop)
            first = self.position
            restored: Dict[Tuple[int, int], Optional[Dict]] = {}
            # One reader per window; the figures add up in the pass's stats, reported once.
            on_end = self.ctx.on_end if self.window is None else None
            records = iter(Records(pieces, self.ctx.settings, self.ctx.handler,
                                   self.ctx.stats, on_end))
            try:
                for piece, offset, end, sample in records:
                    if piece < restoring:
                        restored[(owners[piece], offset)] = sample
                        continue
                    if self._restore:
                        self._install(restored)
                    self.position = first + piece - restoring
                    self.offset = end
                    if push is None:
                        yield sample
                        continue
                    left = push((owners[piece], offset, end, sample))
                    if left is not None:
                        yield left[3]
            finally:
                records.close()
            if self._restore:
                self._install(restored)
            self.position, self.offset = stop, 0
            if stop >= count:
                break


@dataclasses.dataclass(frozen=True)
class WorkerReads:
    """What one worker reads of a sample-plan epoch, planned before its first read: for each of
    its positions (in delivery order) the repetition of the epoch it falls in and the sample's
    ``(shard, offset, end)``; and the pieces to read them by, in read order (``read[i]``: the
    index of the position the i-th sample read is for; ``owners[k]``: piece ``k``'s shard;
    ``groups[k]``: its repetition)."""

    repeats: np.ndarray
    shards: np.ndarray
    offsets: np.ndarray
    ends: np.ndarray
    read: np.ndarray
    pieces: List[Piece]
    owners: List[int]
    groups: List[int]


def plan_worker_reads(ctx: PassContext, index: Sequence[ShardIndex],
                      plans: Callable[[int], RankPlan], mine: np.ndarray) -> WorkerReads:
    """The reads of positions ``mine`` (ascending) of the rank's sequence, which continues into
    repetitions of the epoch past its length (``plans(r)``: repetition r's plan)."""
    period = plans(0).length
    repeats = mine // period if period else np.zeros_like(mine)
    parts: List[Tuple[np.ndarray, ...]] = []
    pieces: List[Piece] = []
    owners: List[int] = []
    groups: List[int] = []
    for r in np.unique(repeats).tolist():
        at = np.flatnonzero(repeats == r)
        plan = plans(r)
        sub = dataclasses.replace(ctx, repeat=r)
        lanes = lanes_for(plan.length, ctx.lanes, ctx.block)
        # The rank's lanes and buffers, replayed over input numbers (no I/O).
        inputs = rank_sequence(lanes, ctx.buffer, ctx.seed, sub.order, ctx.rank)[
            mine[at] - r * period]
        shards, offsets, ends = (np.empty_like(inputs) for _ in range(3))
        ascending = np.argsort(inputs, kind="stable")
        shards[ascending], offsets[ascending], ends[ascending] = _refs(index, plan,
                                                                       inputs[ascending])
        # Read lane by lane in runs (see read_order); deliver in position order.
        average = max(1, int((ends - offsets).sum()) // max(1, len(inputs)))
        run = max(1, max(RUN_BYTES, ctx.settings.chunk_size) // average)
        read = read_order(inputs, lanes, ctx.buffer, run)
        got, shard_of = plan_read_arrays(
            shards[read], offsets[read], ends[read], ctx.urls,
            lambda s: index[s].compression is not None)
        pieces += got
        owners += shard_of
        groups += [r] * len(got)
        parts.append((shards, offsets, ends, at[read]))
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return WorkerReads(repeats, empty, empty, empty, empty, [], [], [])
    shards, offsets, ends, read = (np.concatenate(column) for column in zip(*parts))
    return WorkerReads(repeats, shards, offsets, ends, read, pieces, owners, groups)


def _refs(index: Sequence[ShardIndex], plan: RankPlan, inputs: np.ndarray
          ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shard, offset, end) arrays of the ascending input numbers ``inputs``: one numpy gather
    per unit of the plan rather than a lookup per sample."""
    bounds = np.asarray(plan.starts[1:] + (plan.length,), dtype=np.int64)
    cuts = np.searchsorted(inputs, bounds, side="left")
    shards, offsets, ends = [], [], []
    lo = 0
    for (shard, first, _end), start, hi in zip(plan.units, plan.starts, cuts.tolist()):
        if hi > lo:
            k = inputs[lo:hi] - start + first
            shards.append(np.full(hi - lo, shard, dtype=np.int64))
            offsets.append(index[shard].offsets[k])
            ends.append(index[shard].ends[k])
        lo = hi
    if not shards:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    return np.concatenate(shards), np.concatenate(offsets), np.concatenate(ends)


class SamplePass(_Work):
    """Sample plan: this worker's positions of the rank's sequence, read in file order.

    ``plans(r)`` is the rank's plan for repetition ``r`` of the epoch (0: the epoch itself).
    ``length`` (default: one epoch) cuts the sequence short, or continues it into repetitions
    of the epoch, each ordered anew (a pipeline's ``with_epoch`` and ``repeat``)."""

    def __init__(self, ctx: PassContext, index: Sequence[ShardIndex],
                 plans: Callable[[int], RankPlan], block: int, done: Delivered, cursor: int,
                 *, length: Optional[int] = None) -> None:
        self.ctx = ctx
        self.index = index
        self.plans = plans
        self.block = block
        self.done = done
        self.cursor = cursor  # every position of ours below it was delivered
        period = plans(0).length
        self.length = period if length is None else (length if period else 0)

    def state(self) -> Dict[str, object]:
        return {"cursor": self.cursor, "finished": self.cursor >= self.length}

    def dealt(self) -> Tuple[np.ndarray, np.ndarray]:
        """This worker's positions still to deliver, and the dealt block of each."""
        ctx = self.ctx
        return dealt_positions(self.length, ctx.worker, ctx.workers, self.block,
                               base=self.done.below, skip=self.done.extra, start=self.cursor)

    def reads(self, mine: np.ndarray) -> WorkerReads:
        return plan_worker_reads(self.ctx, self.index, self.plans, mine)

    def _delivered(self, mine: np.ndarray) -> Iterator[Tuple[int, Optional[Dict]]]:
        """(position, sample) for each of ``mine`` in order; the sample is None when it was lost
        to an error the handler skipped. Ends early when the handler ends the pass."""
        reads = self.reads(mine)
        # A sample is known by (repetition, shard, offset): near the end of a repetition the
        # same sample can be in flight for two of them.
        wanted = zip(reads.repeats.tolist(), reads.shards.tolist(), reads.offsets.tolist())
        owners, groups = reads.owners, reads.groups
        records = self.ctx.records(reads.pieces)
        got: Dict[Tuple[int, int, int], Optional[Dict]] = {}
        try:
            for p, key in zip(mine.tolist(), wanted):
                sample = got.pop(key, _MISSING) if got else _MISSING
                while sample is _MISSING:
                    record = next(records, None)
                    if record is None:  # the handler ended the pass
                        return
                    piece = record[0]
                    found = (groups[piece], owners[piece], record[1])
                    if found == key:  # the usual case: in order
                        sample = record[3]
                    else:
                        got[found] = record[3]
                yield p, sample
        finally:
            records.close()

    def generate(self) -> Iterator[Dict]:
        mine, _blocks = self.dealt()
        delivered = self._delivered(mine)
        count = 0
        try:
            for p, sample in delivered:
                count += 1
                self.cursor = p + 1
                if sample is not None:  # None: lost to an error the handler skipped
                    yield sample
        finally:
            delivered.close()
        if count == len(mine):  # else the handler ended the pass
            self.cursor = max(self.cursor, self.length)

    def generate_blocks(self, with_sizes: bool = False) -> Iterator:
        """The worker's dealt blocks, each as the list of its samples (lost ones left out; a
        block can be empty), or ``(planned size, samples)`` with ``with_sizes``. The position
        after a block is recorded before it is yielded."""
        mine, blocks = self.dealt()
        ends = np.flatnonzero(np.diff(blocks)).tolist() + [len(mine) - 1] if len(mine) else []
        delivered = self._delivered(mine)
        done = first = 0  # positions of `mine` delivered; the block's first
        try:
            for last in ends:
                samples = []
                for _position, sample in delivered:
                    done += 1
                    if sample is not None:
                        samples.append(sample)
                    if done > last:
                        break
                size = last + 1 - first
                if done <= last:  # the handler ended the pass inside this block
                    if done:
                        self.cursor = int(mine[done - 1]) + 1
                    if samples:
                        yield (size, samples) if with_sizes else samples
                    return
                self.cursor = int(mine[last]) + 1
                first = last + 1
                yield (size, samples) if with_sizes else samples
        finally:
            delivered.close()
        self.cursor = max(self.cursor, self.length)
