"""The epoch report: what an epoch did, and how close it ran to the drive.

``EpochMonitor`` wraps the loop over a DataLoader (or the stream itself): it times how long the
training loop waited for each batch, samples the device's counters, and merges the stream's
statistics from every DataLoader worker. ``report()`` then gives an :class:`EpochReport` with
each figure beside the probe's (GB/s as a share of the probe's best sequential read; request
p95 against the probe's p95 at the same request size and depth).
"""

from __future__ import annotations

import array
import dataclasses
import time
from typing import Dict, Iterable, Iterator, List, Optional, TypeVar

import numpy as np

from ..engine import engine_name
from ..sizes import format_size
from .device import device_of
from .diskstats import DiskDelta, DiskSampler
from .histogram import LatencyHistogram
from .probe import ProbePoint, ProbeResult

__all__ = ["EpochMonitor", "EpochReport"]

T = TypeVar("T")


@dataclasses.dataclass
class EpochReport:
    wall_seconds: float
    samples: int
    batches: int
    bytes_read: int
    shards: int
    workers: int
    engine: str
    direct: bool
    chunk_size: int
    queue_depth: int
    request_latency: LatencyHistogram
    batch_wait: LatencyHistogram
    device: Optional[str] = None
    disk: Optional[DiskDelta] = None
    probe_best_read: Optional[ProbePoint] = None
    probe_same_shape: Optional[ProbePoint] = None
    errors: int = 0
    #: What building the stream's index cost, per source (``sidecar``, ``cache``, ``scan``):
    #: ``{"shards", "bytes", "seconds"}`` (the stream's ``index_info["by_source"]``); a start-up
    #: cost, not part of the epoch's figures.
    indexing: Optional[Dict[str, Dict[str, float]]] = None

    @property
    def gbps(self) -> float:
        return self.bytes_read / self.wall_seconds / 1e9 if self.wall_seconds else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def wait_share(self) -> float:
        """Share of the epoch the training loop spent waiting for data (I/O-bound if high)."""
        waited = self.batch_wait.sum_ns / 1e9
        return waited / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def gbps_vs_probe(self) -> Optional[float]:
        best = self.probe_best_read
        return self.gbps / best.gbps if best and best.gbps else None

    @property
    def p95_vs_probe(self) -> Optional[float]:
        ours = self.request_latency.percentile(95)
        theirs = self.probe_same_shape.latency_us.get("p95") if self.probe_same_shape else None
        return ours / 1e3 / theirs if ours and theirs else None

    def to_dict(self) -> Dict[str, object]:
        return {
            "wall_seconds": self.wall_seconds, "samples": self.samples,
            "batches": self.batches, "bytes_read": self.bytes_read, "gbps": self.gbps,
            "samples_per_s": self.samples_per_s, "shards": self.shards, "workers": self.workers,
            "engine": self.engine, "direct": self.direct, "chunk_size": self.chunk_size,
            "queue_depth": self.queue_depth, "errors": self.errors,
            "request_latency_us": self.request_latency.summary("us"),
            "batch_wait_ms": self.batch_wait.summary("ms"), "wait_share": self.wait_share,
            "device": self.device, "disk": self.disk.to_dict() if self.disk else None,
            "indexing": self.indexing,
            "probe": {
                "best_read_gbps": self.probe_best_read.gbps if self.probe_best_read else None,
                "same_shape_p95_us": (self.probe_same_shape.latency_us.get("p95")
                                      if self.probe_same_shape else None),
                "gbps_vs_probe": self.gbps_vs_probe, "p95_vs_probe": self.p95_vs_probe,
            },
        }

    def format_table(self) -> str:
        lat, wait = self.request_latency.summary("us"), self.batch_wait.summary("ms")
        rows: List[tuple] = [
            ("epoch", f"{self.wall_seconds:.2f} s, {self.samples:,} samples, "
                      f"{self.batches:,} batches, {self.shards} shards, {self.workers} workers"),
            ("read", f"{format_size(self.bytes_read)} at {self.gbps:.3f} GB/s "
                     f"({self.samples_per_s:,.0f} samples/s)"),
            ("engine", f"{self.engine}, {'O_DIRECT' if self.direct else 'buffered fallback'}, "
                       f"{format_size(self.chunk_size)} x {self.queue_depth} in flight"),
            ("request latency", _percentiles(lat, "us")),
            ("batch wait", _percentiles(wait, "ms") + f"; {self.wait_share:.0%} of the epoch"),
        ]
        if self.indexing:
            used = [(name, v) for name, v in self.indexing.items() if v.get("shards")]
            rows.append(("index", "; ".join(
                f"{v['shards']:g} shard(s) from {name}: {format_size(int(v['bytes']))} read in "
                f"{v['seconds']:.2f} s" for name, v in used) or "none"))
        if self.disk is not None:
            util = self.disk.utilization
            rows.append(("device", f"{self.device}: read {self.disk.read_gbps:.3f} GB/s, write "
                                   f"{self.disk.write_gbps:.3f} GB/s, busy "
                                   f"{'-' if util is None else f'{util:.0%}'}"))
        if self.gbps_vs_probe is not None:
            rows.append(("vs probe", f"{self.gbps_vs_probe:.0%} of the probe's best read "
                                     f"({self.probe_best_read.gbps:.3f} GB/s)"))
        if self.p95_vs_probe is not None:
            rows.append(("p95 vs probe", f"{self.p95_vs_probe:.2f} x the probe's p95 at "
                                         f"{format_size(self.probe_same_shape.block_size)} x "
                                         f"{self.probe_same_shape.queue_depth}"))
        return "\n".join(f"{name:16s} {text}" for name, text in rows)

    def to_prometheus(self, prefix: str = "flashstream_epoch") -> str:
        """Prometheus text exposition (gauges and summaries) of the report."""
        lines: List[str] = []

        def gauge(name: str, value: Optional[float], help_text: str) -> None:
            if value is None:
                return
            lines.extend([f"# HELP {prefix}_{name} {help_text}", f"# TYPE {prefix}_{name} gauge",
                          f"{prefix}_{name} {value:.9g}"])

        def summary(name: str, hist: LatencyHistogram, help_text: str) -> None:
            lines.extend([f"# HELP {prefix}_{name} {help_text}",
                          f"# TYPE {prefix}_{name} summary"])
            for q in (50, 95, 99):
                value = hist.percentile(q)
                if value is not None:
                    lines.append(f'{prefix}_{name}{{quantile="{q / 100:g}"}} {value / 1e9:.9g}')
            lines.append(f"{prefix}_{name}_sum {hist.sum_ns / 1e9:.9g}")
            lines.append(f"{prefix}_{name}_count {hist.count}")

        gauge("seconds", self.wall_seconds, "Wall time of the epoch.")
        gauge("samples", self.samples, "Samples delivered.")
        gauge("read_bytes", self.bytes_read, "Bytes read from the drive.")
        gauge("read_gbps", self.gbps, "Read throughput, GB/s.")
        gauge("wait_share", self.wait_share, "Share of the epoch spent waiting for batches.")
        gauge("gbps_vs_probe", self.gbps_vs_probe, "Throughput over the probe's best read.")
        gauge("p95_vs_probe", self.p95_vs_probe, "Request p95 over the probe's p95.")
        summary("request_latency_seconds", self.request_latency, "Read request latency.")
        summary("batch_wait_seconds", self.batch_wait, "Time the loop waited per batch.")
        return "\n".join(lines) + "\n"


