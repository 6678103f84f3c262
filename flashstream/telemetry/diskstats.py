"""Device counters from /proc/diskstats (through psutil): throughput and utilization of the
drive over an epoch, and optionally sampled over time for plots."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import List, Optional, Tuple

import psutil

__all__ = ["DiskDelta", "DiskSampler", "disk_bytes_written", "disk_counters", "write_read_counters"]


def disk_counters(name: Optional[str]):
    """psutil's counters of the disk ``name`` (e.g. ``nvme0n1``), or None if not listed."""
    if not name:
        return None
    return psutil.disk_io_counters(perdisk=True, nowrap=True).get(name)


def write_read_counters(name: Optional[str]) -> Optional[Tuple[int, int, int]]:
    """The disk ``name``'s bytes written, reads completed and ms spent reading, from every
    process; None where the disk is unknown or not listed (a container without
    /proc/diskstats, a network file system)."""
    try:
        c = disk_counters(name)
    except (OSError, NotImplementedError):  # psutil without /proc/diskstats nor /sys/block
        return None
    return None if c is None else (int(c.write_bytes), int(c.read_count), int(c.read_time))


def disk_bytes_written(name: Optional[str]) -> Optional[int]:
    """Bytes the disk ``name`` has completed writing, from every process (None: unknown)."""
    counters = write_read_counters(name)
    return None if counters is None else counters[0]


@dataclasses.dataclass(frozen=True)
class DiskDelta:
    """What the device did between two snapshots."""

    device: str
    seconds: float
    read_bytes: int
    write_bytes: int
    busy_ms: Optional[int]

    @property
    def read_gbps(self) -> float:
        return self.read_bytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def write_gbps(self) -> float:
        return self.write_bytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def utilization(self) -> Optional[float]:
        """Share of the wall time the device had I/O in flight (diskstats' io_ticks)."""
        if self.busy_ms is None or not self.seconds:
            return None
        return min(1.0, self.busy_ms / 1e3 / self.seconds)

    def to_dict(self):
        out = dataclasses.asdict(self)
        out.update(read_gbps=self.read_gbps, write_gbps=self.write_gbps,
                   utilization=self.utilization)
        return out


class DiskSampler:
    """Snapshots a disk's counters at start and stop, and every ``interval`` seconds between
    them on a background thread when ``interval`` is given (for throughput-over-time plots)."""

    def __init__(self, device: Optional[str], interval: Optional[float] = None) -> None:
        self.device = device
        self.interval = interval
        self.timeline: List[Tuple[float, float, float]] = []  # (t, read GB/s, write GB/s)
        self._start = None
        self._t0 = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> DiskSampler:
        self._t0 = time.perf_counter()
        self._start = disk_counters(self.device)
        if self.interval and self._start is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        last, last_t = self._start, self._t0
        while not self._stop.wait(self.interval):
            now, now_t = disk_counters(self.device), time.perf_counter()
            width = now_t - last_t
            self.timeline.append((now_t - self._t0,
                                  (now.read_bytes - last.read_bytes) / width / 1e9,
                                  (now.write_bytes - last.write_bytes) / width / 1e9))
            last, last_t = now, now_t

    def stop(self) -> Optional[DiskDelta]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        end, seconds = disk_counters(self.device), time.perf_counter() - self._t0
        if self._start is None or end is None:
            return None
        busy = getattr(end, "busy_time", None)
        start_busy = getattr(self._start, "busy_time", None)
        return DiskDelta(self.device, seconds, end.read_bytes - self._start.read_bytes,
                         end.write_bytes - self._start.write_bytes,
                         None if busy is None or start_busy is None else busy - start_busy)
