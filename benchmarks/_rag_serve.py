#!/usr/bin/env python3
"""One serving process of rag_qps.py's larger-than-memory runs: an IndexReader (mmap or
direct) in a memory cgroup that caps what it may cache, under open-loop load at the rates its
parent asks for, one level at a time (so that the parent can take turns between mmap and
direct at each level, and a noisy minute of the drive falls on both).

    python benchmarks/_rag_serve.py --index X --io direct --list-cache 52000000 \\
        --work DIR --cgroup /sys/fs/cgroup/memory/... --room 270000000 --out result.json

DIR holds pool.npy (query vectors), expected.npz (ids and distances FAISS in RAM returns for
each, one query at a time) and stream.npy (the pool index of each query in the stream). The
process joins the cgroup before it loads anything, opens the reader, evicts the index's page
cache, then sets the group's limit to its own memory other than page cache (anonymous and
kernel) plus ``--room`` (what it may cache), so an index of 2 x room is twice the memory it
may cache. Then a closed-loop warm-up of ``--warmup`` seconds, then it prints one JSON line
``{"ready": ...}`` and reads commands from stdin, one JSON object a line: ``{"qps": Q,
"seed": S}`` runs one open-loop level (continuing the stream where the last stopped) and
prints its summary as one JSON line; ``{"end": true}`` writes everything to ``--out`` and
exits. Every result is compared with FAISS in RAM; each summary says how many differed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _memcap import MemoryCap  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, required=True)
    p.add_argument("--io", choices=("mmap", "direct"), required=True)
    p.add_argument("--list-cache", type=int, default=0, help="direct: list cache bytes")
    p.add_argument("--nprobe", type=int, default=16)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--cgroup", type=Path, default=None)
    p.add_argument("--room", type=int, default=0, help="bytes the process may cache")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def misses(result, stream: np.ndarray, start: int, expected) -> int:
    """Queries whose ids or distances differ from FAISS in RAM's."""
    tail = len(stream) - start % len(stream)  # the run saw stream[start % len:], cycled
    pool = stream[start % len(stream) + result.qids % tail]
    ids, dists = expected["ids"][pool], expected["distances"][pool]
    k = result.labels.shape[1]
    bad = (result.labels != ids[:, :k]).any(axis=1) | (result.distances != dists[:, :k]).any(axis=1)
    return int(bad.sum())


def main(argv=None) -> int:
    args = parse_args(argv)
    cap: Optional[MemoryCap] = MemoryCap(args.cgroup) if args.cgroup else None
    if cap is not None:
        cap.join()  # before anything is loaded: all of it is charged to the group
    from flashstream import IndexReader
    from flashstream.retrieval.load import closed_loop, open_loop

    pool = np.load(args.work / "pool.npy")
    stream = np.load(args.work / "stream.npy")
    expected = dict(np.load(args.work / "expected.npz"))
    queries = pool[stream]
    reader = IndexReader(args.index, io=args.io, nprobe=args.nprobe,
                         list_cache=args.list_cache)
    out: Dict[str, object] = {"io": args.io, "info": None, "levels": []}
    if reader.evict() > 0.01:
        raise RuntimeError("the index is still cached after evict: another process maps it")
    if cap is not None:
        own = cap.uncached()
        cap.set_limit(own + args.room)
        out["memory"] = {"uncached_at_start": own, "anon_at_start": cap.anon(),
                         "cache_at_start": cap.usage()["cache"], "room": args.room,
                         "limit": own + args.room}
    start = time.perf_counter()
    warm = closed_loop(reader, queries, args.k, threads=args.threads, seconds=args.warmup)
    position = warm.queries
    out["warmup"] = dict(warm.summary(), wrong=misses(warm, stream, 0, expected),
                         seconds_total=time.perf_counter() - start)
    print(json.dumps({"ready": out["warmup"]["achieved_qps"]}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("end"):
            break
        # The stream goes on where the last run stopped (a view; it wraps only at its end).
        run = open_loop(reader, queries[position % len(queries):], args.k,
                        qps=command["qps"], seconds=args.duration, threads=args.threads,
                        seed=command["seed"])
        summary = run.summary()
        summary.update(wrong=misses(run, stream, position, expected), start=position,
                       residency=reader.residency(),
                       memory=cap.usage() if cap is not None else None)
        out["levels"].append(summary)
        position += run.queries
        print(json.dumps(summary, default=float), flush=True)
    info = reader.info()
    out["info"] = {k: v for k, v in info.items() if k != "direct"}
    out["direct"] = info["direct"]
    out["residency_after"] = reader.residency()  # the file's, whoever cached it
    out["memory_after"] = cap.usage() if cap is not None else None
    if cap is not None:  # what this process brought into the page cache, of any file
        added = out["memory_after"]["cache"] - out["memory"]["cache_at_start"]
        out["page_cache_added"] = max(0, added) / args.index.stat().st_size
    reader.close()
    args.out.write_text(json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
