"""rag_qps.py's direct-against-mmap measurements in the benchmark's own process: cold (the
caches emptied before every query) and warm (everything cached), on the same queries, every
result compared with FAISS in RAM."""

from __future__ import annotations

import statistics
from typing import Dict, List

import numpy as np
from tqdm import tqdm

from flashstream import IndexReader

MODES = ("mmap", "direct")


def expected_results(ram: IndexReader, pool: np.ndarray, k: int) -> Dict[str, np.ndarray]:
    """What FAISS in RAM returns for each query, one query at a time (as the servers call it:
    a batch may take another distance kernel and differ in the last bits)."""
    ids = np.empty((len(pool), k), dtype=np.int64)
    distances = np.empty((len(pool), k), dtype=np.float32)
    for i, q in enumerate(pool):
        distances[i], ids[i] = (row[0] for row in ram.index.search(q[None, :], k))
    return {"ids": ids, "distances": distances}


def _same(result, expected: Dict[str, np.ndarray], i: int) -> bool:
    distances, ids = result
    return bool((ids[0] == expected["ids"][i]).all()
                and (distances[0] == expected["distances"][i]).all())


def cold_per_query(readers: Dict[str, IndexReader], pool: np.ndarray,
                   expected: Dict[str, np.ndarray], k: int, count: int) -> Dict[str, object]:
    """Each query searched by each mode, the mode's caches emptied first (page cache; the
    list cache too for direct), the modes taking turns to go first."""
    wrong = {m: 0 for m in MODES}
    cached = {m: [] for m in MODES}
    for r in readers.values():
        r.reset_latency()
    for i in tqdm(range(count), desc="cold, per query", leave=False, disable=None):
        order = MODES if i % 2 == 0 else MODES[::-1]
        for mode in order:
            reader = readers[mode]
            cached[mode].append(reader.evict())
            if not _same(reader.search(pool[i % len(pool)], k), expected, i % len(pool)):
                wrong[mode] += 1
    out: Dict[str, object] = {"queries": count}
    for mode in MODES:
        out[mode] = {"latency_us": readers[mode].latency(reset=True).summary("us"),
                     "wrong": wrong[mode], "cached_before_max": max(cached[mode])}
    p = {m: out[m]["latency_us"] for m in MODES}
    out["p95_ratio"] = p["direct"]["p95"] / p["mmap"]["p95"]
    out["p50_ratio"] = p["direct"]["p50"] / p["mmap"]["p50"]
    return out


def warm(readers: Dict[str, IndexReader], pool: np.ndarray, expected: Dict[str, np.ndarray],
         k: int, rounds: int) -> Dict[str, object]:
    """Everything cached (mmap: the whole file in the page cache; direct: every list in the
    list cache), then one query at a time through the pool, the modes in alternating rounds."""
    with open(readers["mmap"].path, "rb") as f:
        while f.read(16 << 20):
            pass
    wrong = {m: 0 for m in MODES}
    for reader in readers.values():
        for q in pool:
            reader.search(q, k)
    p95: Dict[str, List[float]] = {m: [] for m in MODES}
    p50: Dict[str, List[float]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            reader = readers[mode]
            reader.reset_latency()
            for i, q in enumerate(pool):
                if not _same(reader.search(q, k), expected, i):
                    wrong[mode] += 1
            summary = reader.latency(reset=True).summary("us")
            p95[mode].append(summary["p95"])
            p50[mode].append(summary["p50"])
    out: Dict[str, object] = {"rounds": rounds, "queries_per_round": len(pool)}
    for mode in MODES:
        out[mode] = {"p95_us": statistics.median(p95[mode]),
                     "p50_us": statistics.median(p50[mode]), "p95_rounds_us": p95[mode],
                     "wrong": wrong[mode]}
    out["direct_stats"] = readers["direct"].info()["direct"]
    out["p95_ratio"] = out["direct"]["p95_us"] / out["mmap"]["p95_us"]
    return out