def _percentiles(summary: Dict[str, Optional[float]], unit: str) -> str:
    def fmt(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:,.1f}"

    return (f"p50 {fmt(summary['p50'])} / p95 {fmt(summary['p95'])} / p99 {fmt(summary['p99'])}"
            f" {unit} (n={summary['count']:,})")


class EpochMonitor:
    """Measure one epoch of a ShardStream as the training loop sees it.

    >>> monitor = EpochMonitor(stream, probe=flashstream.telemetry.probe.probe("/mnt/plc"))
    >>> for batch in monitor.track(loader):
    ...     train(batch)
    >>> print(monitor.report().format_table())
    """

    def __init__(self, stream, *, probe: Optional[ProbeResult] = None,
                 device: Optional[str] = None, sample_interval: Optional[float] = None) -> None:
        self.stream = stream
        self.probe = probe
        self.device = device if device is not None else _device_name(stream)
        self.sample_interval = sample_interval
        self.batch_wait = LatencyHistogram()
        self.batches = 0
        self._sampler: Optional[DiskSampler] = None
        self._disk: Optional[DiskDelta] = None
        self._wall = 0.0

    def track(self, batches: Iterable[T]) -> Iterator[T]:
        """Yield from ``batches`` (a DataLoader over the stream, or the stream), timing waits."""
        self.stream.reset_stats()
        self.batch_wait = LatencyHistogram()
        self.batches = 0
        self._sampler = DiskSampler(self.device, self.sample_interval).start()
        # Waits are appended raw and binned in bulk: the per-item cost must stay far below a
        # sample's, since "batches" may be single samples at hundreds of thousands a second.
        waits = array.array("q")
        clock = time.perf_counter_ns
        start = time.perf_counter()
        iterator = iter(batches)
        try:
            while True:
                asked = clock()
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                waits.append(clock() - asked)
                if len(waits) >= 1 << 16:
                    self._flush(waits)
                yield batch
        finally:
            self._wall = time.perf_counter() - start
            self._flush(waits)
            self._disk = self._sampler.stop()

    def _flush(self, waits: array.array) -> None:
        self.batch_wait.record_many(np.frombuffer(waits, dtype=np.int64))
        self.batches += len(waits)
        del waits[:]

    @property
    def disk_timeline(self):
        return self._sampler.timeline if self._sampler else []

    def report(self) -> EpochReport:
        totals = self.stream.stats()
        io = self.stream.io_settings
        report = EpochReport(
            wall_seconds=self._wall, samples=int(totals["samples"]), batches=self.batches,
            bytes_read=int(totals["bytes_read"]), shards=int(totals["shards"]),
            workers=int(totals["workers"]), engine=engine_name(io.engine),
            direct=totals["buffered_files"] == 0 and totals["direct_files"] > 0,
            chunk_size=io.chunk_size, queue_depth=io.queue_depth,
            request_latency=totals["latency"], batch_wait=self.batch_wait,
            device=self.device, disk=self._disk, errors=int(totals["errors"]),
            indexing=getattr(self.stream, "index_info", {}).get("by_source"))
        if self.probe is not None:
            report.probe_best_read = self.probe.best("read")
            report.probe_same_shape = self.probe.nearest("read", io.chunk_size, io.queue_depth)
        return report


def _device_name(stream) -> Optional[str]:
    try:
        return device_of(stream.local_paths[0], health=False).name
    except OSError:
        return None
