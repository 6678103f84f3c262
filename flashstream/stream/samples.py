"""One pass over byte ranges of shards: ordered chunks -> tar scanner -> webdataset samples.

The reader keeps reads in flight across piece boundaries; the C++ scanner parses each chunk
with the GIL released and returns the completed samples with the shard offsets of their first
header and of their end. A piece is a whole shard, or a range that starts at a sample's first
header (resuming, or reading by index); it can keep only some of its samples. Errors name the
shard (and the byte offset for format errors) and go through the handler policy; as in
webdataset, the group of members being assembled when a shard fails (its members completed
before the cut) is delivered unless the handler raises.
"""

from __future__ import annotations

import dataclasses
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
)

import numpy as np

from ..engine import TO_END, FormatError, Scanner, open_reader
from ..errors import ShardFormatError
from ..settings import IOSettings
from .decompress import DECOMPRESSION_ERRORS, Decompressor, detect
from .handlers import Handler, goes_on
from .urls import local_path

__all__ = ["READ_THROUGH", "Piece", "ReadStats", "Record", "Records", "plan_read_arrays",
           "plan_reads"]

#: Reading by index, a gap of at most this many bytes between two wanted samples of a shard
#: is read through (and its samples dropped) rather than split into two requests: small
#: samples then cost a little over-read instead of one small request each.
READ_THROUGH = 16 << 10


@dataclasses.dataclass
class ReadStats:
    """What one pass read (filled in as the pass ends or stops)."""

    engine: str = ""
    shards: int = 0  # pieces started: shards, or byte ranges of shards when reading by index
    samples: int = 0  # samples kept (read-through and skipped samples are not counted)
    members: int = 0
    bytes_read: int = 0  # bytes transferred from the drive, alignment over-read included
    requests: int = 0
    short_reads: int = 0
    direct_files: int = 0
    buffered_files: int = 0
    errors: int = 0
    wait_ns: int = 0  # time the pass spent blocked waiting for reads
    latency_sum_ns: int = 0
    latency_min_ns: int = 0
    latency_max_ns: int = 0
    latency_counts: Optional[Any] = None  # per-request latency histogram counts (numpy)

    def counters(self) -> Dict[str, int]:
        """The integer counters, for the stats board."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), int)}

    @property
    def direct(self) -> bool:
        """True when every file was read with O_DIRECT."""
        return self.buffered_files == 0 and self.direct_files > 0


@dataclasses.dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of one shard. ``start`` is 0 or the first header of a sample
    (compressed shards are always read from 0: there is no seeking into a compressed stream).
    ``keep``: the header offsets of the samples wanted (None: all); ``skip_below``: drop the
    samples that start before this offset; ``last_end``: reading by index, where the index
    says the last wanted sample ends (in the decompressed stream for compressed shards)."""

    url: str
    start: int = 0
    end: int = TO_END
    keep: Optional[FrozenSet[int]] = None
    skip_below: int = 0
    last_end: int = -1


#: ``(piece, offset, end, sample)``: a sample of piece ``piece`` spanning shard bytes
#: ``[offset, end)``; ``sample`` is None when a wanted sample was lost to an error the handler
#: chose to skip. A plain tuple: one is made per sample.
Record = Tuple[int, int, int, Optional[Dict]]


