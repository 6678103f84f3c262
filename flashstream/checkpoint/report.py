"""What one checkpoint save did: the training stall, the background write, and how the write
compares with the drive's own (the probe's sequential write)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..sizes import format_size
from ..telemetry.histogram import LatencyHistogram
from ..telemetry.probe import ProbePoint, ProbeResult

__all__ = ["SaveReport"]


@dataclasses.dataclass
class SaveReport:
    """Figures of one save. Times in seconds; ``timeline`` rows are (seconds since the first
    write request, bytes completed in the interval, pacing rate in force in bytes/s, 0 when
    unpaced)."""

    step: int
    path: Path
    bytes: int               # file size
    stall_s: float           # save() time spent flattening and snapshotting: the training stall
    busy_wait_s: float       # save() time spent waiting for the previous save to finish
    write_s: float           # data and header requests, first submission to last completion
    sync_s: float            # truncate + fdatasync
    commit_s: float          # rename, directory syncs, marker (and, on rank 0, latest/retention)
    paused_s: float          # time the pacer held requests back
    rate_mode: str           # none | fixed | auto
    target_rate: float       # bytes/s asked for (0: unpaced; auto: the ceiling, if any)
    final_rate: float        # pacing rate in force at the end
    peak_rate: float         # auto: best window throughput
    sustained_rate: float    # auto: throughput after the cliff (0: no cliff seen)
    engine: str
    direct: bool
    chunk_size: int
    queue_depth: int
    latency: LatencyHistogram
    timeline: List[Tuple[float, int, float]]
    snapshot_mode: str = "copy"  # how the snapshot was taken (copy, or cow where it applied)
    cow: Optional[Dict[str, object]] = None  # copy-on-write statistics (faults, bytes, times)
    # Seconds from the save() call to the data write's first request: the stall, then (with
    # copy-on-write) the background copy, then planning.
    write_start_s: Optional[float] = None
    # The file was a pruned checkpoint's (recycle=True), written over: no block allocation.
    recycled: bool = False
    probe_write: Optional[ProbePoint] = None       # the probe's best sequential write
    probe_same_shape: Optional[ProbePoint] = None  # the probe's write at our request shape
    pacing: Optional[Dict[str, object]] = None  # auto: the plan, cache estimates, cliffs seen
    # Bytes the save's own requests wrote (data and header), and the bytes the drive's counter
    # says it took from every writer from the first request to the commit (None: no counter).
    # A save writes nothing else: what rate="auto" learns of the drive comes from these.
    written_bytes: int = 0
    drive_bytes: Optional[int] = None

    @property
    def gbps(self) -> float:
        """End-to-end background write speed: bytes over write + sync time."""
        seconds = self.write_s + self.sync_s
        return self.bytes / seconds / 1e9 if seconds else 0.0

    @property
    def achieved_rate(self) -> float:
        """Bytes/s over the write requests alone (what pacing controls)."""
        return self.bytes / self.write_s if self.write_s else 0.0

    def compare(self, probe: Optional[ProbeResult]) -> SaveReport:
        """Attach the probe's write figures (best, and at this request shape)."""
        if probe is not None:
            self.probe_write = probe.best("write")
            self.probe_same_shape = probe.nearest("write", self.chunk_size, self.queue_depth)
        return self

    @property
    def gbps_vs_probe(self) -> Optional[float]:
        best = self.probe_write
        return self.gbps / best.gbps if best and best.gbps else None

    @property
    def p95_vs_probe(self) -> Optional[float]:
        ours = self.latency.percentile(95)
        theirs = self.probe_same_shape.latency_us.get("p95") if self.probe_same_shape else None
        return ours / 1e3 / theirs if ours and theirs else None

    def to_dict(self) -> Dict[str, object]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("latency", "probe_write", "probe_same_shape", "path")}
        out.update(path=str(self.path), gbps=self.gbps, achieved_rate=self.achieved_rate,
                   latency_us=self.latency.summary("us"),
                   timeline=[list(row) for row in self.timeline],
                   probe={"best_write_gbps": self.probe_write.gbps if self.probe_write else None,
                          "same_shape_p95_us": (self.probe_same_shape.latency_us.get("p95")
                                                if self.probe_same_shape else None),
                          "gbps_vs_probe": self.gbps_vs_probe,
                          "p95_vs_probe": self.p95_vs_probe})
        return out

    def format_table(self) -> str:
        lat = self.latency.summary("ms")
        pct = "/".join("-" if lat[k] is None else f"{lat[k]:.2f}" for k in ("p50", "p95", "p99"))
        pacing = {"none": "unpaced", "fixed": f"fixed {self.target_rate / 1e6:,.0f} MB/s",
                  "auto": "auto"}.get(self.rate_mode, self.rate_mode)
        if self.rate_mode == "auto":
            pacing += (f", cliff at peak {self.peak_rate / 1e9:.2f} GB/s -> paced "
                       f"{self.final_rate / 1e9:.2f} GB/s" if self.sustained_rate
                       else f", no cliff (peak {self.peak_rate / 1e9:.2f} GB/s)")
        rows = [
            ("checkpoint", f"step {self.step}: {format_size(self.bytes)} -> {self.path}"),
            ("stall", f"{self.stall_s * 1e3:,.1f} ms snapshot ({self.snapshot_mode})"
                      + (f" (+{self.busy_wait_s * 1e3:,.1f} ms waiting for the previous save)"
                         if self.busy_wait_s > 1e-3 else "")),
            ("write", f"{self.write_s:.2f} s + sync {self.sync_s:.2f} s = {self.gbps:.3f} GB/s "
                      f"({pacing}; paused {self.paused_s:.2f} s)"
                      + ("; over a recycled file" if self.recycled else "")),
            ("engine", f"{self.engine}, {'O_DIRECT' if self.direct else 'buffered fallback'}, "
                       f"{format_size(self.chunk_size)} x {self.queue_depth} in flight"),
            ("write latency", f"p50/p95/p99 {pct} ms per request (n={lat['count']:,})"),
            ("commit", f"{self.commit_s * 1e3:,.1f} ms"),
        ]
        if self.gbps_vs_probe is not None:
            rows.append(("vs probe", f"{self.gbps_vs_probe:.0%} of the probe's best write "
                                     f"({self.probe_write.gbps:.3f} GB/s)"))
        if self.p95_vs_probe is not None:
            rows.append(("p95 vs probe", f"{self.p95_vs_probe:.2f} x the probe's p95 at "
                                         f"{format_size(self.probe_same_shape.block_size)} x "
                                         f"{self.probe_same_shape.queue_depth}"))
        return "\n".join(f"{name:14s} {text}" for name, text in rows)
