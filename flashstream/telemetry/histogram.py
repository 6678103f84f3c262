"""Latency histograms in Python: the C++ core's log buckets, as numpy counts.

The core records per-request latency into fixed log-linear buckets (relative error under 1%);
Python receives the raw counts, merges them by addition (across workers, ranks or runs) and
computes percentiles here, so every histogram in flashstream has one bucket layout.
"""

from __future__ import annotations

import functools
from typing import Dict, Iterable, Optional, Sequence

import numpy as np

from .. import engine

__all__ = ["LatencyHistogram", "PERCENTILES"]

PERCENTILES = (50.0, 95.0, 99.0, 99.9)


@functools.lru_cache(maxsize=1)
def _bounds() -> np.ndarray:
    """Lower bound (ns) of every bucket, plus one past the last: edges[i] <= v < edges[i+1]."""
    lower = np.asarray(engine.histogram_bounds(), dtype=np.float64)
    top = lower[-1] * 2 if len(lower) < 2 else lower[-1] + (lower[-1] - lower[-2])
    return np.append(lower, top)


class LatencyHistogram:
    """Counts of latencies (nanoseconds) per bucket; mergeable, fixed memory."""

    __slots__ = ("counts", "min_ns", "max_ns", "sum_ns")

    def __init__(self, counts: Optional[Sequence[int]] = None, *, min_ns: Optional[int] = None,
                 max_ns: Optional[int] = None, sum_ns: int = 0) -> None:
        n = len(_bounds()) - 1
        self.counts = (np.zeros(n, dtype=np.uint64) if counts is None
                       else np.asarray(counts, dtype=np.uint64).copy())
        if self.counts.shape != (n,):
            raise ValueError(f"a histogram has {n} buckets, got {self.counts.shape}")
        self.min_ns, self.max_ns, self.sum_ns = min_ns, max_ns, int(sum_ns)

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    def record(self, ns: float) -> None:
        """Add one latency. For Python-side timings (batch waits); the core records its own."""
        ns = max(0, int(ns))
        index = int(np.searchsorted(_bounds(), ns, side="right")) - 1
        self.counts[min(index, len(self.counts) - 1)] += 1
        self.min_ns = ns if self.min_ns is None else min(self.min_ns, ns)
        self.max_ns = ns if self.max_ns is None else max(self.max_ns, ns)
        self.sum_ns += ns

    def record_many(self, values_ns: Sequence[float]) -> None:
        """Add many latencies at once (vectorized)."""
        values = np.maximum(np.asarray(values_ns, dtype=np.float64), 0)
        if values.size == 0:
            return
        self.counts += engine.latency_counts(values)
        low, high = int(values.min()), int(values.max())
        self.min_ns = low if self.min_ns is None else min(self.min_ns, low)
        self.max_ns = high if self.max_ns is None else max(self.max_ns, high)
        self.sum_ns += int(values.sum())

    def merge(self, other: LatencyHistogram) -> LatencyHistogram:
        """Add ``other`` into this histogram (in place) and return self."""
        self.counts += other.counts
        self.sum_ns += other.sum_ns
        mins = [v for v in (self.min_ns, other.min_ns) if v is not None]
        maxs = [v for v in (self.max_ns, other.max_ns) if v is not None]
        self.min_ns = min(mins) if mins else None
        self.max_ns = max(maxs) if maxs else None
        return self

    @classmethod
    def from_core(cls, raw: Dict[str, object]) -> LatencyHistogram:
        """From a core result dict's ``counts``, ``min_ns``, ``max_ns`` and ``sum_ns``."""
        return cls(raw["counts"], min_ns=raw["min_ns"], max_ns=raw["max_ns"],
                   sum_ns=raw["sum_ns"])

    @classmethod
    def merged(cls, histograms: Iterable[LatencyHistogram]) -> LatencyHistogram:
        out = cls()
        for h in histograms:
            out.merge(h)
        return out

    def percentile(self, q: float) -> Optional[float]:
        """The q-th percentile in ns (bucket midpoint, clamped to the observed min and max)."""
        if not 0 <= q <= 100:
            raise ValueError(f"percentile must be between 0 and 100, got {q}")
        total = self.count
        if total == 0:
            return None
        rank = max(1, int(np.ceil(q / 100.0 * total)))
        index = int(np.searchsorted(np.cumsum(self.counts), rank))
        edges = _bounds()
        value = (edges[index] + edges[index + 1]) / 2
        if self.min_ns is not None:
            value = max(value, self.min_ns)
        if self.max_ns is not None:
            value = min(value, self.max_ns)
        return float(value)

    def summary(self, unit: str = "us") -> Dict[str, Optional[float]]:
        """count, mean, p50/p95/p99/p99.9 and max in ``unit`` (ns, us, ms or s)."""
        scale = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}
        if unit not in scale:
            raise ValueError(f"unit must be one of {', '.join(scale)}, got {unit!r}")
        div = scale[unit]
        count = self.count
        out: Dict[str, Optional[float]] = {"count": count,
                                           "mean": self.sum_ns / count / div if count else None}
        for q in PERCENTILES:
            value = self.percentile(q)
            out[f"p{q:g}"] = value / div if value is not None else None
        out["max"] = self.max_ns / div if self.max_ns is not None else None
        return out

    def cdf(self) -> tuple:
        """(latency ns at each non-empty bucket's upper edge, cumulative fraction) for plots."""
        nonzero = np.nonzero(self.counts)[0]
        cumulative = np.cumsum(self.counts)[nonzero] / max(1, self.count)
        return _bounds()[nonzero + 1], cumulative

    def to_dict(self) -> Dict[str, object]:
        """Sparse JSON form: {bucket index: count} plus min, max, sum."""
        nonzero = np.nonzero(self.counts)[0]
        return {"buckets": {int(i): int(self.counts[i]) for i in nonzero},
                "min_ns": self.min_ns, "max_ns": self.max_ns, "sum_ns": self.sum_ns}

    @classmethod
    def from_dict(cls, data: Dict[str, object]) -> LatencyHistogram:
        out = cls(min_ns=data.get("min_ns"), max_ns=data.get("max_ns"),
                  sum_ns=int(data.get("sum_ns", 0)))
        for index, count in dict(data["buckets"]).items():
            out.counts[int(index)] = count
        return out

    def __repr__(self) -> str:
        s = self.summary("us")
        return (f"LatencyHistogram(count={s['count']}, p50={s['p50']}us, p95={s['p95']}us, "
                f"p99={s['p99']}us)")
