"""Running a pipeline's stages over one pass of its stream, with the exact position after each
output.

The position is the source's position at a **clean point** (a moment when no stage held an
item) plus the number of outputs made since. Resuming restores the source there, runs the
stages again and drops that many outputs: exact, because every stage is a function of its
input sequence. When nothing can hold items between outputs (no ``unbatched``), every output
is a clean point, and the position is simply the source's, read when it is asked for.

Two ways to batch (see docs/pipeline.md):

- **by block** (sample plan, and only per-item stages before ``batched``): the source hands
  over the worker's planned blocks; a batch is the survivors of one block. Batches are then the
  same for any number of DataLoader workers, filters included.
- **by count** (shard plan, or an opaque stage before ``batched``): a batch is the next
  ``batchsize`` items of this worker's stream, as webdataset makes them (without reading one
  item ahead, so nothing is lost on resume).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .stages import Batch, Each, Opaque, Slice, Stage, Unbatch

__all__ = ["Compiled", "Run", "compile_stages"]

_END = object()


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A pipeline's stages as the runner uses them."""

    block: Optional[Batch]  # batched by block: the first Batch, consumed at the source
    before: Tuple[Each, ...]  # the per-item stages that run on each block before it
    after: Tuple[Stage, ...]  # everything else, in order
    holds: bool  # some stage can hold items between outputs (unbatched)

    @property
    def batch_size(self) -> Optional[int]:
        """The block size the stream deals to workers, when batching by block."""
        return self.block.size if self.block is not None else None


def compile_stages(stages: Tuple[Stage, ...], *, by_block: bool) -> Compiled:
    """Split ``stages`` for the runner. ``by_block``: the stream can hand over planned blocks
    (sample plan), so the first ``batched`` preceded only by per-item stages batches by
    block, unless its batches are unbatched later: the DataLoader then takes single items
    from the workers in turn, so the stream must deal single samples."""
    block: Optional[Batch] = None
    before: Tuple[Each, ...] = ()
    after = stages
    if by_block and not any(isinstance(s, Unbatch) for s in stages):
        for i, stage in enumerate(stages):
            if isinstance(stage, Batch):
                block, before, after = stage, stages[:i], stages[i + 1:]  # type: ignore
                break
            if not isinstance(stage, Each):
                break
    holds = any(isinstance(s, Unbatch) for s in stages)
    return Compiled(block, before, after, holds)


class _Drained:
    """An iterator over ``items`` that knows whether it was run to the end (a stage whose
    handler says stop leaves it unfinished, even at the block's last item)."""

    def __init__(self, items: List[Any]) -> None:
        self._items = iter(items)
        self.drained = False

    def __iter__(self) -> _Drained:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._items)
        except StopIteration:
            self.drained = True
            raise


def _each(stages: Tuple[Each, ...], items: Iterator[Any]) -> Iterator[Any]:
    for stage in stages:
        items = stage.apply(items)
    return items