class _Pass:
    """State of one pass; kept out of the generator so the hot loop stays small."""

    def __init__(self, pieces: Sequence[Piece], settings: IOSettings, handler: Handler,
                 stats: ReadStats) -> None:
        self.pieces = list(pieces)
        self.paths = [local_path(p.url) for p in self.pieces]
        self.handler = handler
        self.stats = stats
        self.reader = open_reader([(path, p.start, p.end)
                                   for path, p in zip(self.paths, self.pieces)], settings)
        self.scanner = Scanner()
        self.stats.engine = self.reader.engine
        self.piece = -1  # index of the piece being scanned, or last finished
        self.open = False
        self.decompressor: Optional[Decompressor] = None
        self.pending: List[Record] = []
        self.seen: Set[int] = set()  # wanted offsets delivered from the current piece
        self.codecs: Dict[int, Optional[str]] = {}
        self.errors: Dict[int, BaseException] = {}

    def fail(self, exn: BaseException) -> bool:
        """Count and record an error of the current piece; whether the pass goes on (the
        handler's verdict, see :func:`~.handlers.goes_on`)."""
        self.stats.errors += 1
        self.errors[self.piece] = exn
        return goes_on(self.handler, exn)

    def start_piece(self, index: int, head) -> None:
        self.piece, self.open = index, True
        self.stats.shards += 1
        piece = self.pieces[index]
        # Only a piece read from the shard's start can begin with a compression magic.
        self.decompressor = detect(head) if piece.start == 0 else None
        self.codecs[index] = self.decompressor.name if self.decompressor else None
        self.seen = set()
        self.scanner.begin_shard(piece.url, self.paths[index], piece.start)

    def records(self) -> List[Record]:
        samples, spans = self.scanner.take(with_offsets=True)
        if not samples:
            return []
        i, piece = self.piece, self.pieces[self.piece]
        keep, low = piece.keep, piece.skip_below
        if keep is None and not low:  # the common case: every sample, no per-sample test
            out = [(i, offset, end, sample) for sample, (offset, end) in zip(samples, spans)]
        else:
            out = [(i, offset, end, sample) for sample, (offset, end) in zip(samples, spans)
                   if offset >= low and (keep is None or offset in keep)]
            if keep is not None:
                self.seen.update(record[1] for record in out)
        self.stats.samples += len(out)
        return out

    def scan(self, data, last: bool) -> List[Record]:
        if self.decompressor is not None:
            data = self.decompressor.decompress(data)
        if len(data) == 0 and self.pieces[self.piece].start > 0:
            # A resume point at the very end of a shard: nothing left to scan.
            self.open = False
            return []
        self.scanner.feed(data)
        records = self.records()
        if last:
            # The shard's end can still fail (truncated member, cut compressed stream): keep
            # what this piece completed so the error path delivers it before reporting. The
            # tar stream's end first: a compressed shard cut short is a tar stream cut at the
            # decompressed offset where tarfile (so webdataset) meets the cut.
            self.pending = records
            self.scanner.end_shard()
            if self.decompressor is not None:
                self.decompressor.finish()  # a compressed stream cut after the tar's end
            records = records + self.records()
            self.pending = []
            self.open = False
        return records

    def salvage(self) -> List[Record]:
        """Samples completed before an error in the current piece."""
        records, self.pending = self.pending, []
        try:
            return records + self.records()
        except FormatError:  # the bad sample itself (a duplicate field): the error says so
            return records

    def open_group(self, exn: BaseException) -> List[Record]:
        """After the scanner failed with ``exn``: the group of members it was assembling
        (webdataset's current sample, yielded after the cut unless the handler raises), as
        this piece's records if wanted. Nothing after a compressed stream failed to inflate:
        where that falls in the tar stream depends on how the reads cut it, not on the
        shard."""
        if not isinstance(exn, FormatError) or not self.scanner.flush_open_group():
            return []
        return self.salvage()

    def met_by_index(self, exn: BaseException) -> bool:
        """Reading by index, after ``exn`` and the samples before it: whether every wanted
        sample is in and the error lies past the last of them. The index scan met this error
        then (and its handler kept what the index holds, the open group included); it is not
        reported again. An error inside a wanted sample (a shard cut after its index was
        written) is reported."""
        if not self.complete():
            return False
        if not isinstance(exn, FormatError):  # an inflate error once everything wanted is in
            return True
        return exn.args[1] >= self.pieces[self.piece].last_end

    def complete(self) -> bool:
        """True when the open piece has delivered every sample it wants."""
        keep = self.pieces[self.piece].keep
        return self.open and keep is not None and len(self.seen) == len(keep)

    def missing(self, index: int) -> List[int]:
        """Wanted offsets of piece ``index`` that it did not deliver."""
        keep = self.pieces[index].keep
        if keep is None:
            return []
        seen = self.seen if index == self.piece else set()
        return sorted(keep - seen)

    def format_error(self, exn: BaseException) -> ShardFormatError:
        url = self.pieces[self.piece].url
        if isinstance(exn, FormatError):
            message, offset = exn.args
            if self.decompressor is not None:
                message += f" (offset in the decompressed {self.decompressor.name} stream)"
            return ShardFormatError(url, offset, message, getattr(exn, "shard_only", False))
        offset = self.decompressor.consumed if self.decompressor is not None else None
        # EOFError: the compressed stream ends early (after the tar's end, as end_shard came
        # first), which tarfile reads without complaint: webdataset goes on there.
        return ShardFormatError(url, offset, f"corrupt compressed data: {exn}",
                                isinstance(exn, EOFError))

    def finish(self) -> None:
        """Add this reader's figures to the stats (a pass may use several readers in turn:
        resampled shards are read a window at a time)."""
        read, stats = self.reader.stats(), self.stats
        for name in ("bytes_read", "requests", "short_reads", "direct_files", "buffered_files",
                     "wait_ns", "latency_sum_ns"):
            setattr(stats, name, getattr(stats, name) + read[name])
        if read["latency_count"]:
            stats.latency_min_ns = (read["latency_min_ns"] if not stats.latency_max_ns
                                    else min(stats.latency_min_ns, read["latency_min_ns"]))
            stats.latency_max_ns = max(stats.latency_max_ns, read["latency_max_ns"])
        counts = self.reader.latency_counts()
        stats.latency_counts = (counts if stats.latency_counts is None
                                else stats.latency_counts + counts)
        stats.members += self.scanner.stats()["members"]
        self.reader.close()


