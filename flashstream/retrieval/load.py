"""Load generators for an IndexReader: closed loop (how fast can it go) and open loop (how does
latency hold up at a given arrival rate).

Open loop follows the schedule, not the server: query i is due at ``start + t_i`` (Poisson
arrivals at the offered rate), and its latency is measured from ``t_i`` to its completion. A
query that waits for a free thread is late, and the lateness counts (no coordinated omission:
a slow server cannot hide its queueing by slowing the client down).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np

from ..telemetry.histogram import LatencyHistogram

__all__ = ["LoadResult", "closed_loop", "open_loop", "recall_at_k"]


@dataclass
class LoadResult:
    """One load run. ``latency``: response time per query (open loop: from its scheduled time);
    ``service``: the search call alone. ``labels[j]`` and ``distances[j]`` are what the search
    returned for ``qids[j]``."""

    kind: str                      # "closed" or "open"
    threads: int
    offered_qps: Optional[float]   # open loop only
    queries: int
    seconds: float
    latency: LatencyHistogram
    service: LatencyHistogram
    qids: np.ndarray
    labels: np.ndarray
    distances: np.ndarray
    late: int = 0                  # open loop: queries that started over 1 ms after their time
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def qps(self) -> float:
        return self.queries / self.seconds if self.seconds > 0 else 0.0

    def summary(self, ground_truth: Optional[np.ndarray] = None) -> Dict[str, Any]:
        out = {"kind": self.kind, "threads": self.threads, "offered_qps": self.offered_qps,
               "achieved_qps": self.qps, "queries": self.queries, "seconds": self.seconds,
               "late": self.late, "latency_us": self.latency.summary("us"),
               "service_us": self.service.summary("us"),
               "recall": (recall_at_k(self.labels, ground_truth[self.qids % len(ground_truth)])
                          if ground_truth is not None and self.queries else None)}
        out.update(self.extra)
        return out


def recall_at_k(labels: np.ndarray, truth: np.ndarray) -> float:
    """Mean fraction of each query's true k nearest neighbours found among its k results."""
    k = labels.shape[1]
    truth = truth[:, :k]
    if truth.size == 0:
        return 0.0
    # Results are distinct ids (or -1 padding, never a true neighbour): count matches per row.
    hits = (labels[:, :, None] == truth[:, None, :]).any(axis=2).sum()
    return float(hits) / truth.size


