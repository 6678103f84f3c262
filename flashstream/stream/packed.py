"""Tensor batches straight from the read buffers: the pass behind ``ShardStream.tensors(B)``.

A worker's epoch is planned as for samples (its dealt blocks, and the reads of their
samples), but no per-sample object is made. After each chunk is scanned, numpy finds the batch
each completed sample belongs to, and one C++ call copies every payload from the reader's
buffer into that batch's shared-memory slab (``BatchPacker``: one region per field, samples in
the order they are read). A batch leaves once all of its block has been read.

A batch holds exactly the samples of one planned block, in file order (the order they are
read), whatever the shuffling; the blocks and their order are those of the sample plan, so
they are the same for any number of DataLoader workers.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..batches import HEADER, FieldLayout, TensorBatch, build_batch
from ..batches import pool as slab_pool
from ..engine import BatchPacker
from ..settings import IOSettings
from .handlers import Handler
from .passes import SamplePass, WorkerReads
from .samples import Piece, ReadStats, _Pass, _run

__all__ = ["PackedPass"]

#: Marks a record that stands for the samples of a chunk that were packed (not a sample).
PACKED = object()

_ALIGN = 64  # regions start on cache lines


class _Batches:
    """The open batches of a pass, and where each read sample goes."""

    def __init__(self, reads: WorkerReads, ordinal: np.ndarray, count: int,
                 urls: Sequence[str]) -> None:
        self.urls = urls
        # Piece k reads the samples read[first[k]:first[k + 1]], in ascending offsets (pieces
        # join only samples that follow each other in the file): its wanted offsets, sorted.
        first = np.concatenate(([0], np.cumsum([len(p.keep) for p in reads.pieces])))
        self.first = first.tolist()
        in_read_order = reads.offsets[reads.read]
        self.want = [in_read_order[a:b] for a, b in zip(self.first[:-1], self.first[1:])]
        self.batch_of_read = ordinal[reads.read]
        self.batch_list = self.batch_of_read.tolist()
        # run_end[i]: where the run of reads that go to read i's batch ends.
        ends = np.append(np.flatnonzero(np.diff(self.batch_of_read)) + 1,
                         len(self.batch_of_read))
        self.run_end = np.repeat(ends, np.diff(ends, prepend=0)).tolist()
        self.shard_of_read = reads.shards[reads.read]
        spans = np.bincount(ordinal, weights=(reads.ends - reads.offsets), minlength=count)
        self.region = (-(-spans.astype(np.int64) // _ALIGN) * _ALIGN).tolist()
        # Counters in Python ints: they are read and moved once per chunk or record.
        self.expected = np.bincount(ordinal, minlength=count).tolist()
        self.arrived = [0] * count
        self.lost = [0] * count
        # Per piece: the next wanted sample expected (most chunks bring exactly the next ones),
        # and how many of its wanted samples came; per read sample: whether it came.
        self.cursor = [0] * len(self.want)
        self.came = [0] * len(self.want)
        self.delivered = np.zeros(self.first[-1], dtype=bool)
        self.read_ids: Dict[int, List[Any]] = {}  # batch -> its read samples: ranges, arrays
        self.open: Dict[int, Tuple[Any, Any, int, int]] = {}  # packer, slab, generation, regions
        self.exts: List[str] = []  # fields seen so far: their regions keep their place
        self.fields = 2  # regions a new batch gets (grows as fields appear)
        self._zeros: Dict[int, np.ndarray] = {}  # targets "all to the first batch", by length

    def complete(self, b: int) -> bool:
        return self.arrived[b] + self.lost[b] >= self.expected[b]

    def _packer(self, b: int) -> Any:
        if b not in self.open:
            regions = max(self.fields, len(self.exts))
            slab, generation = slab_pool().take(HEADER + regions * self.region[b])
            packer = BatchPacker(slab.view(), HEADER, self.region[b], self.exts)
            self.open[b] = (packer, slab, generation, regions)
        return self.open[b][0]

    def _grow(self, b: int) -> None:
        """Batch ``b`` met a field it has no region for: move it to a slab with more."""
        packer, slab, generation, regions = self.open[b]
        regions += 1
        self.fields = max(self.fields, regions)
        bigger, new_generation = slab_pool().take(HEADER + regions * self.region[b])
        packer.relocate(bigger.view(), self.region[b])
        slab.release(generation)
        self.open[b] = (packer, bigger, new_generation, regions)

    def _copy(self, scanner: Any, targets: np.ndarray, ids: List[int]) -> None:
        """Copy the scanner's completed samples into batches ``ids`` (``targets``: an index
        into ``ids`` per sample, -1: not wanted), growing a batch that meets a new field."""
        packers = [self._packer(b) for b in ids]
        start = 0
        while True:
            refused = scanner.pack(targets, packers, start)
            if refused < 0:
                return
            t = int(targets[refused])
            self._grow(ids[t])
            packers[t] = self.open[ids[t]][0]
            start = refused

    def pack(self, scanner: Any, piece: int, offsets: np.ndarray) -> int:
        """Pack the scanner's completed samples of ``piece`` (first headers ``offsets``) into
        their batches; how many were wanted."""
        k = len(offsets)
        at = self.cursor[piece]
        want = self.want[piece]
        if at + k <= len(want) and (want[at:at + k] == offsets).all():
            # The usual chunk: exactly the next wanted samples of the piece.
            read = self.first[piece] + at
            if self.run_end[read] >= read + k:  # and all for one batch
                b = self.batch_list[read]
                targets = self._zeros.get(k)
                if targets is None:
                    targets = self._zeros[k] = np.zeros(k, dtype=np.int64)
                self._copy(scanner, targets, [b])
                self._arrive(piece, b, range(read, read + k))
                self.cursor[piece] = at + k
                return k
        return self._pack_any(scanner, piece, offsets)

    def _pack_any(self, scanner: Any, piece: int, offsets: np.ndarray) -> int:
        """pack() for any chunk: wanted samples among others, or for several batches."""
        want = self.want[piece]
        index = np.searchsorted(want, offsets)
        hit = index < len(want)
        hit[hit] = want[index[hit]] == offsets[hit]
        reads = self.first[piece] + index[hit]
        if not len(reads):
            return 0
        ids, inverse = np.unique(self.batch_of_read[reads], return_inverse=True)
        targets = np.full(len(offsets), -1, dtype=np.int64)
        targets[hit] = inverse
        self._copy(scanner, targets, ids.tolist())
        order = np.argsort(inverse, kind="stable")
        counts = np.bincount(inverse, minlength=len(ids))
        for b, part in zip(ids.tolist(), np.split(reads[order], np.cumsum(counts)[:-1])):
            self._arrive(piece, b, part)
        self.cursor[piece] = int(index[hit][-1]) + 1
        return len(reads)

    def _arrive(self, piece: int, b: int, reads: Any) -> None:
        """Samples ``reads`` (a range or an array of read indices) of ``piece`` are in batch
        ``b``."""
        self.arrived[b] += len(reads)
        self.came[piece] += len(reads)
        self.delivered[reads if not isinstance(reads, range)
                       else slice(reads.start, reads.stop)] = True
        self.read_ids.setdefault(b, []).append(reads)

    def piece_complete(self, piece: int) -> bool:
        """Every wanted sample of ``piece`` came."""
        return self.came[piece] == len(self.want[piece])

    def missing(self, piece: int) -> List[int]:
        """Wanted offsets of ``piece`` that did not come, ascending."""
        a, b = self.first[piece], self.first[piece + 1]
        return self.want[piece][~self.delivered[a:b]].tolist()

    def lose(self, piece: int, offset: int) -> None:
        """A wanted sample that will not come (an error the handler skipped)."""
        j = self.first[piece] + int(np.searchsorted(self.want[piece], offset))
        self.lost[self.batch_list[j]] += 1

    def finish(self, b: int) -> Optional[TensorBatch]:
        """Batch ``b`` as a TensorBatch (None if none of its samples came)."""
        if b not in self.open:
            return None
        packer, slab, generation, _regions = self.open.pop(b)
        keys, _offsets, fields = packer.result()
        del packer  # its hold on the slab's buffer
        # Fields none of this batch's samples have (regions kept for earlier batches' fields)
        # are left out: a batch depends on its own samples only.
        layouts = [FieldLayout(ext, region, nbytes, lengths)
                   for ext, region, nbytes, lengths in fields if lengths.max(initial=-1) >= 0]
        _check_field_names(layouts)
        for layout in layouts:
            if layout.name not in self.exts:
                self.exts.append(layout.name)
        # In arrival order, which is read order: the order the packer holds them in.
        reads = np.concatenate([np.arange(r.start, r.stop) if isinstance(r, range) else r
                                for r in self.read_ids.pop(b)])
        urls = [self.urls[s] for s in self.shard_of_read[reads].tolist()]
        lease = slab_pool().lease(slab, generation)
        return build_batch(lease, layouts, {"__key__": keys, "__url__": urls},
                           wire=(slab, generation))

    def discard(self) -> None:
        """Give back the slabs of batches that will not be delivered."""
        for packer, slab, generation, _regions in self.open.values():
            del packer
            slab.release(generation)
        self.open.clear()


class _PackingPass(_Pass):
    """A reading pass whose scanned samples go to their batches instead of becoming dicts.
    Which wanted samples came is kept by the batches (per piece, not in a set of offsets)."""

    def __init__(self, pieces: Sequence[Piece], settings: IOSettings, handler: Handler,
                 stats: ReadStats, batches: _Batches) -> None:
        super().__init__(pieces, settings, handler, stats)
        self.batches = batches

    def records(self) -> List[Any]:
        offsets, _ends = self.scanner.spans()
        if not len(offsets):
            return []
        count = self.batches.pack(self.scanner, self.piece, offsets)
        self.stats.samples += count
        return [(self.piece, count, None, PACKED)]

    def complete(self) -> bool:
        return self.open and self.batches.piece_complete(self.piece)

    def missing(self, index: int) -> List[int]:
        return self.batches.missing(index)


class PackedPass:
    """A worker's pass delivering tensor batches, one per dealt block of ``size`` positions;
    its position is that of the SamplePass it plans with (``sample_pass``)."""

    def __init__(self, sample_pass: SamplePass, size: int, partial: bool) -> None:
        self.sample_pass = sample_pass
        self.size = size
        self.partial = partial

    @property
    def epoch(self) -> int:
        return self.sample_pass.epoch

    @property
    def done(self) -> Any:
        return self.sample_pass.done

    def state(self) -> Dict[str, object]:
        return self.sample_pass.state()

    def generate(self) -> Iterator[TensorBatch]:
        work = self.sample_pass
        ctx = work.ctx
        mine, blocks = work.dealt()
        if not len(mine):
            work.cursor = max(work.cursor, work.length)
            return
        ordinal = np.concatenate(([0], np.cumsum(np.diff(blocks) != 0)))
        count = int(ordinal[-1]) + 1
        last = np.flatnonzero(np.append(np.diff(ordinal) != 0, True))  # each block's end
        reads = work.reads(mine)
        batches = _Batches(reads, ordinal, count, ctx.urls)
        state = _PackingPass(reads.pieces, ctx.settings, ctx.handler, ctx.stats, batches)
        records = _run(state, ctx.on_end)
        following = 0  # the next batch to deliver
        try:
            for piece, offset, _end, marker in records:
                if marker is not PACKED:  # a wanted sample lost to a skipped error
                    batches.lose(piece, offset)
                while following < count and batches.complete(following):
                    batch = batches.finish(following)
                    work.cursor = int(mine[last[following]]) + 1
                    full = batches.expected[following] == self.size
                    following += 1
                    if batch is not None and (self.partial or full):
                        yield batch
        finally:
            records.close()
            batches.discard()
        if following == count:  # else the handler ended the pass
            work.cursor = max(work.cursor, work.length)


_RESERVED = ("__key__", "__url__", "__local_path__")


def _check_field_names(layouts) -> None:
    """The scanner tells fields apart by ASCII-lowercased extension; their names are
    str.lower()ed (webdataset's rule), which folds more ("\u212a" is "k") and may spell a
    reserved key. Two fields must never become one column, nor a field replace __key__."""
    seen = set(_RESERVED)
    for layout in layouts:
        if layout.name in seen:
            raise ValueError(f"two tar members' extensions both become the field "
                             f"{layout.name!r} once lowercased (or it is a reserved key); "
                             f"rename them in the shards")
        seen.add(layout.name)
