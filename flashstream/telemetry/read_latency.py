"""Read tail latency on a drive, live, for pacing writes against a read SLO.

Readers that keep a live latency histogram register themselves (``IndexReader`` does); the
monitor takes the p95 of the reads completed since its last look. Without any registered
reader it falls back to /proc/diskstats: the mean time per completed read on the drive, which
sees every reader there (ShardStream's DataLoader workers included) but only their mean.
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

from .diskstats import disk_counters
from .histogram import LatencyHistogram

__all__ = ["ReadLatencyMonitor", "register_reader"]

# Objects with a ``latency() -> LatencyHistogram`` (cumulative); weak, so a reader that is
# dropped leaves the registry by itself.
_readers: weakref.WeakSet = weakref.WeakSet()
_lock = threading.Lock()


def register_reader(reader: object) -> None:
    """Makes ``reader.latency()`` a source of live read latencies."""
    with _lock:
        _readers.add(reader)


def _merged() -> Optional[LatencyHistogram]:
    with _lock:
        readers = list(_readers)
    hists = []
    for reader in readers:
        try:
            hists.append(reader.latency())
        except ValueError:  # closed meanwhile
            continue
    return LatencyHistogram.merged(hists) if hists else None


class ReadLatencyMonitor:
    """The p95 of reads since the previous call, in seconds."""

    def __init__(self, disk: Optional[str]) -> None:
        self.disk = disk
        self._last_hist = _merged()
        self._last_disk = self._disk()

    def _disk(self):
        counters = disk_counters(self.disk)
        return None if counters is None else (counters.read_count, counters.read_time)

    def p95(self) -> Optional[float]:
        """None when no read completed since the last call."""
        hist, disk = _merged(), self._disk()
        value = None
        if hist is not None and self._last_hist is not None:
            counts = [a - b for a, b in zip(hist.counts, self._last_hist.counts)]
            if sum(counts) > 0:
                ns = LatencyHistogram(counts).percentile(95)
                value = None if ns is None else ns / 1e9
        elif disk is not None and self._last_disk is not None:
            reads, ms = disk[0] - self._last_disk[0], disk[1] - self._last_disk[1]
            value = ms / 1e3 / reads if reads > 0 else None
        self._last_hist, self._last_disk = hist, disk
        return value