class Records:
    """Iterate the samples of ``pieces`` in order, as :class:`Record`. ``stats`` is filled in
    when the pass ends (or stops early), then ``on_end(stats)`` is called. ``codecs`` maps each
    piece started so far to its compression (``"gzip"``, ...) or None; ``errors`` each piece's
    error that the handler chose to skip."""

    def __init__(self, pieces: Sequence[Piece], settings: IOSettings, handler: Handler,
                 stats: Optional[ReadStats] = None,
                 on_end: Optional[Callable[[ReadStats], None]] = None) -> None:
        self.pieces = list(pieces)
        self.settings = settings
        self.handler = handler
        self.stats = stats if stats is not None else ReadStats()
        self.on_end = on_end
        self.codecs: Dict[int, Optional[str]] = {}
        self.errors: Dict[int, BaseException] = {}

    def __iter__(self) -> Iterator[Record]:
        if not self.pieces:
            return _nothing(self.stats, self.on_end)
        state = _Pass(self.pieces, self.settings, self.handler, self.stats)
        state.errors = self.errors
        self.codecs = state.codecs
        return _run(state, self.on_end)


def _nothing(stats: ReadStats, on_end: Optional[Callable[[ReadStats], None]]
             ) -> Iterator[Record]:
    """An empty pass (no reader to open), reported like any other when it ends."""
    if on_end is not None:
        on_end(stats)
    yield from ()


def _lost(state: _Pass, index: int) -> Iterator[Record]:
    for offset in state.missing(index):
        yield (index, offset, offset, None)


def _check_complete(state: _Pass) -> Iterator[Record]:
    """After a piece ended cleanly: every wanted sample must have been seen, else the shard
    no longer matches its index (an error through the handler, then the misses are lost)."""
    missing = state.missing(state.piece)
    if not missing:
        return
    piece = state.pieces[state.piece]
    error = ShardFormatError(piece.url, missing[0],
                             f"no sample starts here although the shard index says one does "
                             f"({len(missing)} missing); was the shard rewritten after "
                             f"`flashstream index`?")
    if not state.fail(error):
        raise _Stop
    yield from _lost(state, state.piece)