class Run:
    """One pass of a pipeline in one process; ``ShardStream.state_dict()`` asks it for the
    worker's position (it stands in for the stream's pass).

    ``source``: the stream's pass (``generate()`` / ``generate_blocks()``, ``state()``).
    ``entry``: the worker entry it resumes (its ``skip``, ``count``); ``limit``: outputs per
    worker per epoch (shard plan ``with_epoch``), None for no limit; ``next_pass(r, run)`` opens the
    stream's repetition ``r`` of the epoch (shard plan), up to ``repeats``."""

    def __init__(self, source: Any, compiled: Compiled, *, entry: Optional[Dict] = None,
                 limit: Optional[int] = None, repeats: int = 1, next_pass: Any = None,
                 empty_check: bool = False, finish: Any = None) -> None:
        self.finish = finish  # applied to each item as it leaves
        self.empty_check = empty_check and not entry  # a resumed pass may have nothing left
        entry = entry or {}
        self._resumed = dict(entry)
        self.source = source
        self.compiled = compiled
        self.limit = limit
        self.repeats = repeats
        self.next_pass = next_pass
        self.repeat = int(entry.get("repeat", 0))
        self.count = int(entry.get("count", 0))  # outputs delivered this epoch (with a limit)
        self._replay = int(entry.get("skip", 0))  # outputs to drop: delivered before the resume
        # The clean point: None = the source's position now; else a saved source entry.
        self._mark: Optional[Dict[str, Any]] = dict(entry) if self._replay else None
        self._since = 0  # outputs since the clean point
        self._held = 0  # items held by stages right now
        self._read = 0  # samples the source gave (counted for the empty check)
        self._ended = False
        slices = sum(isinstance(s, Slice) for s in compiled.after)
        # Items each slice stage has seen this epoch, part of the position.
        self._seen: List[int] = [int(n) for n in entry.get("sliced", [0] * slices)]
        if len(self._seen) != slices:
            raise ValueError(f"this state was saved by a pipeline with {len(self._seen)} "
                             f"slice stage(s); this one has {slices}")

    # -- what ShardStream reads from its active pass -----------------------------------------
    @property
    def epoch(self) -> int:
        return self.source.epoch

    @property
    def done(self) -> Any:
        return self.source.done

    def _source_entry(self) -> Dict[str, Any]:
        entry = dict(self.source.state())
        entry["repeat"] = self.repeat
        if self._seen:
            entry["sliced"] = list(self._seen)
        return entry

    def state(self) -> Dict[str, Any]:
        """The worker entry: the clean point's source position, and the outputs since."""
        if self._replay:  # asked before the resumed pass caught up: it is where it was
            return dict(self._resumed)
        entry = self._source_entry() if self._mark is None else dict(self._mark)
        entry["skip"] = self._since
        entry["count"] = self.count
        finished = self._ended or (self.limit is not None and self.count >= self.limit)
        entry["finished"] = bool(finished or (entry.get("finished") and not self._since
                                              and self.repeat + 1 >= self.repeats))
        return entry

    # -- clean points -------------------------------------------------------------------------
    def _pulling(self) -> None:
        """A stage is about to pull from upstream while holding nothing: if no other stage
        holds anything either, this is a clean point."""
        if self.compiled.holds and self._held == 0:
            self._mark, self._since = self._source_entry(), 0

    def _output(self) -> None:
        if self._held == 0:
            self._mark, self._since = None, 0
        else:
            self._since += 1

    # -- stages -------------------------------------------------------------------------------
    def _batched(self, stage: Batch, items: Iterator[Any]) -> Iterator[Any]:
        """webdataset's batched, except that a full batch leaves at once (webdataset waits
        for the next item, which a resume would then lose)."""
        batch: List[Any] = []
        items = iter(items)
        while True:
            if not batch:
                self._pulling()
            item = next(items, _END)
            if item is _END:
                break
            batch.append(item)
            self._held += 1
            if len(batch) == stage.size:
                self._held -= len(batch)
                out, batch = stage.collate(batch), []
                yield out
        self._held -= len(batch)
        if batch and stage.partial:
            yield stage.collate(batch)

    def _unbatched(self, stage: Unbatch, batches: Iterator[Any]) -> Iterator[Any]:
        batches = iter(batches)
        while True:
            self._pulling()
            batch = next(batches, _END)
            if batch is _END:
                return
            rest = list(stage.split(batch))
            self._held += len(rest)
            for item in rest:
                self._held -= 1
                yield item

    def _sliced(self, k: int, stage: Slice, items: Iterator[Any]) -> Iterator[Any]:
        """``itertools.islice`` over the items, counting from where the position says this
        slice was: it pulls nothing once ``stop`` items were seen, as islice."""
        items = iter(items)
        while True:
            seen = self._seen[k]
            if stage.stop is not None and seen >= stage.stop:
                return
            item = next(items, _END)
            if item is _END:
                return
            self._seen[k] = seen + 1
            if seen >= stage.start and (seen - stage.start) % stage.step == 0:
                yield item

    def _blocks(self) -> Iterator[Any]:
        """Batches by block: the survivors of each planned block, through the per-item stages;
        empty blocks give no batch (see docs/pipeline.md)."""
        stage = self.compiled.block
        for size, block in self.source.generate_blocks(with_sizes=True):
            items = _Drained(block)
            survivors = list(_each(self.compiled.before, items))
            if survivors and (stage.partial or size == stage.size):
                yield stage.collate(survivors)
            if not items.drained:  # a stage's handler ended the stream
                return

    def _samples(self) -> Iterator[Any]:
        """The source's samples; with ``repeats``, the following repetitions of the epoch."""
        source = self.source
        while True:
            if self.empty_check:  # webdataset checks the samples, before any stage
                for sample in source.generate():
                    self._read += 1
                    yield sample
                if not self._read:  # as webdataset's check: once the source ran dry
                    raise ValueError("No samples found in dataset; perhaps you have fewer "
                                     "shards than workers.\nTurn off using empty_check=False "
                                     "in the WebDataset constructor.")
            else:
                yield from source.generate()
            if self.repeat + 1 >= self.repeats or self.next_pass is None:
                return
            self.repeat += 1
            source = self.source = self.next_pass(self.repeat, self)

    def _chain(self) -> Iterator[Any]:
        compiled = self.compiled
        items = self._blocks() if compiled.block is not None else self._samples()
        slices = 0
        for stage in compiled.after:
            if isinstance(stage, Each):
                items = stage.apply(items)
            elif isinstance(stage, Batch):
                items = self._batched(stage, items)
            elif isinstance(stage, Unbatch):
                items = self._unbatched(stage, items)
            elif isinstance(stage, Slice):
                items = self._sliced(slices, stage, items)
                slices += 1
            else:
                assert isinstance(stage, Opaque)
                items = stage.apply(items)
        return items

    def __iter__(self) -> Iterator[Any]:
        if self.limit is not None and self.count >= self.limit:
            self._ended = True
            return
        items = self._chain()
        try:
            for item in items:
                self._output()
                if self._replay:
                    self._replay -= 1
                    continue
                self.count += 1
                yield item if self.finish is None else self.finish(item)
                if self.limit is not None and self.count >= self.limit:
                    break
            else:
                self._ended = True
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()
            # The stream holds this run (for its position) and next_pass holds the stream:
            # let go of it once the pass is over, so that dropping the pipeline frees its
            # stages at once (one may hold a file open, as webdataset's LMDBCached does).
            self.next_pass = None
