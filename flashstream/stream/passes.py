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
from .plan import RankPlan, lanes_for, position_array, rank_sequence, read_order
from .samples import Piece, ReadStats, Records, plan_read_arrays, plan_reads
from .shuffle import Draws, ShuffleBuffer
from .state import Delivered
from .urls import local_path

__all__ = ["PassContext", "SamplePass", "ShardPass"]

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
    """Shard plan: the worker's shards in order, through its own shuffle buffer."""

    def __init__(self, ctx: PassContext, shards: List[int], entry: Optional[Dict]) -> None:
        self.ctx = ctx
        self.shards = shards
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
            draws = Draws("buffer", ctx.seed, ctx.epoch, ctx.rank, ctx.worker, ctx.workers,
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

    def _pieces(self) -> Tuple[List[Piece], List[int], int]:
        urls = self.ctx.urls
        compressed: Dict[int, bool] = {}

        def packed(shard: int) -> bool:
            if shard not in compressed:
                compressed[shard] = is_compressed(local_path(urls[shard]))
            return compressed[shard]

        pieces, owners = plan_reads(sorted(self._restore), urls, packed)
        restoring = len(pieces)
        for i in range(self.position, len(self.shards)):
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
        pieces, owners, restoring = self._pieces()
        first = self.position
        restored: Dict[Tuple[int, int], Optional[Dict]] = {}
        records = self.ctx.records(pieces)
        push = self.buffer.push if self.buffer is not None else None
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
        self.position, self.offset = len(self.shards), 0
        while self.buffer is not None and len(self.buffer):
            yield self.buffer.drain()[3]


class SamplePass(_Work):
    """Sample plan: this worker's positions of the rank's sequence, read in file order."""

    def __init__(self, ctx: PassContext, index: Sequence[ShardIndex], plan: RankPlan,
                 block: int, done: Delivered, cursor: int) -> None:
        self.ctx = ctx
        self.index = index
        self.plan = plan
        self.block = block
        self.done = done
        self.cursor = cursor  # every position of ours below it was delivered

    def state(self) -> Dict[str, object]:
        return {"cursor": self.cursor, "finished": self.cursor >= self.plan.length}

    def _refs(self, inputs: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, offset, end) arrays of the ascending input numbers ``inputs``: one numpy
        gather per unit of the plan rather than a lookup per sample."""
        plan = self.plan
        bounds = np.asarray(plan.starts[1:] + (plan.length,), dtype=np.int64)
        cuts = np.searchsorted(inputs, bounds, side="left")
        shards, offsets, ends = [], [], []
        lo = 0
        for (shard, first, _end), start, hi in zip(plan.units, plan.starts, cuts.tolist()):
            if hi > lo:
                k = inputs[lo:hi] - start + first
                shards.append(np.full(hi - lo, shard, dtype=np.int64))
                offsets.append(self.index[shard].offsets[k])
                ends.append(self.index[shard].ends[k])
            lo = hi
        if not shards:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        return np.concatenate(shards), np.concatenate(offsets), np.concatenate(ends)

    def generate(self) -> Iterator[Dict]:
        ctx, plan = self.ctx, self.plan
        mine = position_array(plan.length, ctx.worker, ctx.workers, self.block,
                              base=self.done.below, skip=self.done.extra, start=self.cursor)
        lanes = lanes_for(plan.length, ctx.lanes, self.block)
        # The rank's lanes and buffers, replayed over input numbers (no I/O).
        inputs = rank_sequence(lanes, ctx.buffer, ctx.seed, ctx.epoch, ctx.rank)[mine]
        shards, offsets, ends = (np.empty_like(inputs) for _ in range(3))
        ascending = np.argsort(inputs, kind="stable")
        shards[ascending], offsets[ascending], ends[ascending] = self._refs(inputs[ascending])
        # Read lane by lane in runs (see read_order); deliver in position order.
        average = max(1, int((ends - offsets).sum()) // max(1, len(inputs)))
        run = max(1, max(RUN_BYTES, ctx.settings.chunk_size) // average)
        read = read_order(inputs, lanes, ctx.buffer, run)
        pieces, owners = plan_read_arrays(
            shards[read], offsets[read], ends[read], ctx.urls,
            lambda s: self.index[s].compression is not None)
        wanted = zip(shards.tolist(), offsets.tolist())  # in position order
        records = ctx.records(pieces)
        got: Dict[Tuple[int, int], Optional[Dict]] = {}
        try:
            for p, key in zip(mine.tolist(), wanted):
                sample = got.pop(key, _MISSING) if got else _MISSING
                while sample is _MISSING:
                    record = next(records, None)
                    if record is None:  # the handler ended the pass
                        return
                    if (owners[record[0]], record[1]) == key:  # the usual case: in order
                        sample = record[3]
                    else:
                        got[(owners[record[0]], record[1])] = record[3]
                self.cursor = p + 1
                if sample is not None:  # None: lost to an error the handler skipped
                    yield sample
            self.cursor = max(self.cursor, plan.length)
        finally:
            records.close()
