"""Load generators (closed and open loop, recall) and benchmarks/rag_qps.py end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import child_env

faiss = pytest.importorskip("faiss")

from flashstream import IndexReader  # noqa: E402
from flashstream.retrieval.load import closed_loop, open_loop, recall_at_k  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
D = 16


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3000, D)).astype(np.float32)
    index = faiss.IndexFlatL2(D)
    index.add(x)
    path = tmp_path_factory.mktemp("load") / "flat.index"
    faiss.write_index(index, str(path))
    with IndexReader(path) as r:
        yield r


@pytest.fixture(scope="module")
def queries():
    return np.random.default_rng(1).standard_normal((50, D)).astype(np.float32)


def test_recall_at_k():
    truth = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    labels = np.array([[3, 1, 9], [-1, -1, -1]])
    assert recall_at_k(labels, truth) == pytest.approx(2 / 6)
    assert recall_at_k(truth[:, :3], truth) == 1.0


def test_closed_loop_counts_and_labels(reader, queries):
    reader.reset_latency()
    result = closed_loop(reader, queries, 5, threads=3, count=200)
    assert result.queries == 200 and result.latency.count == 200
    assert reader.latency().count == 200  # the reader's own histogram saw every call
    assert list(result.qids) == list(range(200))
    exact = reader.index.search(queries, 5)[1]
    np.testing.assert_array_equal(result.labels, exact[result.qids % len(queries)])
    summary = result.summary(exact)
    assert summary["recall"] == 1.0 and summary["achieved_qps"] > 0


@pytest.mark.timing
def test_closed_loop_for_a_duration(reader, queries):
    start = time.perf_counter()
    result = closed_loop(reader, queries, 3, threads=2, seconds=0.3)
    assert 0.25 < time.perf_counter() - start < 2.0
    assert result.queries > 10


def test_open_loop_follows_the_schedule(reader, queries):
    result = open_loop(reader, queries, 3, qps=400, seconds=0.5, threads=2, seed=3)
    assert result.queries == 200 and result.offered_qps == 400
    assert 250 < result.qps < 600  # Poisson arrivals over half a second
    assert result.qps == pytest.approx(result.extra["scheduled_qps"], rel=0.2)  # kept up
    # Latency counts from the scheduled time, so it is never below the service time alone.
    assert result.latency.percentile(50) >= result.service.percentile(50) * 0.99


def test_open_loop_counts_queueing_when_overloaded(reader, queries):
    """Offered far above capacity with one thread: latency grows with the backlog instead of
    staying at the service time (no coordinated omission)."""
    slow = _Slow(reader, 0.002)
    result = open_loop(slow, queries, 3, qps=2000, seconds=0.1, threads=1)
    assert result.queries == 200
    assert result.late > 100
    assert result.latency.percentile(95) > 20 * result.service.percentile(50)


class _Slow:
    def __init__(self, reader, seconds):
        self.reader, self.seconds = reader, seconds

    def search(self, q, k):
        time.sleep(self.seconds)
        return self.reader.search(q, k)


def test_bad_load_arguments(reader, queries):
    with pytest.raises(ValueError, match="threads"):
        closed_loop(reader, queries, 3, threads=0, count=1)
    with pytest.raises(ValueError, match="seconds or count"):
        closed_loop(reader, queries, 3)
    with pytest.raises(ValueError, match="positive"):
        open_loop(reader, queries, 3, qps=0, seconds=1)


@pytest.mark.engine_independent  # a smoke run of the benchmark script
def test_rag_bench_end_to_end(tmp_path):
    pytest.importorskip("matplotlib")
    out_json = tmp_path / "rag.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "rag_qps.py"), "--dir", str(tmp_path / "rag"),
         "--n", "6K", "--dim", "16", "--duration", "0.3", "--rounds", "1", "--qps", "100",
         "300", "--write-load", "--write-size", "16MiB", "--json", str(out_json),
         "--cold-queries", "6", "--warm-rounds", "1", "--capped-qps", "50", "200",
         "--warmup", "0.3", "--stream-length", "500", "--epoch-size", "64MiB"],
        capture_output=True, text=True, timeout=600, env=child_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "targets:" in out and "recall" in out and "QPS at p95" in out
    data = json.loads(out_json.read_text())
    names = [s["name"] for s in data["scenarios"]]
    assert names == ["RAM, warm", "mmap, warm", "mmap, cold", "direct, warm", "direct, cold",
                     "mmap, cold + unpaced write", "mmap, cold + paced write",
                     "direct, cold + unpaced write", "direct, cold + paced write"]
    for s in data["scenarios"]:
        assert s["io"] == s["name"].split(",")[0].lower()
        assert s["closed"]["achieved_qps"] > 0 and 0 < s["closed"]["recall"] <= 1
        assert [r["offered_qps"] for r in s["open"]] == [100, 300]
        for r in s["open"]:
            assert r["latency_us"]["p95"] > 0 and r["recall"] > 0
        if s["cold"]:  # evicted and verified before every run
            assert all(r["residency_before"] < 0.05 for r in [s["closed"], *s["open"]])
    loads = [s["write_load"] for s in data["scenarios"] if "write_load" in s]
    assert loads[0]["rate"] is None and loads[0]["bytes"] > 0
    assert loads[1]["rate"] == pytest.approx(loads[0]["gbps"] * 1e9 / 2)
    assert data["warm"]["ratio"] > 0 and data["recording"]["record_us"] > 0
    assert len(data["open"]) == 1  # too small for a 1 GB index: the served one, target n/a
    assert data["open"][0]["mmap_open_s"] > 0 and data["open"][0]["ram_load_s"] > 0
    assert data["environment"]["index"]["io_flag"] in ("IO_FLAG_MMAP_IFC", "IO_FLAG_MMAP")
    # Direct against mmap, cold and warm, every result equal to FAISS in RAM.
    cold, warm = data["cold_direct_vs_mmap"], data["warm_direct_vs_mmap"]
    assert cold["queries"] == 6 and cold["p95_ratio"] > 0 and warm["p95_ratio"] > 0
    assert cold["mmap"]["wrong"] == cold["direct"]["wrong"] == 0
    assert cold["direct"]["cached_before_max"] < 0.05
    assert warm["mmap"]["wrong"] == warm["direct"]["wrong"] == 0
    # Larger than memory: both modes under each load, on the same levels, results right.
    capped = data["capped"]
    assert list(capped["runs"]) == ["alone", "checkpoint", "epoch"]
    for condition, runs in capped["runs"].items():
        for io in ("mmap", "direct"):
            run = runs[io]
            assert run["io"] == io and run["info"]["io"] == io and run["wrong"] == 0
            assert run["levels"][0]["offered_qps"] == 50 and run["warmup"]["queries"] > 0
            assert (run["load"] is None) == (condition == "alone")
            if capped["capped"]:  # root and a memory controller: the limit was set
                assert run["memory"]["limit"] == run["memory"]["uncached_at_start"] + \
                    capped["room"]
        assert runs["direct"]["residency_after_warmup"] < 0.01  # O_DIRECT: no page cache
        if capped["capped"]:
            assert runs["direct"]["page_cache_added"] < 0.01
        assert runs["direct"]["direct"]["list_cache"]["budget"] == capped["list_cache"]
    assert capped["runs"]["epoch"]["mmap"]["load"]["bytes"] > 0
    verdicts = data["targets"]
    assert {"warm mmap QPS / warm in-RAM QPS", "recording latency, us per query",
            "mmap open time / in-RAM load time, IndexIVFFlat",
            "results differing from FAISS in RAM (queries)", "cold p95 direct / mmap, batch 1",
            "warm p95 direct / mmap",
            "QPS at the SLO direct / mmap, larger than memory, alone"} <= set(verdicts)
    assert verdicts["results differing from FAISS in RAM (queries)"]["met"]
    png = out_json.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "rag" / "write-load").exists()  # the write load cleaned up
    # A second run reuses the built index (cached by its parameters).
    again = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "rag_qps.py"), "--dir", str(tmp_path / "rag"),
         "--n", "6K", "--dim", "16", "--duration", "0.2", "--rounds", "1", "--qps", "100",
         "--no-open-test", "--no-capped", "--cold-queries", "2", "--warm-rounds", "1",
         "--json", str(tmp_path / "again.json")],
        capture_output=True, text=True, timeout=600, env=child_env(), cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    again_data = json.loads((tmp_path / "again.json").read_text())
    assert again_data["build"]["cached"] is True and again_data["capped"] is None
