"""rag_qps.py's opening and timing costs: what recording a search's latency costs, and opening
an index by mmap against loading it into RAM."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Dict

import numpy as np

from flashstream import IndexReader, pagecache


def recording_cost(reader: IndexReader, query: np.ndarray, k: int, calls: int = 50_000,
                   rounds: int = 5) -> Dict[str, float]:
    """What timing a search costs: (1) the timer and histogram alone, per call (the target);
    (2) reader.search against the bare faiss call on a tiny flat index, alternating rounds
    (the whole wrapper, argument checks included)."""
    import faiss

    from flashstream import engine

    recorder = engine.LatencyRecorder()
    clock = time.perf_counter_ns
    per_call = []
    for _ in range(rounds):
        start = clock()
        for _ in range(calls):
            recorder.stop(clock())
        per_call.append((clock() - start) / calls)
    tiny_path = Path(reader.path).with_name(".tiny-flat.index")
    tiny = faiss.IndexFlatL2(reader.d)
    tiny.add(np.random.default_rng(0).standard_normal((16, reader.d)).astype(np.float32))
    faiss.write_index(tiny, str(tiny_path))
    q = np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32)
    overhead = []
    try:
        with IndexReader(tiny_path, mmap=False) as wrapped:
            bare = wrapped.index
            n = calls // 5
            for _ in range(rounds):
                start = clock()
                for _ in range(n):
                    bare.search(q, k)
                middle = clock()
                for _ in range(n):
                    wrapped.search(q, k)
                overhead.append(((clock() - middle) - (middle - start)) / n)
    finally:
        tiny_path.unlink(missing_ok=True)
    return {"record_us": statistics.median(per_call) / 1e3,
            "wrapper_overhead_us": statistics.median(overhead) / 1e3}


def open_times(path: Path, rounds: int = 3) -> Dict[str, object]:
    """Opening by mmap against reading into RAM, each from a cold page cache (median)."""
    mmap_s, ram_s = [], []
    for _ in range(rounds):
        for use_mmap, out in ((True, mmap_s), (False, ram_s)):
            pagecache.evict([path])
            start = time.perf_counter()
            reader = IndexReader(path, io="mmap", mmap=use_mmap)
            out.append(time.perf_counter() - start)
            if use_mmap:
                info = reader.info()
            reader.close()
    size = path.stat().st_size
    return {"path": str(path), "type": info["type"], "io_flag": info["io_flag"], "bytes": size,
            "mmap_open_s": statistics.median(mmap_s),
            "ram_load_s": statistics.median(ram_s), "mmap_runs_s": mmap_s, "ram_runs_s": ram_s,
            "ratio": statistics.median(mmap_s) / statistics.median(ram_s)}
