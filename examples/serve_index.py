#!/usr/bin/env python3
"""Serve a FAISS index from the drive with IndexReader: its IVF lists fetched by O_DIRECT into a
list cache, searched from threads; read the tail latency, go cold, and swap in a new index file
while serving.

    python examples/serve_index.py [DIR]     # DIR on the drive to test (default: a temp dir)
"""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path

import faiss
import numpy as np

from flashstream import IndexReader, write_index


def build(n: int, d: int, seed: int) -> faiss.Index:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    index = faiss.IndexIVFFlat(faiss.IndexFlatL2(d), d, 64)
    index.train(x)
    index.add(x)
    return index


def main(directory: Path) -> None:
    path = directory / "docs.index"
    write_index(build(20_000, 64, seed=0), path)  # temp file + rename: readers never see half
    queries = np.random.default_rng(1).standard_normal((200, 64)).astype(np.float32)

    # io="auto": an IVF index is served direct (lists fetched as searches probe them, kept in
    # an 8 MiB list cache), the page cache left alone; io="mmap" would map the file instead.
    with IndexReader(path, nprobe=8, list_cache="8MiB") as reader:
        info = reader.info()
        print(f"opened {info['type']} ({info['ntotal']:,} vectors) in "
              f"{info['open_s'] * 1e3:.2f} ms, served {info['io']}"
              + (f" ({info['io_reason']})" if info["io_reason"] else ""))

        def serve(part: np.ndarray) -> None:
            for q in part:  # one query per call: one latency sample per query
                reader.search(q, 10)

        serve(queries)  # the first pass fetches the lists into the cache
        first = reader.latency(reset=True).summary("us")
        print(f"first pass: p50 {first['p50']:.0f} us, p95 {first['p95']:.0f} us")
        threads = [threading.Thread(target=serve, args=(part,))
                   for part in np.array_split(queries, 4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        warm = reader.latency(reset=True).summary("us")
        print(f"warm: {warm['count']} searches, p50 {warm['p50']:.0f} us, "
              f"p95 {warm['p95']:.0f} us, p99 {warm['p99']:.0f} us")
        if info["io"] == "direct":
            lists = reader.info()["direct"]["list_cache"]
            print(f"list cache: {lists['resident_bytes'] / 2**20:.1f} of "
                  f"{lists['budget'] / 2**20:.0f} MiB, hit rate {lists['hit_rate']:.0%}")

        # The page cache: 0% when served direct, the pages searched when memory-mapped.
        print(f"cached before evict: {reader.residency():.0%}, after: {reader.evict():.0%}")
        serve(queries)
        cold = reader.latency(reset=True).summary("us")
        print(f"cold: p95 {cold['p95']:.0f} us; cached now {reader.residency():.0%}")

        write_index(build(20_000, 64, seed=2), path)  # replace while serving
        print(f"still serving the old file: {reader.search(queries[0], 3)[1][0].tolist()}")
        print(f"refreshed: {reader.refresh()}; new ids: "
              f"{reader.search(queries[0], 3)[1][0].tolist()}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory(dir=".") as tmp:  # on disk, not tmpfs
            main(Path(tmp))
