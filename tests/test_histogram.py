"""The latency histogram: percentiles within 1% of numpy's, merging across processes."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

from flashstream.telemetry.histogram import LatencyHistogram

DISTRIBUTIONS = {
    "uniform": lambda rng, n: rng.uniform(1e3, 1e7, n),
    "exponential": lambda rng, n: rng.exponential(2e5, n) + 1e3,
    "lognormal": lambda rng, n: rng.lognormal(12, 1.5, n),
}


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_percentiles_match_numpy_within_one_percent(name):
    values = DISTRIBUTIONS[name](np.random.default_rng(0), 200_000)
    hist = LatencyHistogram()
    hist.record_many(values)
    assert hist.count == len(values)
    for q in (50, 95, 99, 99.9):
        exact = np.percentile(values, q, method="inverted_cdf")
        assert abs(hist.percentile(q) - exact) / exact <= 0.01, (q, hist.percentile(q), exact)
    assert hist.max_ns == int(values.max())


def test_single_record_and_summary_units():
    hist = LatencyHistogram()
    for ns in (1_000, 2_000, 3_000, 1_000_000):
        hist.record(ns)
    summary = hist.summary("us")
    assert summary["count"] == 4 and summary["max"] == 1000.0
    assert abs(summary["p50"] - 2.0) / 2.0 <= 0.01
    with pytest.raises(ValueError, match="ns, us, ms, s"):
        hist.summary("minutes")
    assert LatencyHistogram().percentile(50) is None


def _child(seed):
    hist = LatencyHistogram()
    hist.record_many(np.random.default_rng(seed).lognormal(11, 1, 50_000))
    return hist.to_dict()


def test_merge_across_processes_equals_one_histogram():
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        parts = pool.map(_child, [1, 2, 3])
    merged = LatencyHistogram.merged(LatencyHistogram.from_dict(p) for p in parts)
    whole = LatencyHistogram()
    for seed in (1, 2, 3):
        whole.record_many(np.random.default_rng(seed).lognormal(11, 1, 50_000))
    assert np.array_equal(merged.counts, whole.counts)
    assert merged.count == 150_000
    assert (merged.min_ns, merged.max_ns) == (whole.min_ns, whole.max_ns)
    assert abs(merged.sum_ns - whole.sum_ns) <= 3  # per-process int truncation of the sums
