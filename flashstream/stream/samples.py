"""One pass over a list of shards: ordered chunks -> tar scanner -> webdataset-style samples.

The reader keeps reads in flight across shard boundaries; the C++ scanner parses each chunk
with the GIL released and returns the completed samples as dicts. Errors name the shard (and
the byte offset for format errors) and go through the handler policy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from ..engine import TO_END, FormatError, Scanner, open_reader
from ..errors import ShardFormatError
from ..settings import IOSettings
from .decompress import DECOMPRESSION_ERRORS, Decompressor, detect
from .handlers import Handler
from .urls import local_path

__all__ = ["ReadStats", "iter_samples"]


@dataclasses.dataclass
class ReadStats:
    """What one pass read (filled in as the pass ends or stops)."""

    engine: str = ""
    shards: int = 0
    samples: int = 0
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


class _Pass:
    """State of one pass; kept out of the generator so the hot loop stays small."""

    def __init__(self, urls: Sequence[str], settings: IOSettings, handler: Handler,
                 stats: ReadStats) -> None:
        self.urls = list(urls)
        self.paths = [local_path(u) for u in self.urls]
        self.handler = handler
        self.stats = stats
        self.reader = open_reader([(p, 0, TO_END) for p in self.paths], settings)
        self.scanner = Scanner()
        self.stats.engine = self.reader.engine
        self.shard = -1  # extent index of the shard being scanned, or last finished
        self.open = False
        self.decompressor: Optional[Decompressor] = None
        self.pending: List[Dict] = []

    def start_shard(self, extent: int, head) -> None:
        self.shard, self.open = extent, True
        self.stats.shards += 1
        self.decompressor = detect(head)
        self.scanner.begin_shard(self.urls[extent], self.paths[extent], 0)

    def scan(self, data, last: bool) -> List[Dict]:
        if self.decompressor is not None:
            data = self.decompressor.decompress(data)
        self.scanner.feed(data)
        samples = self.scanner.take()
        if last:
            # The shard's end can still fail (truncated member, cut compressed stream): keep
            # what this piece completed so the error path delivers it before reporting.
            self.pending = samples
            if self.decompressor is not None:
                self.decompressor.finish()
            self.scanner.end_shard()
            samples = samples + self.scanner.take()
            self.pending = []
            self.open = False
        return samples

    def salvage(self) -> List[Dict]:
        """Samples completed before an error in the current piece."""
        samples, self.pending = self.pending, []
        return samples + self.scanner.take()

    def format_error(self, exn: BaseException) -> ShardFormatError:
        url = self.urls[self.shard]
        if isinstance(exn, FormatError):
            message, offset = exn.args
            if self.decompressor is not None:
                message += f" (offset in the decompressed {self.decompressor.name} stream)"
            return ShardFormatError(url, offset, message)
        offset = self.decompressor.consumed if self.decompressor is not None else None
        return ShardFormatError(url, offset, f"corrupt compressed data: {exn}")

    def finish(self) -> None:
        read = self.reader.stats()
        for name in ("bytes_read", "requests", "short_reads", "direct_files", "buffered_files",
                     "wait_ns", "latency_sum_ns", "latency_min_ns", "latency_max_ns"):
            setattr(self.stats, name, read[name])
        self.stats.latency_counts = self.reader.latency_counts()
        scanned = self.scanner.stats()
        self.stats.samples, self.stats.members = scanned["samples"], scanned["members"]
        self.reader.close()


def iter_samples(urls: Sequence[str], settings: IOSettings, handler: Handler,
                 stats: Optional[ReadStats] = None,
                 on_end: Optional[Callable[[ReadStats], None]] = None) -> Iterator[Dict]:
    """Yield the samples of ``urls`` in order. ``stats`` is filled in when the pass ends (or
    stops early), then ``on_end(stats)`` is called."""
    state = _Pass(urls, settings, handler, stats if stats is not None else ReadStats())
    try:
        while True:
            try:
                chunk = state.reader.next()
            except OSError as exn:
                # Errors surface at the failing shard's turn: all earlier chunks were delivered.
                state.stats.errors += 1
                if not state.handler(exn):
                    return
                state.reader.skip_extent()
                state.shard, state.open = (state.shard if state.open else state.shard + 1), False
                continue
            if chunk is None:
                return
            extent, _offset, data, first, last = chunk
            try:
                if first:
                    state.start_shard(extent, data)
                samples = state.scan(data, last)
            except (FormatError, *DECOMPRESSION_ERRORS) as exn:
                # Samples completed before the bad spot are good: deliver them first.
                yield from state.salvage()
                state.stats.errors += 1
                if not state.handler(state.format_error(exn)):
                    return
                if not last:
                    state.reader.skip_extent()
                state.open = False
                continue
            yield from samples
    finally:
        state.finish()
        if on_end is not None:
            on_end(state.stats)