class _Stop(Exception):
    """The handler chose to end the pass."""


def _run(state: _Pass, on_end: Optional[Callable[[ReadStats], None]]) -> Iterator[Record]:
    """The pass itself (one generator, no wrapper: it runs once per sample)."""
    try:
        while True:
            try:
                chunk = state.reader.next()
            except OSError as exn:
                # Errors surface at the failing piece's turn: all earlier chunks were delivered.
                if not state.open:  # it failed before its first chunk
                    state.piece, state.seen = state.piece + 1, set()
                if not state.fail(exn):
                    return
                state.reader.skip_extent()
                state.open = False
                yield from _lost(state, state.piece)
                continue
            if chunk is None:
                return
            index, _offset, data, first, last = chunk
            try:
                if first:
                    state.start_piece(index, data)
                records = state.scan(data, last)
            except (FormatError, *DECOMPRESSION_ERRORS) as exn:
                # Samples completed before the bad spot are good: deliver them first.
                yield from state.salvage()
                group = state.open_group(exn)
                if state.met_by_index(exn):
                    yield from group
                else:
                    going = state.fail(state.format_error(exn))
                    yield from group  # as webdataset: only a raising handler loses it
                    if not going:
                        return
                if not last:
                    state.reader.skip_extent()
                state.open = False
                yield from _lost(state, state.piece)
                continue
            yield from records
            if last:
                yield from _check_complete(state)
            elif state.complete():
                # Every wanted sample is in: skip the rest (a compressed shard is read from
                # its start for a few samples, and need not be inflated to its end).
                state.reader.skip_extent()
                state.open = False
    except _Stop:
        return
    finally:
        state.finish()
        if on_end is not None:
            on_end(state.stats)


def plan_reads(refs: Iterable[Tuple[int, int, int]], urls: Sequence[str],
               compressed: Callable[[int], bool]) -> Tuple[List[Piece], List[int]]:
    """:func:`plan_read_arrays` of ``refs`` given as ``(shard, offset, end)`` tuples."""
    table = np.asarray(list(refs), dtype=np.int64).reshape(-1, 3)
    return plan_read_arrays(table[:, 0], table[:, 1], table[:, 2], urls, compressed)


def plan_read_arrays(shards: np.ndarray, offsets: np.ndarray, ends: np.ndarray,
                     urls: Sequence[str], compressed: Callable[[int], bool]
                     ) -> Tuple[List[Piece], List[int]]:
    """Pieces reading the samples ``(shards[i], offsets[i], ends[i])`` in the given order, and
    the shard of each piece. Consecutive refs of one shard share a piece when they follow each
    other in the file within :data:`READ_THROUGH`; a compressed shard is read from its start
    (its offsets count in the decompressed stream), once per run of its refs. The runs are
    found by numpy: an epoch's reads are planned before its first read starts."""
    count = len(shards)
    if count == 0:
        return [], []
    # One compression lookup per shard, not per sample: this runs before an epoch's first read.
    unique = np.unique(shards)
    kinds = np.fromiter((compressed(int(shard)) for shard in unique), dtype=bool,
                        count=len(unique))
    packed = kinds[np.searchsorted(unique, shards)]
    joins = ((shards[1:] == shards[:-1]) & (offsets[1:] >= ends[:-1])
             & (packed[1:] | (offsets[1:] - ends[:-1] <= READ_THROUGH)))
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    stops = np.append(starts[1:], count)
    pieces: List[Piece] = []
    owners: List[int] = []
    for a, b in zip(starts.tolist(), stops.tolist()):
        shard = int(shards[a])
        zipped = bool(packed[a])
        pieces.append(Piece(urls[shard], 0 if zipped else int(offsets[a]),
                            TO_END if zipped else int(ends[b - 1]),
                            keep=frozenset(offsets[a:b].tolist()), last_end=int(ends[b - 1])))
        owners.append(shard)
    return pieces, owners