class _Collector:
    """Per-thread result lists, merged at the end (no lock on the hot path)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._all: List[dict] = []
        self._lock = threading.Lock()

    def mine(self) -> dict:
        mine = getattr(self._local, "lists", None)
        if mine is None:
            mine = {"qid": [], "labels": [], "distances": [], "latency": [], "service": [],
                    "late": 0, "last": 0}
            self._local.lists = mine
            with self._lock:
                self._all.append(mine)
        return mine

    def result(self, kind: str, threads: int, offered: Optional[float], start_ns: int,
               k: int) -> LoadResult:
        latency, service = LatencyHistogram(), LatencyHistogram()
        qids: List[int] = []
        labels: List[np.ndarray] = []
        distances: List[np.ndarray] = []
        late = 0
        end_ns = start_ns
        for part in self._all:
            latency.record_many(part["latency"])
            service.record_many(part["service"])
            qids += part["qid"]
            labels += part["labels"]
            distances += part["distances"]
            late += part["late"]
            end_ns = max(end_ns, part["last"])
        order = np.argsort(qids, kind="stable")
        labels_array = (np.stack(labels)[order] if labels
                        else np.empty((0, k), dtype=np.int64))
        distances_array = (np.stack(distances)[order] if distances
                           else np.empty((0, k), dtype=np.float32))
        return LoadResult(kind, threads, offered, len(qids), (end_ns - start_ns) / 1e9,
                          latency, service, np.asarray(qids, dtype=np.int64)[order],
                          labels_array, distances_array, late)


def _timed_search(mine: dict, reader, queries: np.ndarray, k: int, i: int, *, due_ns: int,
                  start_ns: int) -> None:
    """Search query ``i`` and keep its results, its latency from ``due_ns`` and its service
    time."""
    distances, labels = reader.search(queries[i % len(queries)], k)
    done = time.perf_counter_ns()
    mine["qid"].append(i)
    mine["labels"].append(labels[0])
    mine["distances"].append(distances[0])
    mine["latency"].append(done - due_ns)
    mine["service"].append(done - start_ns)
    mine["last"] = done


def _turns(counter: Iterator[int], limit: float) -> Iterator[int]:
    """A caller thread's query numbers: the next ones not taken from the shared ``counter``
    (``next`` on an itertools.count is atomic), while below ``limit``."""
    for i in counter:
        if i >= limit:
            return
        yield i


def _run(threads: int, body: Callable[[], None]) -> None:
    errors: List[BaseException] = []

    def guarded() -> None:
        try:
            body()
        except BaseException as e:  # surfaced in the caller's thread below
            errors.append(e)

    workers = [threading.Thread(target=guarded, name=f"load-{i}") for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def _check(threads: int, k: int, queries: np.ndarray) -> np.ndarray:
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    if queries.ndim != 2 or len(queries) == 0:
        raise ValueError(f"queries must be a non-empty (n, d) array, got {queries.shape}")
    return queries


def closed_loop(reader, queries: np.ndarray, k: int, *, threads: int = 1,
                seconds: Optional[float] = None, count: Optional[int] = None) -> LoadResult:
    """``threads`` callers each searching one query after another, for ``seconds`` or until
    ``count`` queries (the query sample is cycled through): the maximum throughput."""
    queries = _check(threads, k, queries)
    if seconds is None and count is None:
        raise ValueError("give seconds or count (or both)")
    counter = itertools.count()
    collector = _Collector()
    start_ns = time.perf_counter_ns()
    deadline = start_ns + int(seconds * 1e9) if seconds is not None else None
    limit = count if count is not None else float("inf")

    def body() -> None:
        mine = collector.mine()
        for i in _turns(counter, limit):
            t0 = time.perf_counter_ns()
            if deadline is not None and t0 >= deadline:
                return
            _timed_search(mine, reader, queries, k, i, due_ns=t0, start_ns=t0)

    _run(threads, body)
    return collector.result("closed", threads, None, start_ns, k)


def open_loop(reader, queries: np.ndarray, k: int, *, qps: float, seconds: float,
              threads: int = 1, seed: int = 0) -> LoadResult:
    """Queries arriving at ``qps`` (Poisson, seeded) for ``seconds``, served by ``threads``
    callers; latency counts from each query's scheduled time."""
    queries = _check(threads, k, queries)
    if not qps > 0 or not seconds > 0:
        raise ValueError(f"qps and seconds must be positive, got {qps} and {seconds}")
    rng = np.random.default_rng(seed)
    total = max(1, int(round(qps * seconds)))
    due = np.cumsum(rng.exponential(1e9 / qps, size=total)).astype(np.int64)
    counter = itertools.count()
    collector = _Collector()
    start_ns = time.perf_counter_ns() + 2_000_000  # a little slack for the threads to start

    def body() -> None:
        mine = collector.mine()
        for i in _turns(counter, total):
            at = start_ns + int(due[i])
            wait = at - time.perf_counter_ns()
            if wait > 0:
                time.sleep(wait / 1e9)
            t0 = time.perf_counter_ns()
            if t0 - at > 1_000_000:
                mine["late"] += 1
            _timed_search(mine, reader, queries, k, i, due_ns=at, start_ns=t0)

    _run(threads, body)
    result = collector.result("open", threads, float(qps), start_ns, k)
    # The rate this particular Poisson schedule offered (it wanders around ``qps``): what
    # the achieved rate should be compared with to tell whether the server kept up.
    result.extra["scheduled_qps"] = total / (int(due[-1]) / 1e9) if due[-1] > 0 else float(qps)
    return result
