"""Indexing many shards at once, and checking sidecars against the shards they describe.

``flashstream index`` runs these: shards are scanned on several threads (each has its own C++
reader, and reading and scanning release the GIL), with one progress bar over all of them.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from tqdm import tqdm

from ..settings import IOSettings
from .index import ShardIndex, read_sidecar, scan_shards

__all__ = ["check_sidecars", "default_jobs", "scan_parallel"]


def default_jobs() -> int:
    """Shards scanned at once: a few, as one scan already keeps the drive's queue busy."""
    return max(1, min(4, os.cpu_count() or 1))


def scan_parallel(urls: Sequence[str], settings: IOSettings, *, jobs: int,
                  progress: bool = True) -> Tuple[List[Optional[ShardIndex]],
                                                  Dict[int, BaseException]]:
    """Scan every shard, ``jobs`` at a time. Returns the indexes (None where a shard failed)
    and the errors by position; a failed shard never stops the others."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    out: List[Optional[ShardIndex]] = [None] * len(urls)
    errors: Dict[int, BaseException] = {}

    def one(i: int) -> None:
        failed: Dict[int, BaseException] = {}
        (index,) = scan_shards([urls[i]], settings, lambda exn: True, failed)
        if failed:
            errors[i] = failed[0]
        else:
            out[i] = index

    bar = tqdm(total=len(urls), unit="shard", desc="flashstream: indexing",
               disable=not (progress and sys.stderr.isatty()))
    with bar, concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(one, i): i for i in range(len(urls))}
        for future in concurrent.futures.as_completed(futures):
            try:
                future.result()
            except (OSError, ValueError) as exn:
                errors[futures[future]] = exn
            bar.update(1)
    return out, errors


def check_sidecars(urls: Sequence[str], settings: IOSettings, *, jobs: int,
                   progress: bool = True) -> List[Dict[str, object]]:
    """For each shard: ``ok`` when its sidecar equals a fresh scan, else why not (``missing``,
    ``stale`` or malformed, ``differs``, or the shard's read ``error``)."""
    rows: List[Dict[str, object]] = [{"shard": url} for url in urls]
    present: List[Tuple[int, ShardIndex]] = []
    for i, url in enumerate(urls):
        try:
            index = read_sidecar(url)
        except ValueError as exn:
            rows[i].update(status="stale", detail=str(exn))
            continue
        if index is None:
            rows[i].update(status="missing")
        else:
            present.append((i, index))
    scanned, errors = scan_parallel([urls[i] for i, _ in present], settings, jobs=jobs,
                                    progress=progress)
    for j, (i, index) in enumerate(present):
        fresh = scanned[j]
        if fresh is None:
            rows[i].update(status="error", detail=str(errors.get(j)))
        elif (index.compression == fresh.compression and np.array_equal(index.offsets,
                                                                        fresh.offsets)
              and np.array_equal(index.ends, fresh.ends)):
            rows[i].update(status="ok", samples=index.count)
        else:
            rows[i].update(status="differs",
                           detail=f"sidecar has {index.count} samples, the shard "
                                  f"{fresh.count}" + _first_difference(index, fresh))
    return rows


def _first_difference(a: ShardIndex, b: ShardIndex) -> str:
    n = min(a.count, b.count)
    for i in range(n):
        if a.offsets[i] != b.offsets[i] or a.ends[i] != b.ends[i]:
            return (f"; sample {i} differs: sidecar [{a.offsets[i]}, {a.ends[i]}), shard "
                    f"[{b.offsets[i]}, {b.ends[i]})")
    return ""
